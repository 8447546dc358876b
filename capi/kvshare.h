/*
 * kvshare.h: the C API of kvshare, for decoders (llama-server) and prefill engines (an NPU
 * provider, llama-kvshare-prefill) that must not see kvshare's C++20 headers.
 *
 * C11 and C++17 clean. Every symbol starts with kvshare_; handles are opaque and come in
 * pairs (..._open / ..._close). A fallible call returns 0 or a negative errno value and
 * leaves a readable message in kvshare_*_last_error(handle): what was being done, to
 * which object, and why (the same text kvshare's C++ Error carries). No exception crosses
 * this boundary. A handle is not thread-safe: callers serialize calls on one handle.
 *
 * An open that fails (kvshare_provider_open, kvshare_resident_from_fd,
 * kvshare_resident_listen) hands back no handle: *out is NULL, and
 * kvshare_*_last_error(NULL) gives the message of the calling thread's latest failed open
 * (valid until the next one on that thread). Before KVSHARE_1.5 such an open handed back a
 * handle holding only the message; every call takes NULL, and closing NULL is a no-op, so
 * a caller written for that still reports the reason and frees nothing twice.
 * kvshare_decoder_open differs on purpose: a decoder that cannot share is still a handle,
 * which answers every share with its refusal.
 *
 * Exported symbols are listed in kvshare.map (version nodes KVSHARE_1.0, ...): an ABI
 * addition is a new line in a new node. Link with `pkg-config --libs kvshare-c` or the
 * CMake target kvshare::kvshare_c.
 *
 * Versioned structs (kvshare_kv_params, kvshare_tensor_info, kvshare_resident_request)
 * start with uint32_t struct_size, set by the caller to sizeof the struct its header
 * declares; a struct only ever grows at its end, and a field added later reads its zero as
 * the behaviour before it. Since KVSHARE_1.5 every call that takes one applies the Linux
 * kernel's rule (copy_struct_from_user), so a caller built against an older or a newer
 * header keeps working:
 *   - struct_size below the struct's first version (KVSHARE_*_SIZE_VER0): -EINVAL;
 *   - smaller than this library's struct (an older header): accepted; the fields past
 *     struct_size read as zero, and a struct the library fills is filled only that far;
 *   - larger (a newer header): accepted when every byte past this library's struct is
 *     zero, else -E2BIG naming the struct, its struct_size and the offset of the first
 *     non-zero byte (a field this library does not know was set: kvshare_check_version
 *     says which library knows it). Initialize with `= {.struct_size = sizeof x}`.
 * A struct the library fills has its struct_size set to the bytes filled,
 * min(struct_size, this library's struct). None has grown since its first version yet.
 *
 * The protocol these calls speak is described in kvshare's docs/protocol.md (the
 * handshake), docs/layout.md (the layout header, share_layout) and docs/decoder.md
 * (?action=share and ?action=adopt).
 */
#ifndef KVSHARE_H
#define KVSHARE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The version of the C API this header declares, libkvshare_c's own (libkvshare_c.so.1.5.0;
 * the build refuses a library whose VERSION differs). MINOR is the newest version node of
 * kvshare.map declared here (KVSHARE_1.5): an engine built against an older header lacks
 * the calls of the nodes after it. The library an engine runs with may be newer than the
 * header it was built with: kvshare_version_major() and kvshare_check_version() ask it.
 */
#define KVSHARE_C_API_VERSION_MAJOR 1
#define KVSHARE_C_API_VERSION_MINOR 5
#define KVSHARE_C_API_VERSION_PATCH 0
/* One number for #if: 10500 for 1.5.0. (Before KVSHARE_1.5 it was 1, the major alone.) */
#define KVSHARE_C_API_VERSION \
    (KVSHARE_C_API_VERSION_MAJOR * 10000 + KVSHARE_C_API_VERSION_MINOR * 100 + KVSHARE_C_API_VERSION_PATCH)
/* KVSHARE_1.4's name for KVSHARE_C_API_VERSION_MINOR, kept for the engines that test it. */
#define KVSHARE_C_API_MINOR KVSHARE_C_API_VERSION_MINOR

/*
 * Since KVSHARE_1.5. The version of the libkvshare_c this process runs with (liburing's
 * io_uring_major_version / io_uring_minor_version), which may be newer than the header
 * the caller was built with.
 */
int kvshare_version_major(void);
int kvshare_version_minor(void);
int kvshare_version_patch(void);

/*
 * Since KVSHARE_1.5. 1 when the library this process runs with is version major.minor or
 * later, else 0 (the opposite sense of liburing's io_uring_check_version, true when the
 * library is older). A call of a later node needs no check: the dynamic linker refuses a
 * library without that node. What does is a behaviour without a call of its own, such as
 * a struct field added later: an engine built against a newer header sets that field only
 * when kvshare_check_version says the library knows it (else the call fails with -E2BIG,
 * see "Versioned structs" above).
 */
int kvshare_check_version(int major, int minor);

