#include "layout/share_header.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <limits>
#include <optional>
#include <type_traits>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "layout/json_depth.h"

namespace kvshare::layout {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kFormatName = "kvshare-layout";
// Bounds that keep a hostile header from asking for absurd work: a real one for 512
// layers is well under 1 MiB and nests 5 levels deep.
constexpr size_t kMaxHeaderBytes = 16u << 20;
constexpr int kMaxDepth = 16;
constexpr size_t kMaxTensors = 8 * 512;
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 50;  // keeps every sum far from 2^64
constexpr int64_t kMaxExtent = int64_t{1} << 40;

// FNV-1a (bytes) over what identifies a tensor; the model's tensor list hashed in file order.
constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

uint64_t fnv_bytes(uint64_t hash, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) hash = (hash ^ bytes[i]) * kFnvPrime;
  return hash;
}

uint64_t fnv_le(uint64_t hash, uint64_t value, int n_bytes) {
  for (int i = 0; i < n_bytes; ++i) hash = (hash ^ ((value >> (8 * i)) & 0xff)) * kFnvPrime;
  return hash;
}

std::string hex64(uint64_t value) { return fmt::format("{:#018x}", value); }

std::string_view swa_type_name(SwaType type) {
  switch (type) {
    case SwaType::none:
      return "none";
    case SwaType::standard:
      return "standard";
    case SwaType::chunked:
      return "chunked";
  }
  return "none";
}

// ---- serialization ----

Json params_json(const KvParams& p) {
  Json j;
  j["n_ctx"] = p.n_ctx;
  j["n_seq_max"] = p.n_seq_max;
  j["kv_unified"] = p.kv_unified;
  j["type_k"] = ggml_type_name(p.type_k);
  j["type_v"] = ggml_type_name(p.type_v);
  j["flash_attn"] = p.flash_attn;
  j["swa_full"] = p.swa_full;
  j["n_ubatch"] = p.n_ubatch;
  return j;
}

Json memory_json(const MemoryShape& m) {
  Json j;
  j["kind"] = memory_kind_name(m.kind);
  j["n_ctx"] = m.n_ctx;
  j["n_ctx_seq"] = m.n_ctx_seq;
  j["n_pos_per_embd"] = m.n_pos_per_embd;
  Json caches = Json::array();
  for (const auto& c : m.kv_caches) {
    Json cj;
    cj["role"] = c.role;
    cj["kv_size"] = c.kv_size;
    cj["n_stream"] = c.n_stream;
    cj["type_k"] = ggml_type_name(c.type_k);
    cj["type_v"] = ggml_type_name(c.type_v);
    cj["v_trans"] = c.v_trans;
    cj["n_swa"] = c.n_swa;
    cj["swa_type"] = swa_type_name(c.swa_type);
    cj["v_width"] = c.v_width;
    Json layers = Json::array();
    for (const auto& l : c.layers)
      layers.push_back(
          Json{{"il", l.il}, {"n_embd_k_gqa", l.n_embd_k_gqa}, {"n_embd_v_gqa", l.n_embd_v_gqa}, {"has_v", l.has_v}});
    cj["layers"] = std::move(layers);
    caches.push_back(std::move(cj));
  }
  j["kv_caches"] = std::move(caches);
  if (m.recurrent) {
    Json rj;
    rj["rs_size"] = m.recurrent->rs_size;
    rj["n_layer"] = m.recurrent->n_layer;
    Json layers = Json::array();
    for (const auto& l : m.recurrent->layers)
      layers.push_back(Json{{"il", l.il}, {"n_embd_r", l.n_embd_r}, {"n_embd_s", l.n_embd_s}});
    rj["layers"] = std::move(layers);
    j["recurrent"] = std::move(rj);
  } else {
    j["recurrent"] = nullptr;
  }
  return j;
}

// ---- parsing: a cursor that knows the dotted path of the field it reads ----

class Field {
 public:
  Field(const Json& value, std::string path, std::string_view source)
      : value_(value), path_(std::move(path)), source_(source) {}

  const std::string& path() const { return path_; }
  const Json& json() const { return value_; }

  template <class... Args>
  tl::unexpected<Error> error(fmt::format_string<Args...> format, Args&&... args) const {
    return fail(EINVAL, "{}: field \"{}\" {}", source_, path_, fmt::format(format, std::forward<Args>(args)...));
  }

  Result<Field> member(std::string_view name) const {
    if (!value_.is_object()) return error("is {}, expected an object", value_.type_name());
    auto it = value_.find(name);
    const std::string child = path_.empty() ? std::string(name) : path_ + "." + std::string(name);
    if (it == value_.end()) return fail(EINVAL, "{}: field \"{}\" is missing", source_, child);
    return Field(*it, child, source_);
  }

  Result<std::vector<Field>> elements(size_t max_count) const {
    if (!value_.is_array()) return error("is {}, expected an array", value_.type_name());
    if (value_.size() > max_count) return error("has {} elements, at most {} are allowed", value_.size(), max_count);
    std::vector<Field> out;
    out.reserve(value_.size());
    for (size_t i = 0; i < value_.size(); ++i) out.emplace_back(value_[i], fmt::format("{}[{}]", path_, i), source_);
    return out;
  }

