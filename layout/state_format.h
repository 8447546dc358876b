// The bytes of a llama.cpp sequence-state file (llama_state_seq_save_file, versions 2 and
// 3): geometry planned from a MemoryShape, the metadata bytes a writer emits, and a
// validating decoder. Pure: works on spans, never on descriptors. Mirrors llama_context::
// state_seq_save_file / state_seq_load_file and the state_write* / state_read* functions of
// llama_kv_cache, llama_kv_cache_iswa, llama_memory_recurrent and llama_memory_hybrid
// (version 2: llama.cpp d32676d; version 3: llama.cpp 80fb11ac and de3ff815, the trees
// node-llama-cpp 3.21.1 and 3.22.1 ship), and the token words llama-server's slot save packs
// (server_tokens::serialize). docs/state-file.md has the byte table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/memory_shape.h"
#include "layout/tensor_type.h"

namespace kvshare::layout {

inline constexpr uint32_t kStateSeqMagic = 0x67677371u;  // "ggsq", LLAMA_STATE_SEQ_MAGIC
// LLAMA_STATE_SEQ_VERSION of the two generations we read and write. Version 3 widened the
// cell extension (llama_kv_cell_ext) by the cell's token id; a decoder reads only its own.
inline constexpr uint32_t kStateSeqVersion2 = 2;
inline constexpr uint32_t kStateSeqVersion3 = 3;
inline constexpr uint32_t kStateSeqVersionLatest = kStateSeqVersion3;
inline bool is_known_state_version(uint32_t version) {
  return version == kStateSeqVersion2 || version == kStateSeqVersion3;
}
// Fails (EINVAL) naming `what` unless `version` is 2 or 3.
Result<void> check_state_version(uint32_t version, std::string_view what);
inline constexpr uint64_t kStateHeaderBytes = 12;         // magic, version, n_token
inline constexpr uint64_t kStateSectionHeaderBytes = 12;  // type + u64 row size, or type + el size + n_embd

enum class StateBlockKind : uint8_t { kv, recurrent };

// One cell record. KV cells of a sequence file have n_seq_id 1 and one seq id (ignored by
// llama.cpp on restore); recurrent cells have n_seq_id 0 and no seq id.
struct StateCell {
  int32_t pos = 0;
  uint32_t n_seq_id = 1;
  int32_t ext_x = 0;  // M-RoPE cells only (llama_kv_cell_ext): text tokens carry x = y = pos
  int32_t ext_y = 0;
  int32_t ext_tok = -1;  // version 3 only: the cell's token id (LLAMA_TOKEN_NULL = -1 for none)
  int32_t seq_id = 0;    // meaningful when n_seq_id == 1
  friend bool operator==(const StateCell&, const StateCell&) = default;
};

// One per-layer run of rows: K or V of a KV block, R or S of a recurrent block.
struct StateSection {
  TensorKind kind = TensorKind::k;
  uint32_t il = 0;  // model layer (from the shape); inspect mode: the ordinal,
                    // counted on across KV blocks (SWA layers follow base layers),
                    // and among the recurrent layers for R/S (not in the file)
  GgmlType type = GgmlType::F16;
  uint32_t n_embd = 0;         // elements per cell (n_embd_k_gqa, n_embd_v_gqa, n_embd_r, n_embd_s)
  bool is_transposed = false;  // V with v_trans: header is type, u32 element size, u32 n_embd;
                               // data element-major (element j of every cell, then j+1)
  uint64_t row_bytes = 0;      // bytes one cell takes in this section
  uint32_t n_rows = 0;         // cells
  uint64_t header_offset = 0;  // file offset of the 12-byte section header
  uint64_t data_offset = 0;    // header_offset + 12

  uint64_t data_bytes() const { return row_bytes * n_rows; }
  uint64_t end_offset() const { return data_offset + data_bytes(); }
};

// One stream of a KV block (or the single cell list of a recurrent block).
struct StateStream {
  uint32_t index = 0;
  uint64_t offset = 0;  // of the u32 cell_count
  uint32_t cell_count = 0;
  uint64_t cells_offset = 0;
  uint32_t cell_record_bytes = 0;  // 12; with M-RoPE 20 (version 2) or 24 (version 3); 8 recurrent
  std::vector<StateCell> cells;
  // The data header (v_trans or s_trans, n_layer) and the sections. A KV stream with no
  // cells has neither; a recurrent block always has both (llama.cpp writes them anyway).
  bool has_data = false;
  uint64_t data_header_offset = 0;
  bool is_transposed = false;          // v_trans (s_trans is always 0)
  uint32_t n_layer = 0;                // as written: owned layers (KV) or hparams.n_layer() (recurrent)
  std::vector<StateSection> sections;  // KV: K of every layer, then V; recurrent: R, then S
};

struct StateBlock {
  StateBlockKind kind = StateBlockKind::kv;
  std::string role;  // "kv", "base", "swa" or "recurrent"
  uint64_t offset = 0;
  uint64_t end_offset = 0;
  uint32_t n_stream = 1;  // KV: the u32 at `offset`; recurrent: 1 (not written)
  std::vector<StateStream> streams;