/*
 * The KV parameters llama-server takes (-c, -np, -kvu, -ctk, -ctv, -fa, --swa-full, -ub).
 * Both sides of a share must use the same ones; they travel in the layout header.
 * Versioned by struct_size: fill it with sizeof(struct kvshare_kv_params), or call
 * kvshare_kv_params_init(), which does that and sets llama-server's defaults.
 * type_k / type_v are ggml's `enum ggml_type` ids (GGML_TYPE_F16 = 1).
 * n_ctx is the whole context, every stream's cells (llama_context_params.n_ctx): without
 * kv_unified kvshare gives each of n_seq_max streams pad256(pad256(n_ctx) / n_seq_max)
 * cells, as llama_context does. A caller that knows only its cache passes kv_size *
 * n_stream (llama_n_ctx()), never one stream's kv_size, which would be split again.
 */
struct kvshare_kv_params {
    uint32_t struct_size; /* versioned ("Versioned structs" above) */
    uint32_t n_ctx;       /* -c: cells of every stream before padding; 0 = the model's context length */
    uint32_t n_seq_max;   /* -np */
    uint32_t n_ubatch;    /* -ub: sizes an SWA cache */
    int32_t type_k;       /* -ctk, a ggml_type id */
    int32_t type_v;       /* -ctv, a ggml_type id */
    uint8_t kv_unified;   /* -kvu */
    uint8_t flash_attn;   /* -fa on|auto: V not transposed; 0 = -fa off (v_trans) */
    uint8_t swa_full;     /* --swa-full */
    uint8_t reserved;
};
/* KVSHARE_1.0's struct, through `reserved`: the smallest struct_size accepted. */
#define KVSHARE_KV_PARAMS_SIZE_VER0 (offsetof(struct kvshare_kv_params, reserved) + sizeof(uint8_t))

/* Sets *params to llama-server's defaults (n_ctx 4096, one unified sequence, f16 K and V,
 * flash attention on, n_ubatch 512). It cannot know the caller's struct_size, so it fills
 * the first version's fields (KVSHARE_KV_PARAMS_SIZE_VER0 bytes) and sets struct_size to
 * that; a caller that sets a field added later sets struct_size to sizeof itself. */
void kvshare_kv_params_init(struct kvshare_kv_params *params);

/*
 * Where one cache tensor (cache_k_l3, cache_v_l3) lives inside the shared region.
 * Versioned by struct_size ("Versioned structs" above): set it to
 * sizeof(struct kvshare_tensor_info) before a call; the call fills that much of it.
 */
struct kvshare_tensor_info {
    uint32_t struct_size;
    uint32_t chunk;     /* index of the chunk (= fd) holding the tensor */
    uint64_t offset;    /* byte offset inside the chunk, a multiple of 4096 */
    uint64_t nbytes;    /* ggml_nbytes of the tensor */
    uint64_t row_bytes; /* nb[1]: bytes of one row (a token's cell for K and non-transposed V) */
    int64_t ne[4];      /* ggml's extents: [n_embd_gqa, kv_size, n_stream, 1] */
    int32_t type;       /* ggml_type id */
    uint32_t layer;     /* il */
    void *data;         /* first byte of the tensor in this process's mapping */
};
/* KVSHARE_1.0's struct, through `data`: the smallest struct_size accepted. */
#define KVSHARE_TENSOR_INFO_SIZE_VER0 (offsetof(struct kvshare_tensor_info, data) + sizeof(void *))

/* 1 when ONEBIT_KV_SHARE is set and non-empty (ONEBIT_KV_SHARE=0 is on too; the opt-out
 * is an unset variable), else 0. */
int kvshare_share_requested(void);

/* ------------------------------------------------------------------------------------
 * Decoder side: the process whose KV cache lives in the exported regions.
 *
 * Lifetime: the handle owns the regions (one per share_layout chunk) and its mapping of
 * them; keep it open for as long as the KV cache tensors point into them. Between a
 * successful share and the adopt of its share_id, the provider writes cells 0..n-1 and
 * the decoder must not touch them; after adopt the decoder owns every byte again.
 * ------------------------------------------------------------------------------------ */
struct kvshare_decoder;

/*
 * Reads the GGUF at model_path (metadata only), derives the memory llama.cpp builds for it
 * with *params, and exports one region per chunk of that layout (dma-heap, udmabuf or
 * memfd; KVSHARE_EXPORT forces one).
 *
 * Always stores a handle in *out (NULL only when memory for it ran out, -ENOMEM, or for
 * out NULL, -EINVAL: kvshare_decoder_last_error(NULL) then says which).
 * Returns 0 when the regions are exported. Otherwise the handle is a decoder that cannot
 * share: every share fails with -ENOTSUP and kvshare_decoder_refusal() names both causes;
 * the return value says why: -ENOTSUP for a memory kind the route cannot adopt (a
 * hybrid with SWA layers) or no export backend, -EINVAL for bad params (a struct_size
 * below KVSHARE_KV_PARAMS_SIZE_VER0 among them) or a model kvshare cannot shape, -E2BIG
 * for a larger *params with a non-zero byte past this library's struct, -ENOENT/-EACCES
 * for the model file. kvshare_decoder_last_error() has the message either way. Close the
 * handle with kvshare_decoder_close().
 */
int kvshare_decoder_open(const char *model_path, const struct kvshare_kv_params *params, struct kvshare_decoder **out);

/* Releases the regions and the handle. NULL is a no-op. The pages live on in any peer
 * that still holds one of the fds. */
void kvshare_decoder_close(struct kvshare_decoder *decoder);