  Result<uint64_t> as_u64(uint64_t max = std::numeric_limits<uint64_t>::max()) const {
    if (!value_.is_number_integer()) return error("is {}, expected an unsigned integer", describe());
    if (value_.is_number_unsigned()) {
      const uint64_t v = value_.get<uint64_t>();
      if (v > max) return error("is {}, at most {} is allowed", v, max);
      return v;
    }
    const int64_t v = value_.get<int64_t>();
    if (v < 0) return error("is {}, expected an unsigned integer", v);
    if (static_cast<uint64_t>(v) > max) return error("is {}, at most {} is allowed", v, max);
    return static_cast<uint64_t>(v);
  }
  Result<uint32_t> as_u32() const {
    auto v = as_u64(std::numeric_limits<uint32_t>::max());
    if (!v) return fail(v.error());
    return static_cast<uint32_t>(*v);
  }
  Result<bool> as_bool() const {
    if (!value_.is_boolean()) return error("is {}, expected true or false", describe());
    return value_.get<bool>();
  }
  Result<std::string> as_string() const {
    if (!value_.is_string()) return error("is {}, expected a string", describe());
    return value_.get<std::string>();
  }
  // A 64-bit value written as "0x" and 16 hex digits (JSON numbers lose bits past 2^53).
  Result<uint64_t> as_hex64() const {
    auto text = as_string();
    if (!text) return fail(text.error());
    if (text->size() != 18 || text->compare(0, 2, "0x") != 0)
      return error("is \"{}\", expected \"0x\" and 16 hex digits", *text);
    uint64_t v = 0;
    for (size_t i = 2; i < text->size(); ++i) {
      const char c = (*text)[i];
      int digit;
      if (c >= '0' && c <= '9')
        digit = c - '0';
      else if (c >= 'a' && c <= 'f')
        digit = c - 'a' + 10;
      else
        return error("is \"{}\", expected lower-case hex digits", *text);
      v = (v << 4) | static_cast<uint64_t>(digit);
    }
    return v;
  }
  Result<GgmlType> as_cache_type() const {
    auto text = as_string();
    if (!text) return fail(text.error());
    auto type = parse_cache_type(*text);
    if (!type) return error("is \"{}\": {}", *text, type.error().message());
    return *type;
  }

 private:
  std::string describe() const {
    if (value_.is_string()) return fmt::format("the string \"{}\"", value_.get<std::string>());
    return value_.type_name();
  }
  const Json& value_;
  std::string path_;
  std::string_view source_;
};

// Reads `name` of `parent` with `read` (a Field member function) into `out`.
#define KVSHARE_FIELD(parent, name, read, out)                              \
  do {                                                                      \
    KVSHARE_TRY_ASSIGN(const Field& kvshare_field_, (parent).member(name)); \
    KVSHARE_TRY_ASSIGN(out, kvshare_field_.read());                         \
  } while (0)

// Declares `out`, the member `name` of `parent`.
#define KVSHARE_CHILD(parent, name, out) KVSHARE_TRY_ASSIGN(const Field& out, (parent).member(name))

Result<ModelFingerprint> parse_model(const Field& f) {
  ModelFingerprint m;
  KVSHARE_FIELD(f, "arch", as_string, m.arch);
  KVSHARE_FIELD(f, "name", as_string, m.name);
  KVSHARE_FIELD(f, "n_layer", as_u32, m.n_layer);
  KVSHARE_FIELD(f, "n_embd", as_u32, m.n_embd);
  KVSHARE_FIELD(f, "n_vocab", as_u32, m.n_vocab);
  KVSHARE_FIELD(f, "tensors_hash", as_hex64, m.tensors_hash);
  return m;
}

Result<KvParams> parse_params(const Field& f) {
  KvParams p;
  KVSHARE_FIELD(f, "n_ctx", as_u32, p.n_ctx);
  KVSHARE_FIELD(f, "n_seq_max", as_u32, p.n_seq_max);
  KVSHARE_FIELD(f, "kv_unified", as_bool, p.kv_unified);
  KVSHARE_FIELD(f, "type_k", as_cache_type, p.type_k);
  KVSHARE_FIELD(f, "type_v", as_cache_type, p.type_v);
  KVSHARE_FIELD(f, "flash_attn", as_bool, p.flash_attn);
  KVSHARE_FIELD(f, "swa_full", as_bool, p.swa_full);
  KVSHARE_FIELD(f, "n_ubatch", as_u32, p.n_ubatch);
  if (auto valid = validate(p); !valid) return f.error("{}", valid.error().message());
  return p;
}

Result<MemoryKind> parse_memory_kind(const Field& f) {
  auto text = f.as_string();
  if (!text) return fail(text.error());
  for (MemoryKind kind : {MemoryKind::none, MemoryKind::kv, MemoryKind::kv_iswa, MemoryKind::recurrent,
                          MemoryKind::hybrid, MemoryKind::hybrid_iswa})
    if (memory_kind_name(kind) == *text) return kind;
  return f.error("is \"{}\", expected none, kv, kv_iswa, recurrent, hybrid or hybrid_iswa", *text);
}

Result<SwaType> parse_swa_type(const Field& f) {
  auto text = f.as_string();
  if (!text) return fail(text.error());
  for (SwaType type : {SwaType::none, SwaType::standard, SwaType::chunked})
    if (swa_type_name(type) == *text) return type;
  return f.error("is \"{}\", expected none, standard or chunked", *text);
}

constexpr size_t kMaxLayers = 512;

