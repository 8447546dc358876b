// The C API (kvshare.h): a thin wrapper. Each entry point converts its arguments, calls
// the C++ class that owns the mechanism (DecoderShare, ProviderShare, kvshare::scatter,
// ProviderChannel) and
// turns a Result into a negative errno plus the handle's message. Nothing here decides
// protocol: checks added to those classes apply to C callers unchanged.
#include "kvshare.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "kvshare/env.h"
#include "kvshare/mapping.h"
#include "kvshare/scatter/scatter.h"
#include "kvshare/share/decoder_share.h"
#include "kvshare/share/provider_channel.h"
#include "kvshare/share/provider_share.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/gguf_reader.h"
#include "layout/model_shape.h"
#include "layout/share_header.h"
#include "layout/tensor_type.h"
#include "xdna/npu_share.h"

// capi/CMakeLists.txt's VERSION names the library file; kvshare.h's macros are what a caller
// compiles against and what kvshare_version_*() report. One version, or no build.
static_assert(KVSHARE_C_LIBRARY_VERSION_MAJOR == KVSHARE_C_API_VERSION_MAJOR &&
                  KVSHARE_C_LIBRARY_VERSION_MINOR == KVSHARE_C_API_VERSION_MINOR &&
                  KVSHARE_C_LIBRARY_VERSION_PATCH == KVSHARE_C_API_VERSION_PATCH,
              "capi/CMakeLists.txt's kvshare_c_version differs from kvshare.h's KVSHARE_C_API_VERSION_*: "
              "bump both");

namespace {

using kvshare::Error;
using kvshare::Result;
namespace layout = kvshare::layout;

// An errno for an Error that carries none (a parse or shape refusal): EINVAL, so a C
// caller always sees a negative value on failure, and serve a reply's errno 1..4095.
int errno_of(const Error &error) {
    return error.errno_value() != 0 ? error.errno_value() : EINVAL;
}
int negative_errno(const Error &error) {
    return -errno_of(error);
}

// Keeps `error`'s message as the handle's (or the thread's) last error; the negative errno.
int fail_with(const Error &error, std::string &last_error) {
    last_error = error.what();
    return negative_errno(error);
}

// The struct_size rule of every versioned struct (kvshare.h, "Versioned structs"): the
// kernel's copy_struct_from_user (include/linux/uaccess.h), so a struct can grow at its end
// without breaking a caller built against either an older or a newer header. Each struct
// names itself and its first version's size here; struct_bytes decides for all of them.
template <class T>
struct VersionedStruct;
template <>
struct VersionedStruct<kvshare_kv_params> {
    static constexpr const char *name = "kvshare_kv_params";
    static constexpr const char *ver0 = "KVSHARE_KV_PARAMS_SIZE_VER0";
    static constexpr size_t size_ver0 = KVSHARE_KV_PARAMS_SIZE_VER0;
};
template <>
struct VersionedStruct<kvshare_tensor_info> {
    static constexpr const char *name = "kvshare_tensor_info";
    static constexpr const char *ver0 = "KVSHARE_TENSOR_INFO_SIZE_VER0";
    static constexpr size_t size_ver0 = KVSHARE_TENSOR_INFO_SIZE_VER0;
};
template <>
struct VersionedStruct<kvshare_resident_request> {
    static constexpr const char *name = "kvshare_resident_request";
    static constexpr const char *ver0 = "KVSHARE_RESIDENT_REQUEST_SIZE_VER0";
    static constexpr size_t size_ver0 = KVSHARE_RESIDENT_REQUEST_SIZE_VER0;
};

// How many bytes of the caller's struct (its struct_size) this library reads or fills:
// min(struct_size, sizeof(T)). EINVAL below the first version (no header ever declared such
// a struct); E2BIG when a byte past sizeof(T) is not zero: the caller, built against a newer
// header, set a field this library does not know, and ignoring it would do something else
// than was asked. Nothing of the caller's is written.
template <class T>
Result<size_t> struct_bytes(const T *caller) {
    using Versioned = VersionedStruct<T>;
    if (caller == nullptr) return kvshare::fail(EINVAL, "struct {}: NULL", Versioned::name);
    // Through bytes: a caller's struct may be shorter than T, so no member of T is read.
    const auto *bytes = reinterpret_cast<const unsigned char *>(caller);
    uint32_t struct_size = 0;
    std::memcpy(&struct_size, bytes, sizeof struct_size);
    if (struct_size < Versioned::size_ver0)
        return kvshare::fail(EINVAL,
                             "struct {}: struct_size {} is smaller than its first version ({} bytes, {}): set "
                             "it to sizeof(struct {})",
                             Versioned::name, struct_size, Versioned::size_ver0, Versioned::ver0, Versioned::name);
    for (size_t offset = sizeof(T); offset < struct_size; ++offset) {
        if (bytes[offset] != 0)
            return kvshare::fail(
                E2BIG,
                "struct {}: struct_size {} is larger than this library's {} bytes (libkvshare_c "
                "{}.{}.{}) and byte {} is not zero: a field this library does not know is set; zero it, "
                "or run with the libkvshare_c whose header the caller was built with "
                "(kvshare_check_version)",
                Versioned::name, struct_size, sizeof(T), KVSHARE_C_API_VERSION_MAJOR, KVSHARE_C_API_VERSION_MINOR,
                KVSHARE_C_API_VERSION_PATCH, offset);
    }
    return std::min<size_t>(struct_size, sizeof(T));
}

// The caller's struct as this library's: its first n_bytes (struct_bytes), and every field
// past them, which the caller's header did not have, zero.
template <class T>
T read_struct(const T *caller, size_t n_bytes) {
    T value{};
    std::memcpy(&value, caller, n_bytes);
    return value;
}

// Fills the caller's struct with `value`: its first n_bytes only (struct_bytes), struct_size
// set to n_bytes, so a caller built against a newer header sees how much this library filled.
template <class T>
void fill_struct(T *caller, T value, size_t n_bytes) {
    value.struct_size = static_cast<uint32_t>(n_bytes);
    std::memcpy(caller, &value, n_bytes);
}

Result<layout::KvParams> to_kv_params(const kvshare_kv_params *caller) {
    auto n_bytes = struct_bytes(caller);
    if (!n_bytes) return kvshare::fail(n_bytes.error());
    const kvshare_kv_params in = read_struct(caller, *n_bytes);
    layout::KvParams params;
    params.n_ctx = in.n_ctx;
    params.n_seq_max = in.n_seq_max;
    params.n_ubatch = in.n_ubatch;
    params.kv_unified = in.kv_unified != 0;
    params.flash_attn = in.flash_attn != 0;
    params.swa_full = in.swa_full != 0;
    for (auto [id, field, out] :
         {std::tuple{in.type_k, "type_k", &params.type_k}, std::tuple{in.type_v, "type_v", &params.type_v}}) {
        if (!layout::ggml_type_traits(id))
            return kvshare::fail(EINVAL, "KV params: {} {} is not a ggml type id", field, id);
        *out = static_cast<layout::GgmlType>(id);
    }
    if (auto valid = layout::validate(params); !valid) return kvshare::fail(valid.error());
    return params;
}

// The one place a KvParams becomes the C struct (kvshare_kv_params_init is it for the defaults).
kvshare_kv_params c_kv_params(const layout::KvParams &in) {
    kvshare_kv_params out{};
    out.struct_size = sizeof out;
    out.n_ctx = in.n_ctx;
    out.n_seq_max = in.n_seq_max;
    out.n_ubatch = in.n_ubatch;
    out.type_k = static_cast<int32_t>(in.type_k);
    out.type_v = static_cast<int32_t>(in.type_v);
    out.kv_unified = in.kv_unified;
    out.flash_attn = in.flash_attn;
    out.swa_full = in.swa_full;
    return out;
}

// kvshare_kv_params_init and kvshare_provider_kv_params fill a struct whose struct_size the
// caller never set (KVSHARE_1.0 asked for none), so they cannot know its size: they fill the
// first version, which every caller's struct has, and say so in struct_size.
void fill_first_version(kvshare_kv_params *caller, const layout::KvParams &params) {
    fill_struct(caller, c_kv_params(params), KVSHARE_KV_PARAMS_SIZE_VER0);
}

// What a GGUF says about itself: the fingerprint a header carries and the shape the
// memory is derived from. The mapping is dropped before returning.
struct ModelFacts {
    layout::ModelFingerprint fingerprint;
    layout::ModelShape shape;
};

Result<ModelFacts> read_model(const char *model_path) {
    if (model_path == nullptr) return kvshare::fail(EINVAL, "model path: NULL");
    auto mapping = kvshare::Mapping::map_file_readonly(model_path);
    if (!mapping) return kvshare::fail(mapping.error().with_context(fmt::format("model {}", model_path)));
    auto gguf = layout::parse_gguf(mapping->bytes(), model_path);
    if (!gguf) return kvshare::fail(gguf.error());
    auto shape = layout::derive_model_shape(gguf->metadata);
    if (!shape) return kvshare::fail(shape.error().with_context(fmt::format("model {}", model_path)));
    return ModelFacts{layout::model_fingerprint(gguf->metadata, gguf->tensors), std::move(*shape)};
}

int fill_tensor_info(const Result<kvshare::TensorView> &view, kvshare_tensor_info *out, std::string &last_error) {
    if (!view) return fail_with(view.error(), last_error);
    auto n_bytes = struct_bytes(out);
    if (!n_bytes) return fail_with(n_bytes.error().with_context(fmt::format("tensor {}", view->name())), last_error);
    const layout::SharedTensor &placement = *view->placement;
    kvshare_tensor_info info{};
    info.chunk = placement.chunk;
    info.offset = placement.offset;
    info.nbytes = placement.tensor.nbytes;
    info.row_bytes = placement.tensor.row_bytes;
    for (size_t i = 0; i < 4; ++i) info.ne[i] = placement.tensor.ne[i];
    info.type = static_cast<int32_t>(placement.tensor.type);
    info.layer = placement.tensor.layer;
    info.data = view->base;
    fill_struct(out, info, *n_bytes);
    return 0;
}

int fill_chunk(std::span<const std::span<std::byte>> chunks, uint32_t index, void **base, uint64_t *size_bytes,
               std::string &last_error) {
    if (index >= chunks.size()) {
        last_error = fmt::format("chunk {}: the region has {} chunk(s)", index, chunks.size());
        return -ERANGE;
    }
    if (base != nullptr) *base = chunks[index].data();
    if (size_bytes != nullptr) *size_bytes = chunks[index].size();
    return 0;
}

// Runs `body`, turning any exception into -EIO and a message: none may cross into C.
template <class Body>
int guarded(std::string &last_error, const char *what, Body &&body) noexcept {
    try {
        return body();
    } catch (const std::bad_alloc &) {
        last_error = fmt::format("{}: out of memory", what);
        return -ENOMEM;
    } catch (const std::exception &e) {
        last_error = fmt::format("{}: {}", what, e.what());
        return -EIO;
    }
}

}  // namespace