/* The message of the last failed call on this handle, "" when none failed. Valid until
 * the next call on the handle. NULL: the calling thread's latest failed open. */
const char *kvshare_decoder_last_error(const struct kvshare_decoder *decoder);

/* 1 when share can work (regions exported, not declined), else 0. */
int kvshare_decoder_can_share(const struct kvshare_decoder *decoder);

/*
 * Why share is refused, naming both causes (the flag; the backend's export), as the 501
 * reply of ?action=share says it. decoder may be NULL: the text for a decoder started
 * without ONEBIT_KV_SHARE. "" when the decoder can share. Valid until the next call.
 */
const char *kvshare_decoder_refusal(const struct kvshare_decoder *decoder);

/*
 * Gives up sharing after open succeeded, because the caller found its own cache does not
 * match the layout (a tensor's name, type or shape): releases the regions; from now on
 * share fails with -ENOTSUP and kvshare_decoder_refusal() includes `reason`. The caller
 * must not use the regions' addresses after this call.
 */
void kvshare_decoder_decline(struct kvshare_decoder *decoder, const char *reason);

/* Number of chunks (= fds a share sends); 0 when the decoder cannot share. */
uint32_t kvshare_decoder_n_chunks(const struct kvshare_decoder *decoder);

/* Chunk `index`: its first byte in this process's writable mapping and its size (a
 * multiple of 4096). -ENOTSUP when the decoder cannot share, -ERANGE past the last chunk. */
int kvshare_decoder_chunk(const struct kvshare_decoder *decoder, uint32_t index, void **base, uint64_t *size_bytes);

/* Number of cache tensors the layout places (cache_k_l*, cache_v_l*, ...). */
uint32_t kvshare_decoder_n_tensors(const struct kvshare_decoder *decoder);

/* The placement of the tensor called `name` (*out->struct_size must be set). -ENOENT when
 * the layout has no such tensor, -ENOTSUP when the decoder cannot share, -EINVAL for out
 * NULL or a struct_size below KVSHARE_TENSOR_INFO_SIZE_VER0, -E2BIG for a larger struct
 * with a non-zero byte past this library's ("Versioned structs" above). */
int kvshare_decoder_tensor(const struct kvshare_decoder *decoder, const char *name, struct kvshare_tensor_info *out);

/* The export backend of the regions ("memfd", "udmabuf", "dmaheap"), "" when the decoder
 * cannot share. */
const char *kvshare_decoder_backend(const struct kvshare_decoder *decoder);

/* Total bytes of every chunk. */
uint64_t kvshare_decoder_region_bytes(const struct kvshare_decoder *decoder);

/*
 * Connects to the broker listening on the AF_UNIX socket `socket_path`, sends it the
 * layout header and one fd per chunk (SCM_RIGHTS, one message), and stores the new
 * share_id in *share_id. The new share makes stale every earlier, not yet adopted share of
 * the same stream whose cells overlap its own, also when this call fails; a share without
 * a range (this call) covers the whole stream, so every earlier share of stream 0 is stale
 * from now on (kvshare_decoder_share_stream: other streams; kvshare_decoder_share_cells:
 * runs of cells). Blocks at most timeout_ms (<= 0: kvshare's default, 5000 ms); does not
 * wait for the broker to answer. The decoder keeps its own fds.
 * Errors: -ENOTSUP (cannot share: kvshare_decoder_refusal()), a connect or send errno
 * (-ENOENT, -ECONNREFUSED, -EPIPE, -ETIMEDOUT) naming the socket path; a failed share's
 * id is spent and cannot be adopted.
 */
int kvshare_decoder_share(struct kvshare_decoder *decoder, const char *socket_path, int timeout_ms, uint64_t *share_id);

/*
 * Accepts the provider's cells 0..n_tokens-1 for share `share_id`: it must have reached a
 * broker, not been made stale by a later overlapping share, and not been adopted yet
 * (-ESTALE; each id is adopted at most once), n_tokens must be 1..kv_size
 * (-EINVAL for 0, -ERANGE past the cache). No byte moves: on 0 the caller marks its
 * cells 0..n_tokens-1 as positions 0..n_tokens-1 of the sequence (llama_kv_cells_adopt).
 */
int kvshare_decoder_adopt(struct kvshare_decoder *decoder, uint64_t n_tokens, uint64_t share_id);

/*
 * Since KVSHARE_1.4: one stream per slot. llama-server -np N without --kv-unified keeps
 * one KV stream per slot (every cache tensor is [width, kv_size, n_stream]); a share of
 * stream s hands over slot s's cells while the other slots go on decoding from theirs.
 * kvshare_decoder_share and kvshare_decoder_adopt are these calls with stream 0.
 *
 * kvshare_decoder_share_stream: as kvshare_decoder_share, for the cells of `stream`. Share
 * ids increase across streams; a share of stream s makes only stream s's earlier ids
 * stale (a whole stream overlaps every share of it). Refused before connecting, spending no id: -EINVAL for stream >=
 * n_stream (naming both), -ENOTSUP for a memory whose slots have no stream each (a unified cache with n_seq_max > 1:
 * kvshare_decoder_share_cells names the sequence's cells instead; a recurrent state with rs_size > 1): the file route
 * serves those.
 *
 * kvshare_decoder_adopt_stream: as kvshare_decoder_adopt, for stream `stream`: -ESTALE
 * when share_id never reached a broker, was made stale by a later share of that stream
 * whose cells overlap its own (naming it and both ranges), or was adopted; -EINVAL when it
 * is a share made for another stream (naming both) or stream >= n_stream. On 0 the caller marks cells 0..n_tokens-1 of
 * that stream as its slot's sequence positions 0..n_tokens-1.
 */