Result<KvCacheShape> parse_kv_cache(const Field& f) {
  KvCacheShape c;
  KVSHARE_CHILD(f, "role", role_field);
  auto role = role_field.as_string();
  if (!role) return fail(role.error());
  if (*role != "kv" && *role != "base" && *role != "swa")
    return role_field.error("is \"{}\", expected kv, base or swa", *role);
  c.role = *role;
  KVSHARE_FIELD(f, "kv_size", as_u32, c.kv_size);
  KVSHARE_FIELD(f, "n_stream", as_u32, c.n_stream);
  KVSHARE_FIELD(f, "type_k", as_cache_type, c.type_k);
  KVSHARE_FIELD(f, "type_v", as_cache_type, c.type_v);
  KVSHARE_FIELD(f, "v_trans", as_bool, c.v_trans);
  KVSHARE_FIELD(f, "n_swa", as_u32, c.n_swa);
  KVSHARE_CHILD(f, "swa_type", swa_field);
  auto swa = parse_swa_type(swa_field);
  if (!swa) return fail(swa.error());
  c.swa_type = *swa;
  KVSHARE_FIELD(f, "v_width", as_u32, c.v_width);
  KVSHARE_CHILD(f, "layers", layers_field);
  auto layers = layers_field.elements(kMaxLayers);
  if (!layers) return fail(layers.error());
  for (const Field& lf : *layers) {
    KvCacheLayer l;
    KVSHARE_FIELD(lf, "il", as_u32, l.il);
    KVSHARE_FIELD(lf, "n_embd_k_gqa", as_u32, l.n_embd_k_gqa);
    KVSHARE_FIELD(lf, "n_embd_v_gqa", as_u32, l.n_embd_v_gqa);
    KVSHARE_FIELD(lf, "has_v", as_bool, l.has_v);
    if (!c.layers.empty() && l.il <= c.layers.back().il)
      return lf.error("has il {} after il {}: layers must ascend", l.il, c.layers.back().il);
    c.layers.push_back(l);
  }
  return c;
}

Result<std::optional<RecurrentShape>> parse_recurrent(const Field& f) {
  if (f.json().is_null()) return std::optional<RecurrentShape>();
  RecurrentShape r;
  KVSHARE_FIELD(f, "rs_size", as_u32, r.rs_size);
  KVSHARE_FIELD(f, "n_layer", as_u32, r.n_layer);
  KVSHARE_CHILD(f, "layers", layers_field);
  auto layers = layers_field.elements(kMaxLayers);
  if (!layers) return fail(layers.error());
  for (const Field& lf : *layers) {
    RecurrentLayer l;
    KVSHARE_FIELD(lf, "il", as_u32, l.il);
    KVSHARE_FIELD(lf, "n_embd_r", as_u32, l.n_embd_r);
    KVSHARE_FIELD(lf, "n_embd_s", as_u32, l.n_embd_s);
    if (!r.layers.empty() && l.il <= r.layers.back().il)
      return lf.error("has il {} after il {}: layers must ascend", l.il, r.layers.back().il);
    r.layers.push_back(l);
  }
  return std::optional<RecurrentShape>(std::move(r));
}

Result<MemoryShape> parse_memory(const Field& f) {
  MemoryShape m;
  KVSHARE_CHILD(f, "kind", kind_field);
  auto kind = parse_memory_kind(kind_field);
  if (!kind) return fail(kind.error());
  m.kind = *kind;
  KVSHARE_FIELD(f, "n_ctx", as_u32, m.n_ctx);
  KVSHARE_FIELD(f, "n_ctx_seq", as_u32, m.n_ctx_seq);
  KVSHARE_FIELD(f, "n_pos_per_embd", as_u32, m.n_pos_per_embd);
  KVSHARE_CHILD(f, "kv_caches", caches_field);
  auto caches = caches_field.elements(2);
  if (!caches) return fail(caches.error());
  for (const Field& cf : *caches) {
    auto cache = parse_kv_cache(cf);
    if (!cache) return fail(cache.error());
    m.kv_caches.push_back(std::move(*cache));
  }
  KVSHARE_CHILD(f, "recurrent", recurrent_field);
  auto recurrent = parse_recurrent(recurrent_field);
  if (!recurrent) return fail(recurrent.error());
  m.recurrent = std::move(*recurrent);

  // What llama_model::create_memory builds for each kind.
  const bool iswa = m.kind == MemoryKind::kv_iswa || m.kind == MemoryKind::hybrid_iswa;
  const size_t want_caches = m.kind == MemoryKind::none || m.kind == MemoryKind::recurrent ? 0 : iswa ? 2 : 1;
  if (m.kv_caches.size() != want_caches)
    return caches_field.error("has {} caches, memory of kind {} has {}", m.kv_caches.size(), memory_kind_name(m.kind),
                              want_caches);
  const bool want_recurrent =
      m.kind == MemoryKind::recurrent || m.kind == MemoryKind::hybrid || m.kind == MemoryKind::hybrid_iswa;
  if (m.recurrent.has_value() != want_recurrent)
    return recurrent_field.error("is {}, memory of kind {} {} recurrent state", m.recurrent ? "an object" : "null",
                                 memory_kind_name(m.kind), want_recurrent ? "has" : "has no");
  return m;
}