struct kvshare_decoder {
    std::optional<kvshare::DecoderShare> share;  // empty after decline or when open failed before start
    std::string open_failure;                    // why the decoder cannot share ("" when it can)
    // The texts a call hands back (kvshare_decoder_refusal, *_last_error): what the handle
    // reports about its last call, not the decoder's state, so a getter on a const handle
    // still formats and keeps them.
    mutable std::string refusal;
    mutable std::string last_error;
    bool can_share() const {
        return share.has_value() && share->can_share();
    }
};

// Made only by a successful open (kvshare_provider_open, a resident provider's REGION), so
// every handle a caller holds is open.
struct kvshare_provider {
    explicit kvshare_provider(kvshare::ProviderShare opened) : share(std::move(opened)) {
    }
    kvshare::ProviderShare share;
    std::vector<kvshare::DmaBufCpuAccess> write_access;
    bool in_write = false;                       // between begin_write and end_write (write_access is empty for memfd)
    std::optional<kvshare::xdna::NpuShare> npu;  // after kvshare_provider_import_npu
    uint32_t n_embd_head_k = 0;                  // every layer's head size when all agree, for scatter's rotation
    uint32_t n_embd_head_v = 0;
    uint32_t stream = 0;      // the KV stream scatter writes (< n_stream, kvshare_provider_set_cells)
    uint32_t first_cell = 0;  // where scatter's position 0 goes (kvshare_provider_set_cells)
    uint32_t n_cells = 0;     // positions scatter may write, 0 with first_cell 0: no range (kv_size)
    // A report about the last call, not the provider's state: a failing getter on a const
    // handle (kvshare_provider_tensor of an unknown name) still leaves its message here.
    mutable std::string last_error;
};