int kvshare_decoder_share_stream(struct kvshare_decoder *decoder, const char *socket_path, uint32_t stream,
                                 int timeout_ms, uint64_t *share_id);
int kvshare_decoder_adopt_stream(struct kvshare_decoder *decoder, uint64_t n_tokens, uint64_t share_id,
                                 uint32_t stream);

/*
 * Since KVSHARE_1.4: a run of cells. A unified KV cache of several slots (--kv-unified,
 * llama-server's -np auto) keeps every slot's cells in one stream, wherever llama.cpp puts
 * them: the decoder reserves a contiguous run of free cells for the sequence and the share
 * names it. The provider writes prompt position p into cell first_cell + p of `stream`,
 * only for p < n_cells.
 *
 * kvshare_decoder_share_cells: as kvshare_decoder_share_stream, for cells
 * first_cell..first_cell+n_cells-1 of `stream` (n_cells 0: to the end of the stream;
 * first_cell 0 and n_cells 0: the whole stream, exactly kvshare_decoder_share_stream).
 * Refused before connecting, spending no id: -EINVAL for a range past the kv_size of any
 * KV cache (naming first_cell, n_cells and kv_size); -ENOTSUP for a unified cache of
 * several slots without a range, for an iSWA memory's unified caches with one (the SWA
 * cache's cells are placed independently) and for a recurrent state with rs_size > 1.
 * Staleness goes by overlap: a share of cells 100..139 stales an earlier, not yet adopted
 * share of the same stream only when their runs share a cell, so the slots of a unified
 * cache (disjoint runs of stream 0) hand over concurrently, each adoptable; a whole-stream
 * share overlaps every run.
 * kvshare_decoder_adopt_stream of such a share refuses more than n_cells tokens
 * (-ERANGE naming both); on 0 the caller marks cells first_cell..first_cell+n_tokens-1
 * as the sequence's positions 0..n_tokens-1.
 */
int kvshare_decoder_share_cells(struct kvshare_decoder *decoder, const char *socket_path, uint32_t stream,
                                uint32_t first_cell, uint32_t n_cells, int timeout_ms, uint64_t *share_id);

/* ------------------------------------------------------------------------------------
 * Provider side: the process that writes a prompt's K and V into the decoder's cache.
 *
 * Lifetime: the handle owns the descriptors it was given and its own mappings of them
 * (never a driver-made mapping of an imported buffer). The provider writes cells
 * 0..n-1 between the decoder's share and its adopt, and must have closed the handle (or
 * ended its writes) before it reports done: the decoder never re-checks the bytes.
 * ------------------------------------------------------------------------------------ */
struct kvshare_provider;

/*
 * Reads the layout header file `layout_path` (the --layout argument), takes ownership of
 * the descriptors listed in `fd_list` ("3,4", the --fds argument, one per chunk in chunk
 * order; marked close-on-exec so nothing this process starts inherits them) and imports
 * them writable. With a model_path, first refuses a header whose model or KV params differ
 * from that GGUF's in anything that changes the bytes (-EINVAL naming the field and both
 * values); NULL skips the check (tools that only inspect a share).
 *
 * Stores the handle in *out on success. On failure *out is NULL (since KVSHARE_1.5) and
 * kvshare_provider_last_error(NULL) says why. Errors: -EINVAL (a bad fd list, header or
 * mismatch, out NULL), -EBADF (a number that is not an open descriptor), -ENOENT (the
 * header file), -ENOMEM.
 */
int kvshare_provider_open(const char *layout_path, const char *fd_list, const char *model_path,
                          struct kvshare_provider **out);

/* Ends any write bracket, unmaps, closes the descriptors and frees the handle. NULL is a
 * no-op. */
void kvshare_provider_close(struct kvshare_provider *provider);

/* The message of the last failed call on this handle, "" when none failed. NULL: the
 * calling thread's latest failed open. */
const char *kvshare_provider_last_error(const struct kvshare_provider *provider);

/* The KV params in the header (the decoder's): what the provider must run with. Fills *out
 * as kvshare_kv_params_init does: the first version's fields, struct_size set to them. */
int kvshare_provider_kv_params(const struct kvshare_provider *provider, struct kvshare_kv_params *out);

/* Cells of the shared KV cache (kv_size of its first KV cache: the plain one, an iSWA pair's base, a
 * hybrid's attention cache), 0 when the memory has none (recurrent only). */
uint32_t kvshare_provider_kv_size(const struct kvshare_provider *provider);

/* As the decoder's: chunk count, chunk base/size in this process's mapping, placements. */
uint32_t kvshare_provider_n_chunks(const struct kvshare_provider *provider);
int kvshare_provider_chunk(const struct kvshare_provider *provider, uint32_t index, void **base, uint64_t *size_bytes);
uint32_t kvshare_provider_n_tensors(const struct kvshare_provider *provider);
int kvshare_provider_tensor(const struct kvshare_provider *provider, const char *name, struct kvshare_tensor_info *out);