Result<ShareChunk> parse_chunk(const Field& f) {
  ShareChunk c;
  KVSHARE_FIELD(f, "cache_index", as_u32, c.cache_index);
  KVSHARE_FIELD(f, "size_bytes", as_u64, c.size_bytes);
  KVSHARE_FIELD(f, "layout_hash", as_hex64, c.layout_hash);
  if (c.size_bytes < kShareAlign || c.size_bytes % kShareAlign != 0)
    return f.error("has size_bytes {}, expected a multiple of {} of at least {}", c.size_bytes, kShareAlign,
                   kShareAlign);
  return c;
}

Result<TensorKind> parse_kind(const Field& f) {
  auto text = f.as_string();
  if (!text) return fail(text.error());
  for (TensorKind kind : {TensorKind::k, TensorKind::v, TensorKind::r, TensorKind::s})
    if (tensor_kind_name(kind) == *text) return kind;
  return f.error("is \"{}\", expected k, v, r or s", *text);
}

Result<GgmlType> parse_tensor_type(const Field& f) {
  auto text = f.as_string();
  if (!text) return fail(text.error());
  // Recurrent state is f32; caches hold what -ctk/-ctv accept.
  auto type = parse_cache_type(*text);
  if (!type)
    return f.error("is \"{}\", not a cache type (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl)", *text);
  return *type;
}

// Field checks of one tensor placement; cross checks happen once everything is read.
Result<SharedTensor> parse_tensor(const Field& f) {
  SharedTensor s;
  CacheTensor& t = s.tensor;
  KVSHARE_FIELD(f, "name", as_string, t.name);
  KVSHARE_FIELD(f, "cache_index", as_u32, s.cache_index);
  KVSHARE_FIELD(f, "layer", as_u32, t.layer);
  KVSHARE_CHILD(f, "kind", kind_field);
  auto kind = parse_kind(kind_field);
  if (!kind) return fail(kind.error());
  t.kind = *kind;
  KVSHARE_CHILD(f, "type", type_field);
  auto type = parse_tensor_type(type_field);
  if (!type) return fail(type.error());
  t.type = *type;
  KVSHARE_CHILD(f, "ne", ne_field);
  auto ne = ne_field.elements(4);
  if (!ne) return fail(ne.error());
  if (ne->size() != 4) return ne_field.error("has {} elements, expected 4", ne->size());
  for (size_t d = 0; d < 4; ++d) {
    auto extent = (*ne)[d].as_u64(static_cast<uint64_t>(kMaxExtent));
    if (!extent) return fail(extent.error());
    t.ne[d] = static_cast<int64_t>(*extent);
  }
  KVSHARE_FIELD(f, "row_bytes", as_u64, t.row_bytes);
  KVSHARE_FIELD(f, "nbytes", as_u64, t.nbytes);
  KVSHARE_FIELD(f, "chunk", as_u32, s.chunk);
  KVSHARE_FIELD(f, "offset", as_u64, s.offset);
  KVSHARE_FIELD(f, "padded_bytes", as_u64, s.padded_bytes);

  if (!is_row_aligned(t.type, t.ne[0]))
    return f.error("has ne[0] {}, not a multiple of {}'s block size", t.ne[0], ggml_type_name(t.type));
  const uint64_t row = ggml_row_size(t.type, t.ne[0]);
  if (t.row_bytes != row)
    return f.error("has row_bytes {}, ggml_row_size({}, {}) is {}", t.row_bytes, ggml_type_name(t.type), t.ne[0], row);
  uint64_t total = row;
  for (size_t d = 1; d < 4; ++d) {
    if (__builtin_mul_overflow(total, static_cast<uint64_t>(t.ne[d]), &total) || total > kMaxTensorBytes)
      return f.error("describes more than the 2^50 bytes a header may place in one tensor");
  }
  if (t.nbytes != total) return f.error("has nbytes {}, its type and ne give {}", t.nbytes, total);
  if (s.offset % kShareAlign != 0) return f.error("has offset {}, not a multiple of {}", s.offset, kShareAlign);
  return s;
}

#undef KVSHARE_FIELD
#undef KVSHARE_CHILD

std::string describe_value(const std::string& value) { return fmt::format("\"{}\"", value); }
std::string describe_value(bool value) { return value ? "true" : "false"; }
template <class T>
std::string describe_value(const T& value) {
  return fmt::format("{}", value);
}