namespace {

// Why the calling thread's latest failed open (kvshare_provider_open, kvshare_resident_from_fd,
// kvshare_resident_listen; kvshare_decoder_open without memory for its handle) failed. A
// failed open hands back no handle to hold its message, so every *_last_error(NULL) answers
// with this one; thread-local, so an open failing on another thread cannot replace it.
thread_local std::string t_open_failure;

// An open given no place for its handle.
int refuse_null_out(const char *what) {
    t_open_failure = fmt::format("{}: out is NULL: pass the address of the handle pointer to fill", what);
    return -EINVAL;
}

// Where scatter and write_state write: the header's layout, this handle's mappings and,
// for memfd chunks, its descriptors.
kvshare::ScatterTarget provider_target(const kvshare_provider &p) {
    const auto &header = p.share.header();
    const auto chunks = p.share.imported().chunk_bytes();
    const bool heads_agree = p.n_embd_head_k != UINT32_MAX && p.n_embd_head_v != UINT32_MAX;
    return kvshare::ScatterTarget{header.layout,
                                  header.memory,
                                  std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()),
                                  0,
                                  heads_agree ? p.n_embd_head_k : 0,
                                  heads_agree ? p.n_embd_head_v : 0,
                                  p.share.imported().chunk_files()};
}

// A kvshare_state_kind as the tensor kind it names.
Result<layout::TensorKind> to_state_kind(int kind, uint32_t il) {
    if (kind == KVSHARE_STATE_R) return layout::TensorKind::r;
    if (kind == KVSHARE_STATE_S) return layout::TensorKind::s;
    return kvshare::fail(EINVAL, "layer {}: state kind {} is not KVSHARE_STATE_R ({}) or KVSHARE_STATE_S ({})", il,
                         kind, static_cast<int>(KVSHARE_STATE_R), static_cast<int>(KVSHARE_STATE_S));
}

// kvshare_provider_open's check and import, whichever way the share arrived (a header
// file and inherited fds, or a resident provider's region request): `import` gets our
// header, this model under the decoder's params `theirs` (so the comparison sees every
// difference of model or shape, as kvshare-prefill does), or nullptr without a model,
// and returns the imported ProviderShare. The handle is made only once that succeeded.
template <class Import>
Result<std::unique_ptr<kvshare_provider>> open_checked(const ModelFacts *model, const char *model_path,
                                                       const layout::KvParams &theirs, Import &&import) {
    std::optional<layout::ShareHeader> ours;
    if (model != nullptr) {
        auto header = layout::make_share_header(model->fingerprint, model->shape, theirs);
        if (!header) return kvshare::fail(header.error().with_context(fmt::format("model {}", model_path)));
        ours = std::move(*header);
    }
    auto share = import(ours ? &*ours : nullptr);
    if (!share)
        return kvshare::fail(model != nullptr ? share.error().with_context(fmt::format("model {}", model_path))
                                              : share.error());
    auto p = std::make_unique<kvshare_provider>(std::move(*share));
    if (model == nullptr) return p;
    // llama.cpp rotates quantized caches by the head size all layers share (0: none).
    auto shared_head = [](uint32_t so_far, uint32_t head) { return so_far == 0 || so_far == head ? head : UINT32_MAX; };
    for (const auto &layer : model->shape.layers) {
        if (!layer.has_kv) continue;
        p->n_embd_head_k = shared_head(p->n_embd_head_k, layer.n_embd_head_k);
        p->n_embd_head_v = shared_head(p->n_embd_head_v, layer.n_embd_head_v);
    }
    return p;
}

}  // namespace