/*
 * Brackets CPU writes into dma-buf regions (DMA_BUF_IOCTL_SYNC; memfd regions need none):
 * call begin before writing through the mapping or scattering, end when done.
 * kvshare_provider_close ends an open bracket. kvshare_provider_write_state refuses to
 * write outside one, whatever the backend.
 */
int kvshare_provider_begin_write(struct kvshare_provider *provider);
int kvshare_provider_end_write(struct kvshare_provider *provider);

/*
 * Writes the K and V rows of layer `il` for cells pos0..pos0+n_tokens-1, converting from
 * src_type (a ggml_type id: F32, F16 or BF16) to the cache types, rotating quantized
 * caches as llama.cpp does, transposing V when the cache does (kvshare's kvshare::scatter).
 * Token t's row starts at rows + t * row_stride: n_embd_k_gqa K values, then n_embd_v_gqa
 * V values (0 for a K-only layer). Checks everything before writing anything: -EINVAL
 * names the layer, tensor or position (unknown layer, width differing from the cache,
 * cells past kv_size, an unsupported type).
 */
int kvshare_provider_scatter(struct kvshare_provider *provider, uint32_t il, uint32_t pos0, uint32_t n_tokens,
                             int32_t src_type, const void *rows, uint64_t row_stride, uint32_t n_embd_k_gqa,
                             uint32_t n_embd_v_gqa);

/*
 * Since KVSHARE_1.4. The stream kvshare_provider_scatter writes: cells pos0.. of that
 * stream only, the other streams (other slots of llama-server -np N, decoding meanwhile)
 * are never touched. 0 on open; a resident provider's PREFILL_SHARED sets the stream of
 * the region it hands out from serve's message (kvshare_resident_request.stream), so an
 * engine that scatters through the region needs no change.
 * kvshare_provider_set_stream: -EINVAL (nothing changes) for stream >= n_stream.
 * kvshare_provider_n_stream: the streams of the first KV cache, 1 when there is none.
 */
int kvshare_provider_set_stream(struct kvshare_provider *provider, uint32_t stream);
uint32_t kvshare_provider_stream(const struct kvshare_provider *provider);
uint32_t kvshare_provider_n_stream(const struct kvshare_provider *provider);

/*
 * Since KVSHARE_1.4. The cells kvshare_provider_scatter writes (the share's range): a
 * scatter's positions pos0..pos0+n_tokens-1 must lie within [0, n_cells) and are written
 * at cells first_cell+pos0.. of `stream` (-EINVAL past n_cells, nothing written). n_cells 0
 * is to the end of the stream; first_cell 0 and n_cells 0 is no range (the whole stream:
 * kvshare_provider_set_stream(p, s) is kvshare_provider_set_cells(p, s, 0, 0)).
 * -EINVAL (nothing changes) for stream >= n_stream or cells past the stream's kv_size (of
 * any KV cache). A resident provider's PREFILL_SHARED sets them on the region it hands out
 * from serve's message ("first_cell", "n_cells"), as it sets the stream.
 * kvshare_provider_first_cell: where position 0 goes (0 when none was set).
 * kvshare_provider_n_cells: the positions scatter may write (kv_size when no range).
 */
int kvshare_provider_set_cells(struct kvshare_provider *provider, uint32_t stream, uint32_t first_cell,
                               uint32_t n_cells);
uint32_t kvshare_provider_first_cell(const struct kvshare_provider *provider);
uint32_t kvshare_provider_n_cells(const struct kvshare_provider *provider);

/*
 * Since KVSHARE_1.1. Imports every chunk of the share into the first AMD XDNA NPU under
 * `accel_dir` (NULL: /dev/accel) as the device's own buffer objects (DRM PRIME, then the
 * driver's GET_BO_INFO for each buffer's device address), so an NPU engine can DMA K and V
 * straight into the decoder's cache. The CPU keeps writing through this handle's own
 * mappings, never a driver-made mapping of an imported buffer. The buffer objects live until
 * kvshare_provider_close. Calling it again is a no-op once it succeeded.
 * Errors: -ENOENT (no accel directory), -ENODEV (no amdxdna node: the message names every
 * node looked at and what it was), or the driver's errno naming the chunk (a memfd region
 * is not a dma-buf: the driver refuses it).
 */
int kvshare_provider_import_npu(struct kvshare_provider *provider, const char *accel_dir);

/*
 * Since KVSHARE_1.1. The NPU's address of tensor `name`'s first byte (its chunk's buffer
 * address plus the tensor's offset), after kvshare_provider_import_npu. Any tensor the
 * layout places answers by name: cache_k_l3 and cache_v_l3, and a recurrent model's
 * cache_r_l0 and cache_s_l0 (see KVSHARE_1.2 below). Errors: -ENOENT
 * (no such tensor), -ENXIO (not imported into an NPU yet), -ENODATA (the driver gave the
 * buffer no device address).
 */
int kvshare_provider_device_address(const struct kvshare_provider *provider, const char *name, uint64_t *address);