// Cross checks that need the whole document: every tensor in a chunk of its cache, each
// cache's tensors agreeing with the cache's geometry, and the layout (chunking, offsets,
// hashes) equal to what share_layout computes from the tensors.
Result<void> check_consistency(const ShareHeader& h, std::string_view source) {
  const size_t n_objects = h.memory.kv_caches.size() + (h.memory.recurrent ? 1 : 0);
  for (size_t c = 0; c < h.layout.chunks.size(); ++c)
    if (h.layout.chunks[c].cache_index >= n_objects)
      return fail(EINVAL, "{}: field \"chunks[{}].cache_index\" is {}, the memory has {} cache objects", source, c,
                  h.layout.chunks[c].cache_index, n_objects);
  for (size_t i = 0; i < h.layout.tensors.size(); ++i) {
    const SharedTensor& s = h.layout.tensors[i];
    const CacheTensor& t = s.tensor;
    const auto where = [&](std::string_view field) {
      return fmt::format("{}: field \"tensors[{}].{}\" ({})", source, i, field, t.name);
    };
    if (s.cache_index >= n_objects)
      return fail(EINVAL, "{} is {}, the memory has {} cache objects", where("cache_index"), s.cache_index, n_objects);
    if (s.chunk >= h.layout.chunks.size())
      return fail(EINVAL, "{} is {}, the header has {} chunks", where("chunk"), s.chunk, h.layout.chunks.size());
    const ShareChunk& chunk = h.layout.chunks[s.chunk];
    if (chunk.cache_index != s.cache_index)
      return fail(EINVAL, "{} is {}, which belongs to cache object {}, not {}", where("chunk"), s.chunk,
                  chunk.cache_index, s.cache_index);
    if (s.offset > chunk.size_bytes || s.padded_bytes > chunk.size_bytes - s.offset)
      return fail(EINVAL, "{} is {} with {} padded bytes, past the end of chunk {} ({} bytes)", where("offset"),
                  s.offset, s.padded_bytes, s.chunk, chunk.size_bytes);
    if (s.cache_index < h.memory.kv_caches.size()) {
      const KvCacheShape& cache = h.memory.kv_caches[s.cache_index];
      const bool is_k = t.kind == TensorKind::k;
      if (!is_k && t.kind != TensorKind::v)
        return fail(EINVAL, "{} is \"{}\" in a KV cache", where("kind"), tensor_kind_name(t.kind));
      if (t.type != (is_k ? cache.type_k : cache.type_v))
        return fail(EINVAL, "{} is \"{}\", its cache holds \"{}\"", where("type"), ggml_type_name(t.type),
                    ggml_type_name(is_k ? cache.type_k : cache.type_v));
      if (t.ne[1] != cache.kv_size || t.ne[2] != cache.n_stream || t.ne[3] != 1)
        return fail(EINVAL, "{} is [{}, {}, {}, {}], its cache has kv_size {} and n_stream {}", where("ne"), t.ne[0],
                    t.ne[1], t.ne[2], t.ne[3], cache.kv_size, cache.n_stream);
    } else {
      if (t.kind != TensorKind::r && t.kind != TensorKind::s)
        return fail(EINVAL, "{} is \"{}\" in the recurrent state", where("kind"), tensor_kind_name(t.kind));
      if (t.type != GgmlType::F32)
        return fail(EINVAL, "{} is \"{}\", recurrent state is f32", where("type"), ggml_type_name(t.type));
      if (t.ne[1] != h.memory.recurrent->rs_size || t.ne[2] != 1 || t.ne[3] != 1)
        return fail(EINVAL, "{} is [{}, {}, {}, {}], the recurrent state has rs_size {}", where("ne"), t.ne[0], t.ne[1],
                    t.ne[2], t.ne[3], h.memory.recurrent->rs_size);
      // A row is one layer's state: its width is the layer's n_embd_r or n_embd_s (what a
      // provider engine sizes its writes by), so the two fields must agree.
      const auto& layers = h.memory.recurrent->layers;
      const auto layer =
          std::find_if(layers.begin(), layers.end(), [&](const RecurrentLayer& l) { return l.il == t.layer; });
      if (layer == layers.end())
        return fail(EINVAL, "{} is {}, not a layer of \"memory.recurrent.layers\"", where("layer"), t.layer);
      const bool is_r = t.kind == TensorKind::r;
      const uint32_t width = is_r ? layer->n_embd_r : layer->n_embd_s;
      if (t.ne[0] != width)
        return fail(EINVAL, "{} is [{}, ...], but \"memory.recurrent.layers[{}].{}\" is {}", where("ne"), t.ne[0],
                    layer - layers.begin(), is_r ? "n_embd_r" : "n_embd_s", width);
    }
    if (i > 0 && s.cache_index < h.layout.tensors[i - 1].cache_index)
      return fail(EINVAL, "{} is {} after cache object {}: tensors must be in fd order", where("cache_index"),
                  s.cache_index, h.layout.tensors[i - 1].cache_index);
  }

  // Rebuild the cache objects' tensor lists and recompute the layout the decoder would use.
  MemoryShape memory = h.memory;
  for (auto& cache : memory.kv_caches) cache.tensors.clear();
  if (memory.recurrent) memory.recurrent->tensors.clear();
  for (const SharedTensor& s : h.layout.tensors) {
    if (s.cache_index < memory.kv_caches.size())
      memory.kv_caches[s.cache_index].tensors.push_back(s.tensor);
    else
      memory.recurrent->tensors.push_back(s.tensor);
  }
  const ShareLayout expected = share_layout(memory);
  if (expected.chunks.size() != h.layout.chunks.size())
    return fail(EINVAL, "{}: field \"chunks\" has {} chunks, its tensors make {}", source, h.layout.chunks.size(),
                expected.chunks.size());
  for (size_t c = 0; c < expected.chunks.size(); ++c) {
    const ShareChunk& got = h.layout.chunks[c];
    const ShareChunk& want = expected.chunks[c];
    if (got.cache_index != want.cache_index)
      return fail(EINVAL, "{}: field \"chunks[{}].cache_index\" is {}, its tensors make {}", source, c, got.cache_index,
                  want.cache_index);
    if (got.size_bytes != want.size_bytes)
      return fail(EINVAL, "{}: field \"chunks[{}].size_bytes\" is {}, its tensors make {}", source, c, got.size_bytes,
                  want.size_bytes);
    if (got.layout_hash != want.layout_hash)
      return fail(EINVAL, "{}: field \"chunks[{}].layout_hash\" is {}, its tensors hash to {}", source, c,
                  hex64(got.layout_hash), hex64(want.layout_hash));
  }
  for (size_t i = 0; i < expected.tensors.size(); ++i) {
    const SharedTensor& got = h.layout.tensors[i];
    const SharedTensor& want = expected.tensors[i];
    if (got.chunk != want.chunk || got.offset != want.offset || got.padded_bytes != want.padded_bytes)
      return fail(EINVAL,
                  "{}: field \"tensors[{}]\" ({}) is at chunk {} offset {} ({} padded bytes), the layout puts it at "
                  "chunk {} offset {} ({} bytes)",
                  source, i, got.tensor.name, got.chunk, got.offset, got.padded_bytes, want.chunk, want.offset,
                  want.padded_bytes);
  }
  return {};
}

