#include "refmodel/provider/prefill_provider.h"

#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kvshare/fd.h"
#include "kvshare/mapping.h"
#include "kvshare/region/dmabuf_sync.h"
#include "kvshare/region/importer.h"
#include "kvshare/share/provider_share.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/memory_shape.h"
#include "layout/share_header.h"
#include "layout/share_layout.h"
#include "refmodel/engine.h"
#include "refmodel/model_impl.h"
#include "refmodel/provider/private_kv.h"
#include "xdna/scatter.h"

namespace kvshare::refmodel {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

Result<std::string> read_text_file(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(errno, "{} {}: cannot open", what, path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return fail(EIO, "{} {}: read failed", what, path);
  return ss.str();
}

struct Loaded {
  std::shared_ptr<const Model> model;
  std::vector<int32_t> tokens;
};

Result<Loaded> load_inputs(const PrefillRequest& r) {
  auto ids_text = read_text_file(r.tokens_path, "ids file");
  if (!ids_text) return fail(ids_text.error());
  auto tokens = parse_token_ids(*ids_text, r.tokens_path);
  if (!tokens) return fail(tokens.error());
  auto mapping = Mapping::map_file_readonly(r.model_path);
  if (!mapping) return fail(mapping.error().with_context(fmt::format("model {}", r.model_path)));
  auto keep = std::make_shared<Mapping>(std::move(*mapping));
  auto model = Model::from_gguf(keep->bytes(), keep, r.model_path);
  if (!model) return fail(model.error());
  const int32_t n_vocab = (*model)->tokenizer().n_vocab();
  for (size_t i = 0; i < tokens->size(); ++i)
    if ((*tokens)[i] >= n_vocab)
      return fail(EINVAL, "ids file {}: id {} (entry {}) is outside the vocabulary of model {} ({} tokens)",
                  r.tokens_path, (*tokens)[i], i + 1, r.model_path, n_vocab);
  return Loaded{std::move(*model), std::move(*tokens)};
}


// --cached P leaves at least the last id to compute: its K/V (and the decoder's first
// logits, one token later) come from this prefill, never from a cell it did not write.
Error cached_bound_error(uint32_t n_cached, size_t n_ids, const std::string& tokens_path) {
  return Error(EINVAL, fmt::format("--cached {}: the ids file {} holds {} ids; --cached must be below that (0 <= P < {}): "
                                   "when the region holds every id there is nothing to prefill",
                                   n_cached, tokens_path, n_ids, n_ids));
}

Error cached_on_file_route_error() {
  return Error(EINVAL, "--cached is for the shared route (--layout/--fds), where the region already holds the cached "
                       "cells; the file route (--out) writes a state file of every id from position 0");
}

// The incremental shared route: a Context over the region itself, exactly as the decoder
// runs on it (kvshare-decoder's eval is the same Context::decode), so the cached cells
// are read in the decoder's cache types and rotation and the new ones stored the same
// way. Creating the Context only checks the layout; decode writes cells n_cached.. only.
Result<PrefillReport> extend_region(const Loaded& in, const layout::ShareHeader& header,
                                    std::span<const std::span<std::byte>> chunks, uint32_t n_cached, int n_threads) {
  KvMemory kv{header.memory, header.layout, std::vector<std::span<std::byte>>(chunks.begin(), chunks.end())};
  auto ctx = Context::create(in.model, std::move(kv), n_threads);
  if (!ctx) return fail(ctx.error().with_context("shared route, the decoder's region"));
  const auto t0 = Clock::now();
  const std::span<const int32_t> rest = std::span<const int32_t>(in.tokens).subspan(n_cached);
  auto logits = (*ctx)->decode(rest, static_cast<int32_t>(n_cached));
  if (!logits)
    return fail(logits.error().with_context(fmt::format("shared route, --cached {}: positions {}..{}", n_cached, n_cached,
                                                        in.tokens.size() - 1)));
  PrefillReport report;
  report.route = "shared";
  report.n_tokens = static_cast<uint32_t>(in.tokens.size());
  report.n_prefilled = static_cast<uint32_t>(rest.size());
  report.prefill_ms = ms_since(t0);
  report.forward_ms = report.prefill_ms;  // the stores into the region are part of the forward pass
  report.write_ms = 0;
  return report;
}

Result<PrefillReport> run_file_route(const PrefillRequest& r) {
  auto in = load_inputs(r);
  if (!in) return fail(in.error());
  if (auto ok = layout::validate(r.params); !ok) return fail(ok.error());
  auto memory = layout::derive_memory_shape(in->model->shape(), r.params);
  if (!memory) return fail(memory.error().with_context(fmt::format("model {} with {}", r.model_path, layout::describe(r.params))));
  const uint32_t kv_size = memory->kv_caches.empty() ? 0 : memory->kv_caches[0].kv_size;
  if (in->tokens.size() > kv_size)
    return fail(ERANGE, "ids file {}: {} tokens do not fit the context of {} cells (-c {})", r.tokens_path,
                in->tokens.size(), kv_size, r.params.n_ctx);
  const auto n = static_cast<uint32_t>(in->tokens.size());
  auto own = make_private_kv(*in->model, r.params, n);
  if (!own) return fail(own.error());
  auto ctx = Context::create(in->model, (*own)->kv, r.n_threads);
  if (!ctx) return fail(ctx.error());

  statefile::StateFileWriterOptions options;
  options.n_embd_head_k = head_k(*in->model);
  options.n_embd_head_v = head_v(*in->model);
  options.rotation_disabled = statefile::attn_rotation_disabled_by_env();
  options.state_version = r.state_version;
  const auto t0 = Clock::now();
  auto writer = statefile::StateFileWriter::create(r.out_path, *memory, in->tokens, static_cast<int32_t>(n), options);
  if (!writer) return fail(writer.error().with_context(fmt::format("state file {}", r.out_path)));
  double write_ms = 0;
  auto ok = (*ctx)->prefill(in->tokens, [&](const LayerRows& rows) -> Result<void> {
    const auto w0 = Clock::now();
    const uint64_t stride = (rows.n_embd_k_gqa + rows.n_embd_v_gqa) * sizeof(float);
    const statefile::RowsView k{layout::GgmlType::F32, rows.rows.data(), rows.n_tokens, stride};
    const statefile::RowsView v{layout::GgmlType::F32, rows.rows.data() + rows.n_embd_k_gqa, rows.n_tokens, stride};
    auto written = writer->write_layer(rows.il, k, v);
    write_ms += ms_since(w0);
    return written;
  });
  if (!ok) return fail(ok.error().with_context(fmt::format("state file {}", r.out_path)));
  const auto c0 = Clock::now();
  auto committed = writer->commit();
  if (!committed) return fail(committed.error().with_context(fmt::format("state file {}", r.out_path)));
  write_ms += ms_since(c0);
  PrefillReport report;
  report.route = "file";
  report.n_tokens = n;
  report.n_prefilled = n;
  report.prefill_ms = ms_since(t0);
  report.write_ms = write_ms;
  report.forward_ms = report.prefill_ms - write_ms;
  return report;
}

Result<PrefillReport> run_shared_route(const PrefillRequest& r, std::vector<Fd> fds) {
  // The broker's header gives the KV params to build our own header from; ProviderShare
  // then checks the two against each other and imports the fds.
  auto theirs = read_header_file(r.layout_path);
  if (!theirs) return fail(theirs.error());
  auto in = load_inputs(r);
  if (!in) return fail(in.error());
  const Model& model = *in->model;
  auto ours = layout::make_share_header(layout::model_fingerprint(model.metadata(), model.tensor_infos()), model.shape(),
                                        theirs->params);
  if (!ours) return fail(ours.error().with_context(fmt::format("model {}", r.model_path)));
  const uint32_t kv_size = theirs->memory.kv_caches.empty() ? 0 : theirs->memory.kv_caches[0].kv_size;
  if (in->tokens.size() > kv_size)
    return fail(ERANGE, "ids file {}: {} tokens do not fit the shared cache of {} cells", r.tokens_path,
                in->tokens.size(), kv_size);
  const uint32_t n_cached = r.n_cached.value_or(0);
  if (n_cached >= in->tokens.size()) return fail(cached_bound_error(n_cached, in->tokens.size(), r.tokens_path));
  if (fds.size() != theirs->layout.chunks.size())
    return fail(EINVAL, "--fds gives {} descriptors, layout header {} has {} chunks", fds.size(), r.layout_path,
                theirs->layout.chunks.size());
  std::vector<int> fd_numbers;
  for (Fd& fd : fds) fd_numbers.push_back(fd.release());  // ProviderShare::open owns them from here
  auto share = ProviderShare::open(r.layout_path, fd_numbers, *ours);
  if (!share) return fail(share.error().with_context(fmt::format("model {}", r.model_path)));
  theirs = share->header();
  // With cached cells the provider reads the region as well as writing it.
  auto access = n_cached > 0 ? share->imported().begin_cpu_access(DmaBufCpuAccess::Mode::read_write)
                             : share->begin_write();
  if (!access) return fail(access.error());
  if (n_cached > 0) return extend_region(*in, *theirs, share->imported().chunk_bytes(), n_cached, r.n_threads);

  const auto n = static_cast<uint32_t>(in->tokens.size());
  auto own = make_private_kv(model, theirs->params, n);
  if (!own) return fail(own.error());
  auto ctx = Context::create(in->model, (*own)->kv, r.n_threads);
  if (!ctx) return fail(ctx.error());

  const auto& chunks = share->imported().chunk_bytes();
  xdna::ScatterTarget target{theirs->layout, theirs->memory,
                             std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()),
                             0, head_k(model), head_v(model), share->imported().chunk_files()};
  const bool rotation_disabled = statefile::attn_rotation_disabled_by_env();
  double write_ms = 0;
  const auto t0 = Clock::now();
  auto ok = (*ctx)->prefill(in->tokens, [&](const LayerRows& rows) -> Result<void> {
    const auto w0 = Clock::now();
    const xdna::ScatterBatch batch = scatter_batch_of(rows, rotation_disabled, r.n_threads);
    auto scattered = xdna::scatter(target, batch);
    write_ms += ms_since(w0);
    return scattered;
  });
  if (!ok) return fail(ok.error().with_context("shared route"));
  PrefillReport report;
  report.route = "shared";
  report.n_tokens = n;
  report.n_prefilled = n;
  report.prefill_ms = ms_since(t0);
  report.write_ms = write_ms;
  report.forward_ms = report.prefill_ms - write_ms;
  return report;
}

}  // namespace