/* ------------------------------------------------------------------------------------
 * Since KVSHARE_1.2: the recurrent state of a recurrent or hybrid model (mamba2; qwen35's
 * Gated DeltaNet layers; lfm2's short convolutions). Besides any K/V cache, the region
 * holds per recurrent layer il cache_r_l<il> (the conv history, f32 [n_embd_r, rs_size])
 * and cache_s_l<il> (the SSM / delta state, f32 [n_embd_s, rs_size]; n_embd_s is 0 for
 * LFM2), one row per cell; with one sequence (-np 1) rs_size is 1 and the provider writes
 * cell 0: the state after tokens 0..n-1 of what it prefilled. The element order inside a
 * row is the model graph's; kvshare's docs/provider.md "What an engine writes, per memory
 * kind" spells it out per architecture. Nothing checks it, here or at adopt.
 *
 * An NPU that DMAs the rows itself: after kvshare_provider_import_npu,
 * kvshare_provider_device_address(p, "cache_r_l0", &addr) gives the tensor's address by
 * name like any cache tensor's; row `cell` starts at addr + cell * row_bytes
 * (kvshare_provider_tensor). cache_s_l<il> of LFM2 has 0 bytes: nothing to DMA.
 * ------------------------------------------------------------------------------------ */

/* Which row of a recurrent layer a call is about. */
enum kvshare_state_kind {
    KVSHARE_STATE_R = 1, /* cache_r_l<il>: the conv history, n_embd_r values per cell */
    KVSHARE_STATE_S = 2  /* cache_s_l<il>: the SSM / delta state, n_embd_s values per cell */
};

/* Since KVSHARE_1.2. Cells of the recurrent state (rs_size, max(1, n_seq_max)), 0 when the
 * memory has no recurrent state (a plain or iSWA KV cache). */
uint32_t kvshare_provider_rs_size(const struct kvshare_provider *provider);

/*
 * Since KVSHARE_1.2. Stores in *n_values the number of f32 values of one row of layer il's
 * state of `kind` (a kvshare_state_kind): n_embd_r for KVSHARE_STATE_R, n_embd_s for
 * KVSHARE_STATE_S (0 for LFM2, whose layers hold no S). What kvshare_provider_write_state
 * takes; lets an engine size its buffers without reading the layout header.
 * Errors: -ENOENT (layer il has no recurrent state: an attention layer, a layer past the
 * model, a memory without recurrent state; the message names the layer), -EINVAL (NULL
 * arguments, a kind that is not a kvshare_state_kind).
 * *n_values is untouched on failure.
 */
int kvshare_provider_state_width(const struct kvshare_provider *provider, uint32_t il, int kind, uint64_t *n_values);

/*
 * Since KVSHARE_1.2. Writes one recurrent state row: the n_values f32 `values` (the
 * caller's, only read) become row `cell` of cache_r_l<il> (kind KVSHARE_STATE_R) or
 * cache_s_l<il> (KVSHARE_STATE_S), byte for byte; no other byte of the region changes.
 * Must be called inside the write bracket (kvshare_provider_begin_write .. end_write).
 * Checks everything before writing anything:
 *   -EINVAL  not inside a write bracket; a kind that is not a kvshare_state_kind; a layer
 *            without recurrent state; n_values differing from the row width
 *            (kvshare_provider_state_width); values NULL with n_values > 0;
 *   -ERANGE  cell >= rs_size (kvshare_provider_rs_size).
 * The message names the layer, the tensor (cache_r_l3), the cell and both widths. A
 * 0-wide row (LFM2's S) with n_values 0 is accepted and writes nothing. A failing write
 * to the region itself returns its errno (the row may then be partly written).
 * Blocks only for the copy (a few hundred KiB at most per row).
 */
int kvshare_provider_write_state(struct kvshare_provider *provider, uint32_t il, int kind, uint32_t cell,
                                 const float *values, uint64_t n_values);

/* ------------------------------------------------------------------------------------
 * Since KVSHARE_1.3: the resident provider. kvshare-serve starts a provider once
 * (`PROG --model M ... --serve-fd N`, N one end of a socket pair) or connects to one that
 * listens (`PROG --model M ... --serve PATH`), and speaks kvshare's resident provider
 * protocol to it (docs/provider.md, "The resident provider"): the decoder's region once
 * (REGION), then one prefill per handoff into it (PREFILL_SHARED) or into a state file
 * (PREFILL_FILE). These calls are that protocol's provider end for an engine written in C:
 * the frames, the fds, the checks and the region_id bookkeeping are kvshare's.
 *
 *   struct kvshare_resident *r = NULL;
 *   if (kvshare_resident_from_fd(fd, model, &r) != 0) { report kvshare_resident_last_error(r); }
 *   kvshare_resident_hello(r, KVSHARE_ROUTE_SHARED | KVSHARE_ROUTE_FILE, 1);
 *   struct kvshare_resident_request q = {.struct_size = sizeof q};
 *   while (kvshare_resident_next(r, -1, &q) == 0 && q.kind != KVSHARE_REQUEST_END) {
 *       switch (q.kind) {
 *       case KVSHARE_REQUEST_REGION: import q.region (kvshare_provider_import_npu), ...
 *                                    kvshare_resident_reply_ok(r, region_ms, 0); break;
 *       case KVSHARE_REQUEST_PREFILL_SHARED: scatter q.tokens[q.n_cached..] into the region
 *                                    held, kvshare_resident_reply_ok(r, prefill_ms, n); break;
 *       default: kvshare_resident_reply_error(r, ENOTSUP, "no file route here");
 *       }
 *   }
 *   kvshare_resident_close(r);
 *
 * One serve at a time. Every request gets exactly one reply (kvshare_resident_reply_ok or
 * _error) before the next kvshare_resident_next. A handle is not thread-safe.
 * ------------------------------------------------------------------------------------ */