extern "C" {

void kvshare_kv_params_init(kvshare_kv_params *params) {
    if (params == nullptr) return;
    fill_first_version(params, layout::KvParams{});
}

int kvshare_share_requested(void) {
    return kvshare::kv_share_enabled() ? 1 : 0;
}

int kvshare_version_major(void) {
    return KVSHARE_C_API_VERSION_MAJOR;
}
int kvshare_version_minor(void) {
    return KVSHARE_C_API_VERSION_MINOR;
}
int kvshare_version_patch(void) {
    return KVSHARE_C_API_VERSION_PATCH;
}

int kvshare_check_version(int major, int minor) {
    return major < KVSHARE_C_API_VERSION_MAJOR ||
           (major == KVSHARE_C_API_VERSION_MAJOR && minor <= KVSHARE_C_API_VERSION_MINOR);
}

int kvshare_decoder_open(const char *model_path, const kvshare_kv_params *params, kvshare_decoder **out) {
    if (out == nullptr) return refuse_null_out("kvshare_decoder_open");
    *out = new (std::nothrow) kvshare_decoder;
    if (*out == nullptr) {
        t_open_failure = "kvshare_decoder_open: out of memory for the handle";
        return -ENOMEM;
    }
    kvshare_decoder &d = **out;
    const int rc = guarded(d.last_error, "kvshare_decoder_open", [&]() -> int {
        auto refuse = [&](const Error &error) {
            d.open_failure = error.what();
            d.last_error = d.open_failure;
            return negative_errno(error);
        };
        auto kv_params = to_kv_params(params);
        if (!kv_params) return refuse(kv_params.error());
        auto model = read_model(model_path);
        if (!model) return refuse(model.error());
        auto header = layout::make_share_header(model->fingerprint, model->shape, *kv_params);
        if (!header) return refuse(header.error().with_context(fmt::format("model {}", model_path)));
        if (auto adoptable = kvshare::check_adoptable_memory_kind(header->memory.kind); !adoptable)
            return refuse(adoptable.error().with_context(fmt::format("model {}", model_path)));
        auto export_options = kvshare::ExportOptions::from_env();
        if (!export_options) return refuse(export_options.error());
        d.share.emplace(kvshare::DecoderShare::start(std::move(*header), true, *export_options));
        if (!d.share->can_share()) {
            d.open_failure = d.share->startup_warning();
            d.last_error = d.open_failure;
            return -ENOTSUP;
        }
        return 0;
    });
    if (rc != 0 && d.open_failure.empty()) d.open_failure = d.last_error;
    return rc;
}

void kvshare_decoder_close(kvshare_decoder *decoder) {
    delete decoder;
}

const char *kvshare_decoder_last_error(const kvshare_decoder *decoder) {
    return decoder == nullptr ? t_open_failure.c_str() : decoder->last_error.c_str();
}

int kvshare_decoder_can_share(const kvshare_decoder *decoder) {
    return decoder != nullptr && decoder->can_share();
}

const char *kvshare_decoder_refusal(const kvshare_decoder *decoder) {
    static const std::string flag_unset = kvshare::share_unavailable_reason(false, "");
    if (decoder == nullptr) return flag_unset.c_str();
    const kvshare_decoder &d = *decoder;
    d.refusal = d.can_share() ? std::string() : kvshare::share_unavailable_reason(true, d.open_failure);
    return d.refusal.c_str();
}

void kvshare_decoder_decline(kvshare_decoder *decoder, const char *reason) {
    if (decoder == nullptr) return;
    decoder->open_failure = reason != nullptr && reason[0] != '\0' ? reason : "the decoder declined the layout";
    decoder->share.reset();
}

uint32_t kvshare_decoder_n_chunks(const kvshare_decoder *decoder) {
    return decoder != nullptr && decoder->can_share() ? static_cast<uint32_t>(decoder->share->regions().size()) : 0;
}

int kvshare_decoder_chunk(const kvshare_decoder *decoder, uint32_t index, void **base, uint64_t *size_bytes) {
    if (decoder == nullptr) return -EINVAL;
    const kvshare_decoder &d = *decoder;
    if (!d.can_share()) {
        d.last_error = kvshare_decoder_refusal(&d);
        return -ENOTSUP;
    }
    return fill_chunk(d.share->chunk_bytes(), index, base, size_bytes, d.last_error);
}

uint32_t kvshare_decoder_n_tensors(const kvshare_decoder *decoder) {
    return decoder != nullptr && decoder->can_share()
               ? static_cast<uint32_t>(decoder->share->header().layout.tensors.size())
               : 0;
}

int kvshare_decoder_tensor(const kvshare_decoder *decoder, const char *name, kvshare_tensor_info *out) {
    if (decoder == nullptr || name == nullptr) return -EINVAL;
    const kvshare_decoder &d = *decoder;
    return guarded(d.last_error, "kvshare_decoder_tensor", [&] {
        if (!d.can_share()) {
            d.last_error = kvshare_decoder_refusal(&d);
            return -ENOTSUP;
        }
        return fill_tensor_info(d.share->view(name), out, d.last_error);
    });
}

const char *kvshare_decoder_backend(const kvshare_decoder *decoder) {
    if (decoder == nullptr || !decoder->can_share()) return "";
    return kvshare::region_backend_name(decoder->share->regions().front().backend).data();
}

uint64_t kvshare_decoder_region_bytes(const kvshare_decoder *decoder) {
    return decoder != nullptr && decoder->can_share() ? decoder->share->header().layout.total_bytes() : 0;
}

int kvshare_decoder_share(kvshare_decoder *decoder, const char *socket_path, int timeout_ms, uint64_t *share_id) {
    return kvshare_decoder_share_stream(decoder, socket_path, 0, timeout_ms, share_id);
}

int kvshare_decoder_share_stream(kvshare_decoder *decoder, const char *socket_path, uint32_t stream, int timeout_ms,
                                 uint64_t *share_id) {
    return kvshare_decoder_share_cells(decoder, socket_path, stream, 0, 0, timeout_ms, share_id);
}

int kvshare_decoder_share_cells(kvshare_decoder *decoder, const char *socket_path, uint32_t stream, uint32_t first_cell,
                                uint32_t n_cells, int timeout_ms, uint64_t *share_id) {
    if (decoder == nullptr) return -EINVAL;
    kvshare_decoder &d = *decoder;
    return guarded(d.last_error, "kvshare_decoder_share", [&] {
        if (socket_path == nullptr || socket_path[0] == '\0') {
            d.last_error = "share: the socket path is empty";
            return -EINVAL;
        }
        if (!d.can_share()) {
            d.last_error = kvshare_decoder_refusal(&d);
            return -ENOTSUP;
        }
        auto id = d.share->share(socket_path, kvshare::ShareCells{stream, first_cell, n_cells},
                                 timeout_ms > 0 ? timeout_ms : kvshare::kShareTimeoutMs);
        if (!id) {
            d.last_error = id.error().what();
            return negative_errno(id.error());
        }
        if (share_id != nullptr) *share_id = *id;
        return 0;
    });
}

int kvshare_decoder_adopt(kvshare_decoder *decoder, uint64_t n_tokens, uint64_t share_id) {
    return kvshare_decoder_adopt_stream(decoder, n_tokens, share_id, 0);
}

int kvshare_decoder_adopt_stream(kvshare_decoder *decoder, uint64_t n_tokens, uint64_t share_id, uint32_t stream) {
    if (decoder == nullptr) return -EINVAL;
    kvshare_decoder &d = *decoder;
    return guarded(d.last_error, "kvshare_decoder_adopt", [&] {
        if (!d.can_share()) {
            d.last_error = kvshare_decoder_refusal(&d);
            return -ENOTSUP;
        }
        // DecoderShare refuses a share that never reached a broker (no provider wrote it), one
        // made stale by a later overlapping share, one adopted already, and another stream's.
        auto plan = d.share->adopt(n_tokens, share_id, stream);
        if (!plan) {
            d.last_error = plan.error().what();
            return negative_errno(plan.error());
        }
        return 0;
    });
}

int kvshare_provider_open(const char *layout_path, const char *fd_list, const char *model_path,
                          kvshare_provider **out) {
    if (out == nullptr) return refuse_null_out("kvshare_provider_open");
    *out = nullptr;
    return guarded(t_open_failure, "kvshare_provider_open", [&]() -> int {
        if (layout_path == nullptr || fd_list == nullptr)
            return fail_with(Error(EINVAL, "provider: NULL layout path or fd list"), t_open_failure);
        auto fds = kvshare::parse_fd_list(fd_list);
        if (!fds) return fail_with(fds.error().with_context("--fds"), t_open_failure);
        auto import = [&](const layout::ShareHeader *ours) {
            return ours != nullptr ? kvshare::ProviderShare::open(layout_path, *fds, *ours)
                                   : kvshare::ProviderShare::open_unchecked(layout_path, *fds);
        };
        std::optional<ModelFacts> model;
        layout::KvParams theirs;
        if (model_path != nullptr) {
            auto header = kvshare::read_header_file(layout_path);
            if (!header) return fail_with(header.error(), t_open_failure);
            theirs = header->params;
            auto read = read_model(model_path);
            if (!read) return fail_with(read.error(), t_open_failure);
            model = std::move(*read);
        }
        auto opened = open_checked(model ? &*model : nullptr, model_path, theirs, import);
        if (!opened) return fail_with(opened.error(), t_open_failure);
        *out = opened->release();
        return 0;
    });
}

void kvshare_provider_close(kvshare_provider *provider) {
    delete provider;
}

const char *kvshare_provider_last_error(const kvshare_provider *provider) {
    return provider == nullptr ? t_open_failure.c_str() : provider->last_error.c_str();
}

int kvshare_provider_kv_params(const kvshare_provider *provider, kvshare_kv_params *out) {
    if (provider == nullptr || out == nullptr) return -EINVAL;
    const kvshare_provider &p = *provider;
    fill_first_version(out, p.share.header().params);
    return 0;
}

uint32_t kvshare_provider_kv_size(const kvshare_provider *provider) {
    if (provider == nullptr || provider->share.header().memory.kv_caches.empty()) return 0;
    return provider->share.header().memory.kv_caches.front().kv_size;
}

uint32_t kvshare_provider_n_chunks(const kvshare_provider *provider) {
    return provider != nullptr ? static_cast<uint32_t>(provider->share.imported().regions().size()) : 0;
}

int kvshare_provider_chunk(const kvshare_provider *provider, uint32_t index, void **base, uint64_t *size_bytes) {
    if (provider == nullptr) return -EINVAL;
    const kvshare_provider &p = *provider;
    return fill_chunk(p.share.imported().chunk_bytes(), index, base, size_bytes, p.last_error);
}

uint32_t kvshare_provider_n_tensors(const kvshare_provider *provider) {
    return provider != nullptr ? static_cast<uint32_t>(provider->share.header().layout.tensors.size()) : 0;
}

int kvshare_provider_tensor(const kvshare_provider *provider, const char *name, kvshare_tensor_info *out) {
    if (provider == nullptr || name == nullptr) return -EINVAL;
    const kvshare_provider &p = *provider;
    return guarded(p.last_error, "kvshare_provider_tensor",
                   [&] { return fill_tensor_info(p.share.view(name), out, p.last_error); });
}

int kvshare_provider_begin_write(kvshare_provider *provider) {
    if (provider == nullptr) return -EINVAL;
    kvshare_provider &p = *provider;
    return guarded(p.last_error, "kvshare_provider_begin_write", [&] {
        if (!p.write_access.empty()) return 0;
        auto access = p.share.begin_write();
        if (!access) {
            p.last_error = access.error().what();
            return negative_errno(access.error());
        }
        p.write_access = std::move(*access);
        p.in_write = true;
        return 0;
    });
}

int kvshare_provider_end_write(kvshare_provider *provider) {
    if (provider == nullptr) return -EINVAL;
    provider->write_access.clear();  // each guard's destructor issues SYNC_END
    provider->in_write = false;
    return 0;
}

int kvshare_provider_scatter(kvshare_provider *provider, uint32_t il, uint32_t pos0, uint32_t n_tokens,
                             int32_t src_type, const void *rows, uint64_t row_stride, uint32_t n_embd_k_gqa,
                             uint32_t n_embd_v_gqa) {
    if (provider == nullptr) return -EINVAL;
    kvshare_provider &p = *provider;
    return guarded(p.last_error, "kvshare_provider_scatter", [&] {
        if (!layout::ggml_type_traits(src_type)) {
            p.last_error = fmt::format("scatter of layer {}: source type {} is not a ggml type id", il, src_type);
            return -EINVAL;
        }
        if (p.n_cells > 0 && uint64_t{pos0} + n_tokens > p.n_cells) {
            p.last_error = fmt::format(
                "scatter of layer {}: positions {}..{} pass the share's n_cells {} (cells {}..{} of "
                "stream {}); nothing was written",
                il, pos0, uint64_t{pos0} + n_tokens - 1, p.n_cells, p.first_cell,
                uint64_t{p.first_cell} + p.n_cells - 1, p.stream);
            return -EINVAL;
        }
        const bool heads_agree = p.n_embd_head_k != UINT32_MAX && p.n_embd_head_v != UINT32_MAX;
        const kvshare::ScatterTarget target = provider_target(p);
        kvshare::ScatterBatch batch;
        batch.layers.push_back({il, rows, n_embd_k_gqa, n_embd_v_gqa});
        batch.pos0 = p.first_cell + pos0;  // the range's cells: position p at cell first_cell + p
        batch.n_tokens = n_tokens;
        batch.stream = p.stream;
        batch.src_type = static_cast<layout::GgmlType>(src_type);
        batch.row_stride = row_stride;
        batch.rotation_disabled = !heads_agree || kvshare::statefile::attn_rotation_disabled_by_env();
        auto scattered = kvshare::scatter(target, batch);
        if (!scattered) {
            p.last_error = scattered.error().what();
            return negative_errno(scattered.error());
        }
        return 0;
    });
}

uint32_t kvshare_provider_n_stream(const kvshare_provider *provider) {
    if (provider == nullptr) return 1;
    return kvshare::share_n_stream(provider->share.header().memory);
}

uint32_t kvshare_provider_stream(const kvshare_provider *provider) {
    return provider == nullptr ? 0 : provider->stream;
}

int kvshare_provider_set_stream(kvshare_provider *provider, uint32_t stream) {
    return kvshare_provider_set_cells(provider, stream, 0, 0);
}

int kvshare_provider_set_cells(kvshare_provider *provider, uint32_t stream, uint32_t first_cell, uint32_t n_cells) {
    if (provider == nullptr) return -EINVAL;
    kvshare_provider &p = *provider;
    auto cells = kvshare::check_cells_in_memory(p.share.header(), kvshare::ShareCells{stream, first_cell, n_cells});
    if (!cells) return fail_with(cells.error().with_context("provider"), p.last_error);
    p.stream = cells->stream;
    p.first_cell = cells->first_cell;
    p.n_cells = cells->n_cells;
    return 0;
}

uint32_t kvshare_provider_first_cell(const kvshare_provider *provider) {
    return provider == nullptr ? 0 : provider->first_cell;
}

uint32_t kvshare_provider_n_cells(const kvshare_provider *provider) {
    if (provider == nullptr) return 0;
    return provider->n_cells > 0 ? provider->n_cells : kvshare_provider_kv_size(provider);
}

int kvshare_provider_import_npu(kvshare_provider *provider, const char *accel_dir) {
    if (provider == nullptr) return -EINVAL;
    kvshare_provider &p = *provider;
    return guarded(p.last_error, "kvshare_provider_import_npu", [&] {
        if (p.npu) return 0;
        auto device = kvshare::xdna::find_device(accel_dir != nullptr ? accel_dir : kvshare::xdna::kAccelDir);
        if (!device) {
            p.last_error = device.error().what();
            return negative_errno(device.error());
        }
        auto imported = kvshare::xdna::NpuShare::import(std::move(*device), p.share.imported());
        if (!imported) {
            p.last_error = imported.error().what();
            return negative_errno(imported.error());
        }
        p.npu = std::move(*imported);
        return 0;
    });
}

int kvshare_provider_device_address(const kvshare_provider *provider, const char *name, uint64_t *address) {
    if (provider == nullptr || name == nullptr || address == nullptr) return -EINVAL;
    const kvshare_provider &p = *provider;
    return guarded(p.last_error, "kvshare_provider_device_address", [&] {
        if (!p.npu) {
            if (auto view = p.share.view(name); !view) {
                p.last_error = view.error().what();
                return negative_errno(view.error());
            }
            p.last_error =
                fmt::format("{}: the share is not imported into an NPU (call kvshare_provider_import_npu)", name);
            return -ENXIO;
        }
        auto found = p.npu->device_address(p.share.imported(), name);
        if (!found) {
            p.last_error = found.error().what();
            return negative_errno(found.error());
        }
        *address = *found;
        return 0;
    });
}

uint32_t kvshare_provider_rs_size(const kvshare_provider *provider) {
    if (provider == nullptr || !provider->share.header().memory.recurrent) return 0;
    return provider->share.header().memory.recurrent->rs_size;
}

int kvshare_provider_state_width(const kvshare_provider *provider, uint32_t il, int kind, uint64_t *n_values) {
    if (provider == nullptr) return -EINVAL;
    const kvshare_provider &p = *provider;
    return guarded(p.last_error, "kvshare_provider_state_width", [&] {
        if (n_values == nullptr)
            return fail_with(Error(EINVAL, fmt::format("state width of layer {}: n_values is NULL", il)), p.last_error);
        auto tensor_kind = to_state_kind(kind, il);
        if (!tensor_kind) return fail_with(tensor_kind.error(), p.last_error);
        const auto &header = p.share.header();
        auto width = kvshare::state_width(header.layout, header.memory, il, *tensor_kind);
        if (!width) return fail_with(width.error(), p.last_error);
        *n_values = *width;
        return 0;
    });
}

int kvshare_provider_write_state(kvshare_provider *provider, uint32_t il, int kind, uint32_t cell, const float *values,
                                 uint64_t n_values) {
    if (provider == nullptr) return -EINVAL;
    kvshare_provider &p = *provider;
    return guarded(p.last_error, "kvshare_provider_write_state", [&] {
        auto tensor_kind = to_state_kind(kind, il);
        if (!tensor_kind) return fail_with(tensor_kind.error(), p.last_error);
        const std::string tensor = fmt::format("cache_{}_l{}", layout::tensor_kind_name(*tensor_kind), il);
        if (!p.in_write)
            return fail_with(
                Error(EINVAL, fmt::format("write_state of layer {} {} cell {}: not inside a write bracket (call "
                                          "kvshare_provider_begin_write first)",
                                          il, tensor, cell)),
                p.last_error);
        if (values == nullptr && n_values > 0)
            return fail_with(
                Error(EINVAL, fmt::format("write_state of layer {} {} cell {}: values is NULL for {} values", il,
                                          tensor, cell, n_values)),
                p.last_error);
        kvshare::StateRow row;
        row.il = il;
        row.kind = *tensor_kind;
        row.cell = cell;
        row.values = std::span<const float>(values, static_cast<size_t>(n_values));
        auto written = kvshare::write_state(provider_target(p), row);
        if (!written) return fail_with(written.error(), p.last_error);
        return 0;
    });
}

}  // extern "C"