Result<std::vector<int32_t>> parse_token_ids(std::string_view text, std::string_view source) {
  std::vector<int32_t> ids;
  size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && text[first] == '[') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      return fail(EINVAL, "ids file {}: not a JSON array of ids: {}", source, e.what());
    }
    if (!j.is_array()) return fail(EINVAL, "ids file {}: not a JSON array of ids", source);
    for (size_t i = 0; i < j.size(); ++i) {
      const auto& v = j[i];
      if (!v.is_number_integer())
        return fail(EINVAL, "ids file {}: element {} is {}, not an integer id", source, i, v.dump());
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id > INT32_MAX) return fail(EINVAL, "ids file {}: element {} is {}, not a valid id", source, i, id);
      ids.push_back(static_cast<int32_t>(id));
    }
  } else {
    size_t line_no = 0;
    size_t at = 0;
    while (at <= text.size()) {
      size_t end = text.find('\n', at);
      if (end == std::string_view::npos) end = text.size();
      std::string_view line = text.substr(at, end - at);
      ++line_no;
      at = end + 1;
      const size_t b = line.find_first_not_of(" \t\r");
      if (b == std::string_view::npos) continue;
      const size_t e = line.find_last_not_of(" \t\r");
      line = line.substr(b, e - b + 1);
      int64_t id = 0;
      auto [ptr, ec] = std::from_chars(line.data(), line.data() + line.size(), id);
      if (ec != std::errc() || ptr != line.data() + line.size() || line[0] == '+')
        return fail(EINVAL, "ids file {}: line {} is \"{}\", not a decimal token id", source, line_no,
                    line.substr(0, 40));
      if (id < 0 || id > INT32_MAX) return fail(EINVAL, "ids file {}: line {} id {} is not a valid id", source, line_no, id);
      ids.push_back(static_cast<int32_t>(id));
    }
  }
  if (ids.empty()) return fail(EINVAL, "ids file {}: holds no token ids", source);
  return ids;
}