/* Routes a provider takes (kvshare_resident_hello's routes_mask). */
#define KVSHARE_ROUTE_SHARED 1 /* prefill into the decoder's region */
#define KVSHARE_ROUTE_FILE 2   /* prefill into a llama.cpp sequence-state file */

/* What kvshare_resident_next hands out. */
enum kvshare_request_kind {
    KVSHARE_REQUEST_REGION = 1,         /* the decoder's region: map it, keep it until the next REGION */
    KVSHARE_REQUEST_PREFILL_SHARED = 2, /* prefill tokens[n_cached..] into the region held */
    KVSHARE_REQUEST_PREFILL_FILE = 3,   /* prefill tokens into a state file */
    KVSHARE_REQUEST_END = 4             /* serve closed the channel (or it failed): no reply */
};

/*
 * One request. Versioned by struct_size ("Versioned structs" above): set it to
 * sizeof(struct kvshare_resident_request) before kvshare_resident_next. Pointers stay
 * valid until the next kvshare_resident_next or kvshare_resident_close on the handle
 * (region: see below).
 */
struct kvshare_resident_request {
    uint32_t struct_size;
    int32_t kind;       /* enum kvshare_request_kind */
    uint64_t region_id; /* REGION, PREFILL_SHARED: serve's number for the region, from 1 */
    /* REGION: the decoder's share, imported writable and checked against the model as
     * kvshare_provider_open checks (a share that fails the check never reaches the engine:
     * kvshare_resident_next answers it with the error itself). Owned by the handle, which
     * closes it at the next REGION, at END and at kvshare_resident_close, unless the engine
     * takes it over with kvshare_resident_take_region. NULL for the other kinds. */
    struct kvshare_provider *region;
    uint64_t share_id;      /* PREFILL_SHARED: the decoder's share the cells are for */
    uint32_t n_cached;      /* PREFILL_SHARED: cells 0..n_cached-1 already hold tokens 0..n_cached-1 */
    uint32_t n_tokens;      /* PREFILL_*: ids in `tokens`, at least 1, more than n_cached */
    const int32_t *tokens;  /* PREFILL_*: the handoff's ids (the prompt less its last token) */
    const char *state_file; /* PREFILL_FILE: the absolute path to write; else NULL */
    uint32_t state_version; /* PREFILL_FILE: the decoder's LLAMA_STATE_SEQ_VERSION, 0 = the provider's latest */
    /* Since KVSHARE_1.4 (before: reserved, 0). PREFILL_SHARED: the KV stream (the
     * decoder's slot) to write; the region's kvshare_provider_stream is set to it, and its
     * cells to the message's range (kvshare_resident_cells). */
    uint32_t stream;
    /* REGION: the header's KV params (the decoder's: what the engine must run with).
     * PREFILL_FILE: serve's n_ctx, type_k, type_v and flash_attn; the rest llama-server's
     * defaults (kvshare_kv_params_init). */
    struct kvshare_kv_params kv;
};
/* KVSHARE_1.3's struct, through `kv` (its KVSHARE_1.0 size): the smallest struct_size accepted. */
#define KVSHARE_RESIDENT_REQUEST_SIZE_VER0 (offsetof(struct kvshare_resident_request, kv) + KVSHARE_KV_PARAMS_SIZE_VER0)

struct kvshare_resident;

/*
 * Since KVSHARE_1.3. Takes `fd`, a connected AF_UNIX stream socket (the --serve-fd serve
 * passed), checks that its peer runs as this uid or root and marks it close-on-exec.
 * With a model_path, reads that GGUF's metadata once: every REGION is refused unless its
 * header describes this model (kvshare_provider_open's check); NULL skips the check.
 * Stores the handle in *out on success; on failure *out is NULL (since KVSHARE_1.5),
 * kvshare_resident_last_error(NULL) says why, and fd is closed too.
 * Errors: -ENOTSOCK (not a stream socket), -EPERM (a peer of another uid), -ENOENT /
 * -EINVAL (the model: missing, or not a GGUF kvshare can shape), -EINVAL (out NULL).
 */
int kvshare_resident_from_fd(int fd, const char *model_path, struct kvshare_resident **out);

/*
 * Since KVSHARE_1.3. Listens on the AF_UNIX socket `socket_path` (--serve PATH) for
 * serve to connect. Its directory must be a private one of this uid (0700, not a
 * symlink) and nothing may exist at socket_path (-EEXIST: another provider's socket, or
 * a stale one to remove by hand); the socket is removed by kvshare_resident_close.
 * model_path as for kvshare_resident_from_fd. Does not wait for serve: the first
 * kvshare_resident_next does. Same *out rule; errors: -EINVAL (not an absolute path),
 * -EEXIST, -EPERM (the directory is not private), the model's.
 */
int kvshare_resident_listen(const char *socket_path, const char *model_path, struct kvshare_resident **out);