// KVSHARE_1.3: the provider end of one resident provider, over ProviderChannel / ProviderListener. The
// handle keeps what the protocol's rules need (the hello, which region is held, its header)
// and answers itself what they refuse (kvshare::check_prefill_admitted, check_cells_in_memory,
// a region's share that open_checked refuses), so a C engine cannot get them wrong.
struct kvshare_resident {
    std::optional<ModelFacts> model;  // every REGION is checked against it (none: unchecked)
    std::string model_path;
    std::optional<kvshare::ProviderListener> listener;  // --serve PATH
    std::optional<kvshare::ProviderChannel> channel;    // the serve of now, if any
    std::optional<kvshare::ProviderReply> hello;
    bool end_due = false;  // the channel broke: the next kvshare_resident_next says END
    // The request handed out and not answered yet.
    bool pending = false;
    kvshare::ProviderOp pending_op = kvshare::ProviderOp::prefill;
    uint64_t pending_region_id = 0;
    kvshare_provider *region = nullptr;  // the latest REGION's, until taken, replaced or ended
    // The latest REGION's header, kept when the engine takes the region: a PREFILL_SHARED's
    // stream and cells are checked against it.
    std::optional<layout::ShareHeader> region_header;
    uint64_t held_region_id = 0;  // the REGION last answered ok (0: none)
    uint32_t first_cell = 0;      // the pending PREFILL_SHARED's range (kvshare_resident_cells)
    uint32_t n_cells = 0;
    std::vector<int32_t> tokens;  // the pending PREFILL's
    std::string state_file;
    std::string last_error;