Result<ShareHeader> parse_document(const Json& root, std::string_view source) {
  const Field top(root, "", source);
  if (!root.is_object())
    return fail(EINVAL, "{}: the document is {}, expected a JSON object", source, root.type_name());
  ShareHeader h;
  std::string format;
  {
    auto f = top.member("format");
    if (!f) return fail(f.error());
    auto v = f->as_string();
    if (!v) return fail(v.error());
    if (*v != kFormatName)
      return f->error("is \"{}\", expected \"{}\" (is this a kvshare layout header?)", *v, kFormatName);
  }
  {
    auto f = top.member("format_version");
    if (!f) return fail(f.error());
    auto v = f->as_u32();
    if (!v) return fail(v.error());
    if (*v == 0) return f->error("is 0, versions start at 1");
    if (*v > ShareHeader::kFormatVersion)
      return f->error("is {}, newer than this reader ({}): update kvshare on this side", *v,
                      ShareHeader::kFormatVersion);
    h.format_version = *v;
  }
  auto model_field = top.member("model");
  if (!model_field) return fail(model_field.error());
  auto model = parse_model(*model_field);
  if (!model) return fail(model.error());
  h.model = std::move(*model);
  auto params_field = top.member("params");
  if (!params_field) return fail(params_field.error());
  auto params = parse_params(*params_field);
  if (!params) return fail(params.error());
  h.params = *params;
  auto memory_field = top.member("memory");
  if (!memory_field) return fail(memory_field.error());
  auto memory = parse_memory(*memory_field);
  if (!memory) return fail(memory.error());
  h.memory = std::move(*memory);
  auto chunks_field = top.member("chunks");
  if (!chunks_field) return fail(chunks_field.error());
  auto chunks = chunks_field->elements(kMaxTensors);
  if (!chunks) return fail(chunks.error());
  for (const Field& cf : *chunks) {
    auto chunk = parse_chunk(cf);
    if (!chunk) return fail(chunk.error());
    h.layout.chunks.push_back(*chunk);
  }
  auto tensors_field = top.member("tensors");
  if (!tensors_field) return fail(tensors_field.error());
  auto tensors = tensors_field->elements(kMaxTensors);
  if (!tensors) return fail(tensors.error());
  for (const Field& tf : *tensors) {
    auto tensor = parse_tensor(tf);
    if (!tensor) return fail(tensor.error());
    h.layout.tensors.push_back(std::move(*tensor));
  }
  if (auto consistent = check_consistency(h, source); !consistent) return fail(consistent.error());
  // The cache objects carry their tensors too, as derive_memory_shape made them.
  for (const SharedTensor& s : h.layout.tensors) {
    if (s.cache_index < h.memory.kv_caches.size())
      h.memory.kv_caches[s.cache_index].tensors.push_back(s.tensor);
    else
      h.memory.recurrent->tensors.push_back(s.tensor);
  }
  return h;
}

// First difference between two values, as check_compatible reports it.
struct Mismatch {
  std::string field;
  std::string theirs;
  std::string ours;
};

class Comparison {
 public:
  template <class T>
  void field(std::string name, const T& theirs, const T& ours) {
    if (mismatch_ || theirs == ours) return;
    mismatch_ = Mismatch{std::move(name), describe_value(theirs), describe_value(ours)};
  }
  void type_field(std::string name, GgmlType theirs, GgmlType ours) {
    field(std::move(name), std::string(ggml_type_name(theirs)), std::string(ggml_type_name(ours)));
  }
  void hash_field(std::string name, uint64_t theirs, uint64_t ours) {
    if (theirs != ours) field(std::move(name), hex64(theirs), hex64(ours));
  }
  const std::optional<Mismatch>& mismatch() const { return mismatch_; }

 private:
  std::optional<Mismatch> mismatch_;
};

}  // namespace

ModelFingerprint model_fingerprint(const GgufMetadata& metadata, const std::vector<GgufTensorInfo>& tensors) {
  ModelFingerprint fp;
  if (auto arch = metadata.get_string("general.architecture")) fp.arch = *arch;
  if (auto name = metadata.get_string("general.name")) fp.name = *name;
  if (!fp.arch.empty()) {
    if (auto n = metadata.get_u32(fp.arch + ".block_count")) fp.n_layer = *n;
    if (auto n = metadata.get_u32(fp.arch + ".embedding_length")) fp.n_embd = *n;
  }
  if (auto tokens = metadata.get_array("tokenizer.ggml.tokens"))
    fp.n_vocab = static_cast<uint32_t>((*tokens)->elements.size());
  uint64_t hash = kFnvBasis;
  for (const GgufTensorInfo& t : tensors) {
    hash = fnv_le(hash, t.name.size(), 8);
    hash = fnv_bytes(hash, t.name.data(), t.name.size());
    hash = fnv_le(hash, static_cast<uint32_t>(t.type), 4);
    for (int64_t extent : t.ne) hash = fnv_le(hash, static_cast<uint64_t>(extent), 8);
  }
  fp.tensors_hash = hash;
  return fp;
}