/* Since KVSHARE_1.3. Closes the channel (serve sees it end), any region the handle still
 * owns, the listening socket (removing it) and the handle. NULL is a no-op. */
void kvshare_resident_close(struct kvshare_resident *resident);

/* Since KVSHARE_1.3. The message of the last failed call on this handle, "" when none
 * failed. Valid until the next call on the handle. NULL: the calling thread's latest
 * failed open. */
const char *kvshare_resident_last_error(const struct kvshare_resident *resident);

/*
 * Since KVSHARE_1.3. What this provider offers: routes_mask is KVSHARE_ROUTE_SHARED,
 * KVSHARE_ROUTE_FILE or both; takes_cached non-zero when it honours n_cached > 0 (else
 * serve never sends one). Must be called once before the first kvshare_resident_next. A
 * handle from kvshare_resident_from_fd sends it at once (serve waits for it); a
 * listener keeps it and sends it to every serve it accepts. Blocks at most 60 s for the
 * send. Errors: -EINVAL (no route, an unknown bit, called twice), the send's errno
 * (-EPIPE: serve left).
 */
int kvshare_resident_hello(struct kvshare_resident *resident, int routes_mask, int takes_cached);

/*
 * Since KVSHARE_1.3. Waits for serve's next request and fills *out (its struct_size set
 * first). timeout_ms < 0 waits as long as it takes; else each wait (for serve to connect,
 * for a request) is bounded by it and -ETIMEDOUT leaves the handle as it was.
 *
 * Answered here, never handed out (each as serve expects, then the wait goes on):
 *   - a PREFILL_SHARED naming a region_id other than the one this handle holds (the last
 *     REGION the engine answered ok; none before the first, after an error reply to a
 *     REGION and after END): ESTALE, so serve sends the region again;
 *   - a REGION whose share does not describe the model, or whose fds do not import;
 *   - a PREFILL_FILE whose type_k or type_v is not a cache type llama-server accepts.
 *   - a PREFILL_SHARED or PREFILL_FILE on a route the hello did not offer, or with
 *     n_cached > 0 when the hello said takes_cached 0: ENOTSUP.
 *
 * KVSHARE_REQUEST_END: serve closed the channel between requests, or the channel failed
 * (then the call returned that error once, and END follows). The region the handle owned
 * is closed and no region is held any more; END needs no reply. After END, a handle from
 * kvshare_resident_from_fd answers every kvshare_resident_next with END again (the
 * engine's cue to exit); a listener's next kvshare_resident_next waits for the next
 * serve to connect and says the hello again.
 *
 * Errors: -EBUSY (the previous request is not answered yet), -EINVAL (no hello yet, out
 * NULL, a struct_size below KVSHARE_RESIDENT_REQUEST_SIZE_VER0), -E2BIG (a larger struct
 * with a non-zero byte past this library's; both refused before any request is taken),
 * -ETIMEDOUT, and for a channel that broke (the handle then reports END): -EPROTO (a frame
 * that breaks the protocol), -EINVAL (a message that does not parse), -EPIPE /
 * -ECONNRESET, each naming serve's pid.
 */
int kvshare_resident_next(struct kvshare_resident *resident, int timeout_ms, struct kvshare_resident_request *out);

/*
 * Since KVSHARE_1.4. The range of the PREFILL_SHARED request handed out and not yet
 * answered: *first_cell and *n_cells as serve's message named them (0, 0: no range, the
 * whole stream; either pointer may be NULL). The region held already has them set
 * (kvshare_provider_set_cells), so an engine that scatters through it needs no change;
 * an engine that took the region sets them itself. 0, or -EINVAL for a NULL handle.
 * (kvshare_resident_request has no room for them: its layout is that of KVSHARE_1.3.)
 */
int kvshare_resident_cells(const struct kvshare_resident *resident, uint32_t *first_cell, uint32_t *n_cells);

/*
 * Since KVSHARE_1.3. The REGION request's provider, now the caller's to close with
 * kvshare_provider_close (the handle forgets it; the region_id stays held). NULL when the
 * latest request was not a REGION or the region was taken already.
 */
struct kvshare_provider *kvshare_resident_take_region(struct kvshare_resident *resident);

/*
 * Since KVSHARE_1.3. Answers the pending request with success: ms is region_ms for a
 * REGION (mapping and importing it), prefill_ms for a PREFILL_* (the forward pass and
 * the writes); n_prefilled is the ids computed and written (n_tokens - n_cached; ignored
 * for a REGION). A REGION answered ok becomes the region held. Blocks at most 60 s.
 * Errors: -EINVAL (no request pending), the send's errno (the channel is then over: the
 * next kvshare_resident_next reports END).
 */
int kvshare_resident_reply_ok(struct kvshare_resident *resident, double ms, uint32_t n_prefilled);

/*
 * Since KVSHARE_1.3. Answers the pending request with a failure: errnum (a positive errno
 * value, 1..4095) and a sentence naming what failed (NULL: strerror's). For a REGION, the
 * handle then holds no region (and closes it unless it was taken). The provider keeps
 * serving. Errors as kvshare_resident_reply_ok, and -EINVAL for an errnum out of range.
 */
int kvshare_resident_reply_error(struct kvshare_resident *resident, int errnum, const char *message);

#ifdef __cplusplus
}
#endif

#endif /* KVSHARE_H */