Result<void> check_prefill_usage(const PrefillRequest& request) {
  if (!request.n_cached) return {};
  if (request.layout_path.empty()) return fail(cached_on_file_route_error());
  if (*request.n_cached == 0) return {};
  // An unreadable or malformed ids file is a failed prefill (exit 1), reported by
  // run_prefill with the line at fault; only the bound is usage.
  auto text = read_text_file(request.tokens_path, "ids file");
  if (!text) return {};
  auto ids = parse_token_ids(*text, request.tokens_path);
  if (!ids) return {};
  if (*request.n_cached >= ids->size()) return fail(cached_bound_error(*request.n_cached, ids->size(), request.tokens_path));
  return {};
}

Result<PrefillReport> run_prefill(const PrefillRequest& request) {
  // Own the inherited descriptors before anything can fail: an early return closes them.
  std::vector<Fd> fds;
  for (int fd : request.fds) fds.emplace_back(fd);
  if (request.n_cached && request.layout_path.empty()) return fail(cached_on_file_route_error());
  if (!request.layout_path.empty()) {
    if (!request.out_path.empty()) return fail(EINVAL, "--out and --layout exclude each other: pick the file or the shared route");
    return run_shared_route(request, std::move(fds));
  }
  if (!fds.empty()) return fail(EINVAL, "--fds needs --layout (the shared route)");
  if (request.out_path.empty()) return fail(EINVAL, "neither --out (file route) nor --layout (shared route) given");
  return run_file_route(request);
}

}  // namespace kvshare::refmodel