  // The stream holding the sequence's cells (a sequence file has at most one), or nullptr.
  const StateStream* filled_stream() const;
};

// How the file's token words hold the prompt. llama.cpp itself writes plain ids; the
// llama-server of state version 3 saves a slot as server_tokens::serialize packs it: the
// words are -1 (LLAMA_TOKEN_NULL, never an id), the packing version 1, the id count and
// ids, a media-key count, the media keys and media chunks, zero-padded to whole words. Its
// restore reads both forms.
enum class StateTokenForm : uint8_t { ids, server_packed };

inline constexpr uint32_t kServerTokensStateVersion = 1;  // SERVER_TOKENS_STATE_VERSION

struct StateLayout {
  uint32_t version = kStateSeqVersionLatest;
  uint32_t n_token = 0;  // token words in the file (the header's n_token)
  uint64_t tokens_offset = kStateHeaderBytes;
  StateTokenForm token_form = StateTokenForm::ids;
  uint32_t n_prompt_ids = 0;  // the prompt's ids: n_token, or the packed id count
  uint64_t prompt_ids_offset = kStateHeaderBytes;
  uint32_t n_media = 0;  // packed form: media chunks (images, audio) after the ids
  MemoryKind memory_kind = MemoryKind::kv;
  bool has_mrope_cells = false;    // KV cell records carry llama_kv_cell_ext
  std::vector<StateBlock> blocks;  // file order
  uint64_t content_bytes = 0;      // end of the last block: what llama.cpp writes
  uint64_t trailing_bytes = 0;     // decoded files only: bytes after content (llama.cpp ignores them)
};

// The bytes one KV cell record takes: 12, plus llama_kv_cell_ext with M-RoPE (8 bytes in
// version 2, 12 in version 3).
uint32_t kv_cell_record_bytes(uint32_t version, bool has_mrope_cells);

// The layout llama.cpp of state `version` writes for sequence 0 holding `n_cells` cells at
// positions 0..n_cells-1 (one per prompt token, in order) and `n_token` plain token ids,
// for `shape`.
// SWA caches keep only the cells their window does not mask relative to position
// n_cells-1 (llama_hparams::is_masked_swa); a recurrent block holds one cell at
// position n_cells-1. Fails when n_cells exceeds a cache's kv_size, when a row width is
// not a multiple of the type's block size, or on a shape with no memory block for its kind.
Result<StateLayout> plan_state_layout(const MemoryShape& shape, uint32_t n_token, uint32_t n_cells,
                                      uint32_t version = kStateSeqVersionLatest);

// Changes a planned or decoded layout to state `version` (2 or 3): the header word, the
// M-RoPE cell records, every offset. A packed token form becomes plain ids (version 2
// decoders know only those): the caller writes `n_prompt_ids` ids. Fails when media
// chunks would be lost. Cells' ext_tok stays as it is (set_cell_tokens fills it).
Result<void> set_state_version(StateLayout& layout, uint32_t version);

// Version 3 M-RoPE cells carry their token id: sets each KV cell's ext_tok to ids[pos]
// (-1 past the end), as llama.cpp's apply_ubatch records it.
void set_cell_tokens(StateLayout& layout, std::span<const int32_t> ids);

// Recomputes every offset of `layout` (blocks, streams, cells, sections, content_bytes)
// from its counts, record sizes and row_bytes, as llama.cpp lays them out back to back. For
// callers that change section types or row sizes of a planned or decoded layout.
void assign_state_offsets(StateLayout& layout);

// A run of non-row bytes of a state file (header, tokens, counts, cells, section headers).
struct StatePiece {
  uint64_t offset = 0;
  std::vector<std::byte> bytes;
};

// Every byte of the file that is not row data, as pieces in ascending offset order; the
// gaps between pieces are exactly the sections' data. No piece spans a section header's
// start, so a writer that splits the file at section headers never splits a piece.
// Precondition: tokens.size() == layout.n_token.
std::vector<StatePiece> encode_state_metadata(const StateLayout& layout, std::span<const int32_t> tokens);

// The whole file as llama.cpp would write it, rows taken from `rows(section)` (which must
// return section.data_bytes() bytes, already in file order). For tests and small files; the
// streaming writer in kvshare/statefile never holds the whole file.
std::vector<std::byte> encode_state_file(const StateLayout& layout, std::span<const int32_t> tokens,
                                         const std::function<std::span<const std::byte>(const StateSection&)>& rows);

// Decodes and validates a whole file (version 2 or 3, either token form). With `expect`, the
// file must match that memory shape
// exactly as llama_state_seq_load_file would require (n_stream, n_layer, v_trans, types, row
// sizes, element sizes, cell counts within kv_size, n_seq_id rules); without it (inspect
// mode) the structure is derived from the bytes: the memory kind and the M-RoPE cell size
// are the reading that accounts for the file, and a recurrent block's R/S sections are read
// to the end of the file (or 2 x n_layer of them) and split in half, since how many layers
// are recurrent is not in the file (docs/state-file.md, "Bad input"). Trailing bytes after
// the content are accepted, as llama.cpp ignores them, and reported in trailing_bytes. Every
// error names `name`, the field and its byte offset. Allocates only in proportion to the
// file size.
Result<StateLayout> decode_state_layout(std::span<const std::byte> file, const MemoryShape* expect,
                                        std::string_view name);

// The prompt's token ids of a decoded file (n_prompt_ids of them, from prompt_ids_offset):
// the ids themselves in either token form; a media position holds -1.
std::vector<int32_t> decode_state_tokens(std::span<const std::byte> file, const StateLayout& layout);

// Reads just the version word of a file's first 8 bytes, for a caller that must know which
// decoder generation wrote it before reading the rest. EINVAL naming `name` for a short
// file, a wrong magic or an unknown version.
Result<uint32_t> peek_state_version(std::span<const std::byte> head, std::string_view name);

// A memory shape consistent with a decoded file, for tools that rewrite or compare files
// without the model: kv_size is the cell count, layer indices are the sections' il, the
// memory kind and M-RoPE flag come from the file. Not what the decoder's context has.
MemoryShape memory_shape_from_layout(const StateLayout& layout);

// "kv_iswa: base 19 cells x 1 layers (f16/f16, v_trans 0), swa 8 cells ..." for humans.
std::string describe_state_layout(const StateLayout& layout);

}  // namespace kvshare::layout