    void drop_region() {
        kvshare_provider_close(region);
        region = nullptr;
    }
    // serve is gone (it closed, or the channel failed): nothing of its session stays.
    void end_session() {
        channel.reset();
        pending = false;
        held_region_id = 0;
        drop_region();
    }
};

namespace {

// A failure of the channel itself: the session is over, and END is reported next.
int channel_broke(kvshare_resident &r, const Error &error) {
    r.end_session();
    r.end_due = true;
    return fail_with(error, r.last_error);
}

// An answer kvshare_resident_next gives itself (ESTALE, a refused region): 0, or the
// channel's failure.
int answer_inside(kvshare_resident &r, kvshare::ProviderOp op, int errnum, std::string message) {
    kvshare::ProviderReply reply;
    reply.op = op;
    reply.ok = false;
    reply.error_errno = errnum;
    reply.error = std::move(message);
    if (auto sent = r.channel->reply(reply); !sent) return channel_broke(r, sent.error());
    return 0;
}

std::string serve_of(const kvshare_resident &r) {
    return fmt::format("kvshare-serve (pid {})", r.channel->peer().pid);
}

// A handle for `open` to connect, stored in *out only when it and the model's reading
// succeed; a failure closes whatever it opened (serve sees the channel end) with it.
int create_resident(const char *model_path, kvshare_resident **out, const char *what,
                    const std::function<Result<void>(kvshare_resident &)> &open) {
    if (out == nullptr) return refuse_null_out(what);
    *out = nullptr;
    return guarded(t_open_failure, what, [&]() -> int {
        auto r = std::make_unique<kvshare_resident>();
        if (auto opened = open(*r); !opened) return fail_with(opened.error(), t_open_failure);
        if (model_path != nullptr) {
            auto model = read_model(model_path);
            if (!model) return fail_with(model.error(), t_open_failure);
            r->model = std::move(*model);
            r->model_path = model_path;
        }
        *out = r.release();
        return 0;
    });
}

// Fills *out from a REGION: the share checked and imported as kvshare_provider_open does.
// 1 when handed out, 0 when answered here (a refused share), < 0 when the channel broke.
int take_region_request(kvshare_resident &r, kvshare::ProviderCall &call, kvshare_resident_request *out) {
    r.drop_region();
    r.held_region_id = 0;  // replaced: until the engine answers, no region is held
    const uint64_t region_id = call.request.region_id;
    const std::string source = fmt::format("region {} from {}", region_id, serve_of(r));
    const layout::KvParams theirs = call.region->header.params;
    auto import = [&](const layout::ShareHeader *ours) {
        return kvshare::ProviderShare::open_received(std::move(*call.region), ours, source);
    };
    auto opened = open_checked(r.model ? &*r.model : nullptr, r.model_path.c_str(), theirs, import);
    if (!opened) {
        const int sent = answer_inside(r, kvshare::ProviderOp::region, errno_of(opened.error()), opened.error().what());
        return sent < 0 ? sent : 0;
    }
    r.region = opened->release();
    r.pending_region_id = region_id;
    r.region_header = r.region->share.header();
    out->kind = KVSHARE_REQUEST_REGION;
    out->region_id = region_id;
    out->region = r.region;
    out->kv = c_kv_params(r.region->share.header().params);
    return 1;
}

// Fills *out from a PREFILL, or answers it here. As take_region_request.
int take_prefill_request(kvshare_resident &r, kvshare::ProviderCall &call, kvshare_resident_request *out) {
    kvshare::ProviderRequest &q = call.request;
    const bool shared = q.route == kvshare::PrefillRoute::shared;
    auto refuse = [&](const Error &error) {
        const int sent = answer_inside(r, kvshare::ProviderOp::prefill, errno_of(error), error.message());
        return sent < 0 ? sent : 0;
    };
    if (auto admitted = kvshare::check_prefill_admitted(*r.hello, r.held_region_id, q); !admitted)
        return refuse(admitted.error());
    out->kv = c_kv_params(layout::KvParams{});  // llama-server's defaults; a file prefill's own fields below
    if (!shared) {
        auto type_k = layout::parse_cache_type(q.kv.type_k);
        if (!type_k) return refuse(Error(EINVAL, fmt::format("\"kv\" \"type_k\": {}", type_k.error().what())));
        auto type_v = layout::parse_cache_type(q.kv.type_v);
        if (!type_v) return refuse(Error(EINVAL, fmt::format("\"kv\" \"type_v\": {}", type_v.error().what())));
        out->kv.n_ctx = q.kv.n_ctx;
        out->kv.type_k = static_cast<int32_t>(*type_k);
        out->kv.type_v = static_cast<int32_t>(*type_v);
        out->kv.flash_attn = q.kv.flash_attn;
        out->kv.n_seq_max = q.kv.n_seq_max;
        out->kv.kv_unified = q.kv.kv_unified;
        r.state_file = std::move(q.state_file);
        out->state_file = r.state_file.c_str();
        out->state_version = q.state_version;
    }
    if (shared) {
        auto refuse_in_region = [&](const Error &error) {
            return refuse(Error(error.errno_value(),
                                fmt::format("region {}: {}; nothing was written", q.region_id, error.message())));
        };
        // Admitted: the region named is the one held, and region_header is its header.
        auto cells =
            kvshare::check_cells_in_memory(*r.region_header, kvshare::ShareCells{q.stream, q.first_cell, q.n_cells});
        if (!cells) return refuse_in_region(cells.error());
        if (auto fits = kvshare::check_tokens_fit_cells(*cells, q.tokens.size()); !fits)
            return refuse_in_region(fits.error());
        // The engine scatters through the region it was handed: it then writes the stream and
        // cells serve named, unchanged. A region the engine took is its own to set (out->stream,
        // kvshare_resident_cells).
        if (r.region != nullptr && kvshare_provider_set_cells(r.region, q.stream, q.first_cell, q.n_cells) != 0)
            return refuse_in_region(Error(EINVAL, r.region->last_error));
    }
    r.first_cell = shared ? q.first_cell : 0;
    r.n_cells = shared ? q.n_cells : 0;
    r.tokens = std::move(q.tokens);
    out->stream = shared ? q.stream : 0;
    out->kind = shared ? KVSHARE_REQUEST_PREFILL_SHARED : KVSHARE_REQUEST_PREFILL_FILE;
    out->region_id = shared ? q.region_id : 0;
    out->share_id = q.share_id;
    out->n_cached = shared ? q.n_cached : 0;
    out->n_tokens = static_cast<uint32_t>(r.tokens.size());
    out->tokens = r.tokens.data();
    return 1;
}

int send_reply(kvshare_resident &r, const kvshare::ProviderReply &reply) {
    r.pending = false;
    if (auto sent = r.channel->reply(reply); !sent) return channel_broke(r, sent.error());
    return 0;
}

int no_pending_request(kvshare_resident &r, const char *what) {
    return fail_with(
        Error(EINVAL, fmt::format("{}: no request is waiting for an answer (call kvshare_resident_next)", what)),
        r.last_error);
}

// Waits for serve's next request and fills `request` (zeroed by the caller) with the one to
// hand out, answering the others itself: 0 (END included), or the failure.
int next_request(kvshare_resident &r, int timeout_ms, kvshare_resident_request &request) {
    for (;;) {
        if (r.end_due || (!r.channel && !r.listener)) {
            r.end_due = false;
            request.kind = KVSHARE_REQUEST_END;
            return 0;
        }
        if (!r.channel) {
            auto accepted = r.listener->accept(timeout_ms);
            if (!accepted) return fail_with(accepted.error(), r.last_error);
            r.channel.emplace(std::move(*accepted));
            if (auto said = r.channel->say_hello(*r.hello); !said) {
                // This serve left before the hello: wait for the next one, as if it never came.
                r.end_session();
                continue;
            }
        }
        auto call = r.channel->next(timeout_ms);
        if (!call) {
            if (call.error().errno_value() == ETIMEDOUT) return fail_with(call.error(), r.last_error);
            if (call.error().errno_value() == ENODATA) {
                r.end_session();
                request.kind = KVSHARE_REQUEST_END;
                return 0;
            }
            return channel_broke(r, call.error());
        }
        // A request answered here may have filled some fields: the next one starts from zero.
        request = kvshare_resident_request{};
        const int taken = call->request.op == kvshare::ProviderOp::region ? take_region_request(r, *call, &request)
                                                                          : take_prefill_request(r, *call, &request);
        if (taken < 0) return taken;
        if (taken == 0) continue;  // answered here; serve asks again or sends what it must
        r.pending = true;
        r.pending_op = call->request.op;
        return 0;
    }
}

}  // namespace