uint64_t model_fingerprint_hash(const ModelFingerprint& model) {
  uint64_t hash = kFnvBasis;
  for (const std::string* text : {&model.arch, &model.name}) {
    hash = fnv_le(hash, text->size(), 8);
    hash = fnv_bytes(hash, text->data(), text->size());
  }
  hash = fnv_le(hash, model.n_layer, 4);
  hash = fnv_le(hash, model.n_embd, 4);
  hash = fnv_le(hash, model.n_vocab, 4);
  return fnv_le(hash, model.tensors_hash, 8);
}

namespace {

// One GGUF value into the hash: its type, then its bytes (scalars little-endian, floats as
// their bit pattern, strings and arrays length-prefixed).
uint64_t fnv_gguf_value(uint64_t hash, const GgufValue& value) {
  hash = fnv_le(hash, static_cast<uint32_t>(value.type()), 4);
  return std::visit(
      [hash](const auto& v) -> uint64_t {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return fnv_bytes(fnv_le(hash, v.size(), 8), v.data(), v.size());
        } else if constexpr (std::is_same_v<T, GgufArray>) {
          uint64_t h = fnv_le(hash, static_cast<uint32_t>(v.element_type), 4);
          h = fnv_le(h, v.elements.size(), 8);
          for (const GgufValue& element : v.elements) h = fnv_gguf_value(h, element);
          return h;
        } else if constexpr (std::is_same_v<T, float>) {
          return fnv_le(hash, std::bit_cast<uint32_t>(v), 4);
        } else if constexpr (std::is_same_v<T, double>) {
          return fnv_le(hash, std::bit_cast<uint64_t>(v), 8);
        } else if constexpr (std::is_same_v<T, bool>) {
          return fnv_le(hash, v ? 1 : 0, 1);
        } else {
          return fnv_le(hash, static_cast<uint64_t>(v), sizeof(T));
        }
      },
      value.value);
}

}  // namespace

uint64_t tokenizer_fingerprint(const GgufMetadata& metadata) {
  constexpr std::string_view kPrefix = "tokenizer.ggml.";
  std::vector<const std::pair<std::string, GgufValue>*> keys;
  for (const auto& entry : metadata.entries())
    if (entry.first.starts_with(kPrefix)) keys.push_back(&entry);
  std::sort(keys.begin(), keys.end(), [](const auto* a, const auto* b) { return a->first < b->first; });
  uint64_t hash = kFnvBasis;
  for (const auto* entry : keys) {
    hash = fnv_le(hash, entry->first.size(), 8);
    hash = fnv_bytes(hash, entry->first.data(), entry->first.size());
    hash = fnv_gguf_value(hash, entry->second);
  }
  return hash;
}

Result<ShareHeader> make_share_header(const ModelFingerprint& model, const ModelShape& shape, const KvParams& params) {
  auto memory = derive_memory_shape(shape, params);
  if (!memory) return fail(memory.error());
  ShareHeader header;
  header.model = model;
  header.params = params;
  header.layout = share_layout(*memory);
  header.memory = std::move(*memory);
  return header;
}

std::string to_json(const ShareHeader& header, bool pretty) {
  Json j;
  j["format"] = kFormatName;
  j["format_version"] = header.format_version;
  j["model"] = Json{{"arch", header.model.arch},       {"name", header.model.name},
                    {"n_layer", header.model.n_layer}, {"n_embd", header.model.n_embd},
                    {"n_vocab", header.model.n_vocab}, {"tensors_hash", hex64(header.model.tensors_hash)}};
  j["params"] = params_json(header.params);
  j["memory"] = memory_json(header.memory);
  Json chunks = Json::array();
  for (const auto& c : header.layout.chunks)
    chunks.push_back(
        Json{{"cache_index", c.cache_index}, {"size_bytes", c.size_bytes}, {"layout_hash", hex64(c.layout_hash)}});
  j["chunks"] = std::move(chunks);
  Json tensors = Json::array();
  for (const auto& s : header.layout.tensors) {
    const CacheTensor& t = s.tensor;
    tensors.push_back(Json{{"name", t.name},
                           {"cache_index", s.cache_index},
                           {"layer", t.layer},
                           {"kind", tensor_kind_name(t.kind)},
                           {"type", ggml_type_name(t.type)},
                           {"ne", Json::array({t.ne[0], t.ne[1], t.ne[2], t.ne[3]})},
                           {"row_bytes", t.row_bytes},
                           {"nbytes", t.nbytes},
                           {"chunk", s.chunk},
                           {"offset", s.offset},
                           {"padded_bytes", s.padded_bytes}});
  }
  j["tensors"] = std::move(tensors);
  return pretty ? j.dump(2) + "\n" : j.dump();
}

Result<ShareHeader> parse_share_header(std::string_view json, std::string_view source) {
  if (json.size() > kMaxHeaderBytes)
    return fail(EMSGSIZE, "{}: layout header is {} bytes, more than the {} a header may have", source, json.size(),
                kMaxHeaderBytes);
  if (const int depth = json_nesting_depth(json); depth > kMaxDepth)
    return fail(EINVAL, "{}: layout header nests {} levels deep, at most {} are allowed", source, depth, kMaxDepth);
  Json root;
  try {
    root = Json::parse(json.begin(), json.end());
  } catch (const nlohmann::json::exception& e) {
    return fail(EINVAL, "{}: layout header is not valid JSON: {}", source, e.what());
  }
  return parse_document(root, source);
}