extern "C" {

int kvshare_resident_from_fd(int fd, const char *model_path, kvshare_resident **out) {
    if (out == nullptr) {
        if (fd >= 0) ::close(fd);
        return refuse_null_out("kvshare_resident_from_fd");
    }
    return create_resident(model_path, out, "kvshare_resident_from_fd", [fd](kvshare_resident &r) -> Result<void> {
        auto channel = kvshare::ProviderChannel::from_fd(kvshare::Fd(fd));
        if (!channel) return kvshare::fail(channel.error());
        r.channel.emplace(std::move(*channel));
        return {};
    });
}

int kvshare_resident_listen(const char *socket_path, const char *model_path, kvshare_resident **out) {
    return create_resident(model_path, out, "kvshare_resident_listen",
                           [socket_path](kvshare_resident &r) -> Result<void> {
                               if (socket_path == nullptr) return kvshare::fail(EINVAL, "--serve: NULL socket path");
                               auto listener = kvshare::ProviderListener::listen(socket_path);
                               if (!listener) return kvshare::fail(listener.error());
                               r.listener.emplace(std::move(*listener));
                               return {};
                           });
}

void kvshare_resident_close(kvshare_resident *resident) {
    if (resident == nullptr) return;
    resident->end_session();
    delete resident;
}

const char *kvshare_resident_last_error(const kvshare_resident *resident) {
    return resident == nullptr ? t_open_failure.c_str() : resident->last_error.c_str();
}

int kvshare_resident_hello(kvshare_resident *resident, int routes_mask, int takes_cached) {
    if (resident == nullptr) return -EINVAL;
    kvshare_resident &r = *resident;
    return guarded(r.last_error, "kvshare_resident_hello", [&]() -> int {
        constexpr int kRoutes = KVSHARE_ROUTE_SHARED | KVSHARE_ROUTE_FILE;
        if (r.hello)
            return fail_with(
                Error(EINVAL, "hello: said already (once per handle; a listener repeats it to every serve)"),
                r.last_error);
        if (routes_mask == 0 || (routes_mask & ~kRoutes) != 0)
            return fail_with(Error(EINVAL, fmt::format("hello: routes_mask {:#x} is not KVSHARE_ROUTE_SHARED ({}), "
                                                       "KVSHARE_ROUTE_FILE ({}) or both",
                                                       routes_mask, KVSHARE_ROUTE_SHARED, KVSHARE_ROUTE_FILE)),
                             r.last_error);
        kvshare::ProviderReply hello;
        hello.op = kvshare::ProviderOp::hello;
        hello.pid = static_cast<uint64_t>(::getpid());
        hello.takes_shared = (routes_mask & KVSHARE_ROUTE_SHARED) != 0;
        hello.takes_file = (routes_mask & KVSHARE_ROUTE_FILE) != 0;
        hello.takes_cached = takes_cached != 0;
        r.hello = hello;
        if (!r.channel) return 0;  // a listener says it to each serve it accepts
        if (auto said = r.channel->say_hello(hello); !said) return channel_broke(r, said.error());
        return 0;
    });
}

int kvshare_resident_next(kvshare_resident *resident, int timeout_ms, kvshare_resident_request *out) {
    if (resident == nullptr) return -EINVAL;
    kvshare_resident &r = *resident;
    return guarded(r.last_error, "kvshare_resident_next", [&]() -> int {
        // Before anything is taken from the channel: a struct refused loses no request.
        auto n_bytes = struct_bytes(out);
        if (!n_bytes) return fail_with(n_bytes.error().with_context("next"), r.last_error);
        if (!r.hello) return fail_with(Error(EINVAL, "next: call kvshare_resident_hello first"), r.last_error);
        if (r.pending)
            return fail_with(Error(EBUSY, fmt::format("next: the {} request handed out last is not answered yet "
                                                      "(kvshare_resident_reply_ok or _error)",
                                                      kvshare::provider_op_name(r.pending_op))),
                             r.last_error);
        r.tokens.clear();
        r.first_cell = 0;
        r.n_cells = 0;
        r.state_file.clear();
        kvshare_resident_request request{};
        const int rc = next_request(r, timeout_ms, request);
        fill_struct(out, request, *n_bytes);
        return rc;
    });
}

int kvshare_resident_cells(const kvshare_resident *resident, uint32_t *first_cell, uint32_t *n_cells) {
    if (resident == nullptr) return -EINVAL;
    if (first_cell != nullptr) *first_cell = resident->pending ? resident->first_cell : 0;
    if (n_cells != nullptr) *n_cells = resident->pending ? resident->n_cells : 0;
    return 0;
}

kvshare_provider *kvshare_resident_take_region(kvshare_resident *resident) {
    if (resident == nullptr) return nullptr;
    kvshare_provider *region = resident->region;
    resident->region = nullptr;
    return region;
}

int kvshare_resident_reply_ok(kvshare_resident *resident, double ms, uint32_t n_prefilled) {
    if (resident == nullptr) return -EINVAL;
    kvshare_resident &r = *resident;
    return guarded(r.last_error, "kvshare_resident_reply_ok", [&]() -> int {
        if (!r.pending || !r.channel) return no_pending_request(r, "reply_ok");
        if (!std::isfinite(ms) || ms < 0)
            return fail_with(Error(EINVAL, fmt::format("reply_ok: {} ms is not a duration", ms)), r.last_error);
        kvshare::ProviderReply reply;
        reply.op = r.pending_op;
        if (r.pending_op == kvshare::ProviderOp::region) {
            reply.region_id = r.pending_region_id;
            reply.region_ms = ms;
            r.held_region_id = r.pending_region_id;
        } else {
            reply.prefill_ms = ms;
            reply.n_prefilled = n_prefilled;
        }
        return send_reply(r, reply);
    });
}

int kvshare_resident_reply_error(kvshare_resident *resident, int errnum, const char *message) {
    if (resident == nullptr) return -EINVAL;
    kvshare_resident &r = *resident;
    return guarded(r.last_error, "kvshare_resident_reply_error", [&]() -> int {
        if (!r.pending || !r.channel) return no_pending_request(r, "reply_error");
        if (errnum < 1 || errnum > 4095)
            return fail_with(Error(EINVAL, fmt::format("reply_error: errno {} is not 1..4095", errnum)), r.last_error);
        kvshare::ProviderReply reply;
        reply.op = r.pending_op;
        reply.ok = false;
        reply.error_errno = errnum;
        reply.error = message != nullptr ? message : std::strerror(errnum);
        if (r.pending_op == kvshare::ProviderOp::region) {
            r.held_region_id = 0;
            r.drop_region();
        }
        return send_reply(r, reply);
    });
}

}  // extern "C"