Result<ShareHeader> parse_share_header_document(const Json& document, std::string_view source) {
  return parse_document(document, source);
}

Result<void> check_compatible(const ShareHeader& ours, const ShareHeader& theirs, std::string_view peer,
                              std::string_view self) {
  Comparison cmp;
  cmp.field("format_version", theirs.format_version, ours.format_version);
  cmp.field("model.arch", theirs.model.arch, ours.model.arch);
  cmp.field("model.n_layer", theirs.model.n_layer, ours.model.n_layer);
  cmp.field("model.n_embd", theirs.model.n_embd, ours.model.n_embd);
  cmp.field("model.n_vocab", theirs.model.n_vocab, ours.model.n_vocab);
  cmp.hash_field("model.tensors_hash", theirs.model.tensors_hash, ours.model.tensors_hash);
  cmp.type_field("params.type_k", theirs.params.type_k, ours.params.type_k);
  cmp.type_field("params.type_v", theirs.params.type_v, ours.params.type_v);
  // The hash cannot see flash attention when every V has the same width; compare it here.
  cmp.field("params.flash_attn", theirs.params.flash_attn, ours.params.flash_attn);
  cmp.field("params.n_seq_max", theirs.params.n_seq_max, ours.params.n_seq_max);
  // One sequence is one stream either way: -kvu only matters with several.
  if (theirs.params.n_seq_max > 1 || ours.params.n_seq_max > 1)
    cmp.field("params.kv_unified", theirs.params.kv_unified, ours.params.kv_unified);
  cmp.field("params.swa_full", theirs.params.swa_full, ours.params.swa_full);
  cmp.field("memory.kind", std::string(memory_kind_name(theirs.memory.kind)),
            std::string(memory_kind_name(ours.memory.kind)));
  cmp.field("memory.n_ctx", theirs.memory.n_ctx, ours.memory.n_ctx);
  cmp.field("memory.n_ctx_seq", theirs.memory.n_ctx_seq, ours.memory.n_ctx_seq);
  cmp.field("memory.n_pos_per_embd", theirs.memory.n_pos_per_embd, ours.memory.n_pos_per_embd);
  cmp.field("memory.kv_caches.size", theirs.memory.kv_caches.size(), ours.memory.kv_caches.size());
  for (size_t i = 0; i < std::min(theirs.memory.kv_caches.size(), ours.memory.kv_caches.size()); ++i) {
    const KvCacheShape& a = theirs.memory.kv_caches[i];
    const KvCacheShape& b = ours.memory.kv_caches[i];
    const std::string p = fmt::format("memory.kv_caches[{}].", i);
    cmp.field(p + "role", a.role, b.role);
    cmp.field(p + "kv_size", a.kv_size, b.kv_size);
    cmp.field(p + "n_stream", a.n_stream, b.n_stream);
    cmp.field(p + "v_trans", a.v_trans, b.v_trans);
    cmp.field(p + "v_width", a.v_width, b.v_width);
    cmp.field(p + "n_swa", a.n_swa, b.n_swa);
    cmp.field(p + "layers.size", a.layers.size(), b.layers.size());
  }
  cmp.field("memory.recurrent", theirs.memory.recurrent.has_value(), ours.memory.recurrent.has_value());
  if (theirs.memory.recurrent && ours.memory.recurrent) {
    cmp.field("memory.recurrent.rs_size", theirs.memory.recurrent->rs_size, ours.memory.recurrent->rs_size);
    cmp.field("memory.recurrent.layers.size", theirs.memory.recurrent->layers.size(),
              ours.memory.recurrent->layers.size());
  }
  cmp.field("chunks.size", theirs.layout.chunks.size(), ours.layout.chunks.size());
  for (size_t c = 0; c < std::min(theirs.layout.chunks.size(), ours.layout.chunks.size()); ++c) {
    cmp.field(fmt::format("chunks[{}].size_bytes", c), theirs.layout.chunks[c].size_bytes,
              ours.layout.chunks[c].size_bytes);
    cmp.hash_field(fmt::format("chunks[{}].layout_hash", c), theirs.layout.chunks[c].layout_hash,
                   ours.layout.chunks[c].layout_hash);
  }
  cmp.field("tensors.size", theirs.layout.tensors.size(), ours.layout.tensors.size());
  for (size_t i = 0; i < std::min(theirs.layout.tensors.size(), ours.layout.tensors.size()); ++i) {
    const SharedTensor& a = theirs.layout.tensors[i];
    const SharedTensor& b = ours.layout.tensors[i];
    cmp.field(fmt::format("tensors[{}].name", i), a.tensor.name, b.tensor.name);
    cmp.field(fmt::format("tensors[{}].chunk", i), a.chunk, b.chunk);
    cmp.field(fmt::format("tensors[{}].offset", i), a.offset, b.offset);
  }
  if (const auto& m = cmp.mismatch())
    return fail(EINVAL, "{}: field \"{}\" is {}, this {} uses {}", peer, m->field, m->theirs, self, m->ours);
  return {};
}

}  // namespace kvshare::layout
