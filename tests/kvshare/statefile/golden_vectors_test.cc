// Golden vectors: files written by a real llama.cpp (libllama at d32676d, the
// tiny qwen3 model kvshare-mkmodel makes by default, prompt "Hi there!", 5 tokens; recipe in
// docs/state-file.md). Our decoder reads them field by field and re-encodes them byte for
// byte, and our writer, fed the f32 vector's rows, reproduces llama.cpp's conversions.
#include <gtest/gtest.h>

#include <cstring>

#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/state_format.h"
#include "layout/state_test_shapes.h"
#include "support/test_support.h"

namespace kvshare::statefile {
namespace {

using layout::GgmlType;
using layout::StateSection;
using layout::TensorKind;

const std::vector<int32_t> kTokens{39, 72, 106, 105, 0};

template <class T>
T at(const std::vector<std::byte>& file, uint64_t offset) {
  T value;
  std::memcpy(&value, file.data() + offset, sizeof value);
  return value;
}

struct Vector {
  const char* file;
  GgmlType type;
  bool v_trans;
  uint64_t size;
};

const Vector kVectors[] = {
    {"state-dense-f16.bin", GgmlType::F16, false, 5276},   {"state-dense-f16-vtrans.bin", GgmlType::F16, true, 5276},
    {"state-dense-bf16.bin", GgmlType::BF16, false, 5276}, {"state-dense-f32.bin", GgmlType::F32, false, 10396},
    {"state-dense-q8_0.bin", GgmlType::Q8_0, false, 2876},
};

TEST(StateGoldenVectors, DecodeFieldByField) {
  for (const Vector& v : kVectors) {
    SCOPED_TRACE(v.file);
    const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path(v.file));
    ASSERT_EQ(bytes.size(), v.size);
    EXPECT_EQ(at<uint32_t>(bytes, 0), 0x67677371u);  // magic
    EXPECT_EQ(at<uint32_t>(bytes, 4), 2u);           // version
    EXPECT_EQ(at<uint32_t>(bytes, 8), 5u);           // n_token
    for (size_t i = 0; i < kTokens.size(); ++i) EXPECT_EQ(at<int32_t>(bytes, 12 + 4 * i), kTokens[i]);
    EXPECT_EQ(at<uint32_t>(bytes, 32), 1u);  // n_stream
    EXPECT_EQ(at<uint32_t>(bytes, 36), 5u);  // cell_count
    for (int32_t c = 0; c < 5; ++c) {
      EXPECT_EQ(at<int32_t>(bytes, 40 + 12 * c), c);    // pos
      EXPECT_EQ(at<uint32_t>(bytes, 44 + 12 * c), 1u);  // n_seq_id
      EXPECT_EQ(at<int32_t>(bytes, 48 + 12 * c), 0);    // seq id
    }
    EXPECT_EQ(at<uint32_t>(bytes, 100), v.v_trans ? 1u : 0u);
    EXPECT_EQ(at<uint32_t>(bytes, 104), 2u);  // n_layer
    EXPECT_EQ(at<int32_t>(bytes, 108), static_cast<int32_t>(v.type));
    EXPECT_EQ(at<uint64_t>(bytes, 112), layout::ggml_row_size(v.type, 128));

    const auto shape = testing::dense_shape(v.type, v.type, v.v_trans);
    auto file = parse_state_bytes(bytes, &shape, v.file);
    ASSERT_TRUE(file) << file.error().what();
    EXPECT_EQ(file->tokens(), kTokens);
    EXPECT_EQ(file->layout().trailing_bytes, 0u);
    const StateSection* v1 = file->find_section(TensorKind::v, 1);
    ASSERT_NE(v1, nullptr);
    EXPECT_EQ(v1->is_transposed, v.v_trans);
    EXPECT_EQ(v1->end_offset(), v.size);
    if (v.v_trans) {
      const uint64_t v0 = file->find_section(TensorKind::v, 0)->header_offset;
      EXPECT_EQ(at<uint32_t>(bytes, v0 + 4), 2u);    // element size
      EXPECT_EQ(at<uint32_t>(bytes, v0 + 8), 128u);  // n_embd_v_gqa
    }
  }
}

TEST(StateGoldenVectors, ReencodeByteForByteFromTheDecodedLayout) {
  for (const Vector& v : kVectors) {
    SCOPED_TRACE(v.file);
    const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path(v.file));
    for (bool with_shape : {true, false}) {
      const auto shape = testing::dense_shape(v.type, v.type, v.v_trans);
      auto layout = layout::decode_state_layout(bytes, with_shape ? &shape : nullptr, v.file);
      ASSERT_TRUE(layout) << layout.error().what();
      auto again = layout::encode_state_file(*layout, kTokens, [&](const StateSection& s) {
        return std::span<const std::byte>(bytes).subspan(s.data_offset, s.data_bytes());
      });
      EXPECT_EQ(again, bytes);
      // And planning from the shape alone gives the same geometry.
      auto planned = layout::plan_state_layout(shape, 5, 5, layout::kStateSeqVersion2);
      ASSERT_TRUE(planned);
      EXPECT_EQ(planned->content_bytes, bytes.size());
    }
  }
}

class StateGoldenWriter : public kvshare::testing::FdLeakCheck {
 protected:
  // An f32 vector's rows for (kind, il), as an f32 provider would hand them. A vector that
  // does not read as the f32 shape is an error, not a crash of the test binary.
  Result<std::vector<float>> f32_rows(TensorKind kind, uint32_t il, const char* f32_file) {
    const auto shape = testing::dense_shape(GgmlType::F32, GgmlType::F32, false);
    auto file = read_state_file(kvshare::testing::data_path(f32_file), &shape);
    if (!file) return fail(file.error());
    return file->rows_f32(*file->find_section(kind, il));
  }

  // Writes a file of `type` from an f32 vector's rows (d32676d's unless named) and reads it back.
  Result<StateFile> write_from_f32(GgmlType type, bool v_trans, const char* f32_file = "state-dense-f32.bin") {
    const auto path = dir_ / "ours.bin";
    StateFileWriterOptions options;
    options.n_embd_head_k = options.n_embd_head_v = 64;
    options.state_version = layout::kStateSeqVersion2;  // the vectors' generation (d32676d)
    auto writer = StateFileWriter::create(path, testing::dense_shape(type, type, v_trans), kTokens, 5, options);
    if (!writer) return fail(writer.error());
    for (uint32_t il = 0; il < 2; ++il) {
      const auto k = f32_rows(TensorKind::k, il, f32_file);
      if (!k) return fail(k.error());
      const auto v = f32_rows(TensorKind::v, il, f32_file);
      if (!v) return fail(v.error());
      if (auto rc = writer->write_layer(il, RowsView{GgmlType::F32, k->data(), 5, 0},
                                        RowsView{GgmlType::F32, v->data(), 5, 0});
          !rc)
        return fail(rc.error());
    }
    if (auto info = writer->commit(); !info) return fail(info.error());
    return read_state_file(path, nullptr);
  }

  kvshare::testing::TempDir dir_;
};

// llama.cpp's f16 file is its f32 cache's values rounded to f16: our writer must agree on
// every byte of the whole file.
TEST_F(StateGoldenWriter, ReproducesLlamaCppsF16FileFromItsF32Rows) {
  auto ours = write_from_f32(GgmlType::F16, false);
  ASSERT_TRUE(ours) << ours.error().what();
  const auto theirs = kvshare::testing::read_file_bytes(kvshare::testing::data_path("state-dense-f16.bin"));
  EXPECT_EQ(std::vector<std::byte>(ours->bytes().begin(), ours->bytes().end()), theirs);
}

// Layer 0's K and V depend only on the prompt, whatever the cache type; later layers see
// attention over the already quantized cache, so only layer 0 can match byte for byte.
// q8_0 includes llama.cpp's Hadamard rotation (head size 64).
TEST_F(StateGoldenWriter, QuantizesLayerZeroExactlyAsLlamaCppForQ8_0AndBf16) {
  for (auto [type, name] :
       {std::pair{GgmlType::Q8_0, "state-dense-q8_0.bin"}, std::pair{GgmlType::BF16, "state-dense-bf16.bin"}}) {
    SCOPED_TRACE(name);
    auto ours = write_from_f32(type, false);
    ASSERT_TRUE(ours) << ours.error().what();
    auto theirs = read_state_file(kvshare::testing::data_path(name), nullptr);
    ASSERT_TRUE(theirs) << theirs.error().what();
    for (TensorKind kind : {TensorKind::k, TensorKind::v}) {
      const auto a = ours->section_bytes(*ours->find_section(kind, 0));
      const auto b = theirs->section_bytes(*theirs->find_section(kind, 0));
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0) << "layer 0 " << layout::tensor_kind_name(kind);
    }
  }
}

// With -fa off llama.cpp writes V element-major; layer 0's V is the same values as with -fa
// on, so our transposed output must equal its bytes.
TEST_F(StateGoldenWriter, TransposesVExactlyAsLlamaCppWithFlashAttentionOff) {
  auto ours = write_from_f32(GgmlType::F16, true);
  ASSERT_TRUE(ours) << ours.error().what();
  auto theirs = read_state_file(kvshare::testing::data_path("state-dense-f16-vtrans.bin"), nullptr);
  ASSERT_TRUE(theirs) << theirs.error().what();
  for (TensorKind kind : {TensorKind::k, TensorKind::v}) {
    const auto* a = ours->find_section(kind, 0);
    const auto* b = theirs->find_section(kind, 0);
    ASSERT_EQ(a->header_offset, b->header_offset);
    const auto ab = ours->section_bytes(*a), bb = theirs->section_bytes(*b);
    EXPECT_EQ(std::memcmp(ab.data(), bb.data(), ab.size()), 0) << layout::tensor_kind_name(kind);
  }
  EXPECT_EQ(ours->bytes().size(), theirs->bytes().size());
}

// ---- version 3: saved by the pinned llama-server (80fb11ac) ----------------------------
// tests/data/make_state_v3_vectors.py: the same model and prompt as above, evaluated by a
// /completion with n_predict 0 and saved with POST /slots/0?action=save. The server packs
// the prompt into the token words (server_tokens::serialize): -1, 1, 5, the ids, 0 media.

const std::vector<int32_t> kPackedWords{-1, 1, 5, 39, 72, 106, 105, 0, 0};

const Vector kVectorsV3[] = {
    {"state-v3-dense-f16.bin", GgmlType::F16, false, 5276 + 16},
    {"state-v3-dense-f16-vtrans.bin", GgmlType::F16, true, 5276 + 16},
    {"state-v3-dense-q8_0.bin", GgmlType::Q8_0, false, 2876 + 16},
    // Saved by the pin de3ff815 (same state version): 124 bytes of header, token words and
    // cells, then 4 sections of a 12-byte header and 5 rows of 128 elements (4 blocks).
    {"state-v3-dense-f32.bin", GgmlType::F32, false, 124 + 4 * (12 + 5 * 128 * 4)},
    {"state-v3-dense-q4_0.bin", GgmlType::Q4_0, false, 124 + 4 * (12 + 5 * 4 * 18)},
    {"state-v3-dense-q4_1.bin", GgmlType::Q4_1, false, 124 + 4 * (12 + 5 * 4 * 20)},
    {"state-v3-dense-q5_0.bin", GgmlType::Q5_0, false, 124 + 4 * (12 + 5 * 4 * 22)},
    {"state-v3-dense-q5_1.bin", GgmlType::Q5_1, false, 124 + 4 * (12 + 5 * 4 * 24)},
    {"state-v3-dense-iq4_nl.bin", GgmlType::IQ4_NL, false, 124 + 4 * (12 + 5 * 4 * 18)},
};

TEST(StateGoldenVectorsV3, DecodeFieldByFieldWithThePackedPrompt) {
  for (const Vector& v : kVectorsV3) {
    SCOPED_TRACE(v.file);
    const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path(v.file));
    ASSERT_EQ(bytes.size(), v.size);
    EXPECT_EQ(at<uint32_t>(bytes, 0), 0x67677371u);  // magic
    EXPECT_EQ(at<uint32_t>(bytes, 4), 3u);           // version
    EXPECT_EQ(at<uint32_t>(bytes, 8), 9u);           // n_token: 9 words for 5 ids
    for (size_t i = 0; i < kPackedWords.size(); ++i) EXPECT_EQ(at<int32_t>(bytes, 12 + 4 * i), kPackedWords[i]);
    EXPECT_EQ(at<uint32_t>(bytes, 48), 1u);  // n_stream
    EXPECT_EQ(at<uint32_t>(bytes, 52), 5u);  // cell_count
    for (int32_t c = 0; c < 5; ++c) {
      EXPECT_EQ(at<int32_t>(bytes, 56 + 12 * c), c);    // pos
      EXPECT_EQ(at<uint32_t>(bytes, 60 + 12 * c), 1u);  // n_seq_id (no cell ext: not M-RoPE)
    }
    EXPECT_EQ(at<uint32_t>(bytes, 116), v.v_trans ? 1u : 0u);
    EXPECT_EQ(at<uint32_t>(bytes, 120), 2u);  // n_layer
    // Each K section (and V's without v_trans): i32 type, u64 row size, 5 rows.
    const uint64_t row_bytes = layout::ggml_row_size(v.type, 128);
    for (uint64_t il = 0, offset = 124; il < (v.v_trans ? 2u : 4u); ++il, offset += 12 + 5 * row_bytes) {
      EXPECT_EQ(at<int32_t>(bytes, offset), static_cast<int32_t>(v.type)) << "section " << il;
      EXPECT_EQ(at<uint64_t>(bytes, offset + 4), row_bytes) << "section " << il;
    }

    const auto shape = testing::dense_shape(v.type, v.type, v.v_trans);
    auto file = parse_state_bytes(bytes, &shape, v.file);
    ASSERT_TRUE(file) << file.error().what();
    EXPECT_EQ(file->layout().version, 3u);
    EXPECT_EQ(file->layout().token_form, layout::StateTokenForm::server_packed);
    EXPECT_EQ(file->tokens(), kTokens);
    EXPECT_EQ(file->layout().trailing_bytes, 0u);
    // Re-encoding the decoded layout with the same words gives the file byte for byte.
    auto again = layout::encode_state_file(file->layout(), kPackedWords, [&](const StateSection& s) {
      return std::span<const std::byte>(bytes).subspan(s.data_offset, s.data_bytes());
    });
    EXPECT_EQ(again, bytes);
  }
}

// Both generations computed the same model and prompt, and their kernels agree to the bit
// on it: after the token words, every byte of each version 3 save (cells, headers, K/V rows)
// equals the version 2 file libllama d32676d wrote. The framing is all that changed.
TEST(StateGoldenVectorsV3, HoldTheVersion2VectorsBytesAfterTheTokenWords) {
  for (auto [v3_name, v2_name] : {std::pair{"state-v3-dense-f16.bin", "state-dense-f16.bin"},
                                  std::pair{"state-v3-dense-f16-vtrans.bin", "state-dense-f16-vtrans.bin"},
                                  std::pair{"state-v3-dense-q8_0.bin", "state-dense-q8_0.bin"}}) {
    SCOPED_TRACE(v3_name);
    const auto v3 = kvshare::testing::read_file_bytes(kvshare::testing::data_path(v3_name));
    const auto v2 = kvshare::testing::read_file_bytes(kvshare::testing::data_path(v2_name));
    ASSERT_EQ(v3.size(), v2.size() + 16);
    EXPECT_TRUE(std::equal(v2.begin() + 32, v2.end(), v3.begin() + 48));
  }
}

// What our writer makes for version 3 differs from llama-server's save in the token words
// only (plain ids, which its restore reads as well): the rest of the file is the same bytes.
TEST_F(StateGoldenWriter, WritesVersion3AsLlamaServerSavesItButForThePlainIds) {
  auto theirs = read_state_file(kvshare::testing::data_path("state-v3-dense-f16.bin"), nullptr);
  ASSERT_TRUE(theirs) << theirs.error().what();
  StateFileWriterOptions options;
  options.state_version = layout::kStateSeqVersion3;
  const auto path = dir_ / "ours-v3.bin";
  auto writer = StateFileWriter::create(path, testing::dense_shape(), kTokens, 5, options);
  ASSERT_TRUE(writer) << writer.error().what();
  for (uint32_t il = 0; il < 2; ++il) {
    const auto k = theirs->rows(*theirs->find_section(TensorKind::k, il));
    const auto v = theirs->rows(*theirs->find_section(TensorKind::v, il));
    ASSERT_TRUE(
        writer->write_layer(il, RowsView{GgmlType::F16, k.data(), 5, 0}, RowsView{GgmlType::F16, v.data(), 5, 0}));
  }
  ASSERT_TRUE(writer->commit());
  const auto ours = kvshare::testing::read_file_bytes(path);
  const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path("state-v3-dense-f16.bin"));
  ASSERT_EQ(ours.size() + 16, bytes.size());
  EXPECT_EQ(at<uint32_t>(ours, 4), 3u);
  EXPECT_EQ(at<uint32_t>(ours, 8), 5u);
  EXPECT_TRUE(std::equal(ours.begin() + 32, ours.end(), bytes.begin() + 48));
}

// The other cache types llama-server accepts for -ctk/-ctv, saved by the pin de3ff815:
// llama.cpp's CPU backend quantizes them with quantize_row_*_ref after the same rotation as
// q8_0 (every quantized type; group 64 for head size 64). Fed that server's own f32 rows,
// our writer must give layer 0's bytes exactly.
TEST_F(StateGoldenWriter, QuantizesLayerZeroExactlyAsLlamaServerForQ4Q5AndIq4Nl) {
  for (auto [type, name] :
       {std::pair{GgmlType::Q4_0, "state-v3-dense-q4_0.bin"}, std::pair{GgmlType::Q4_1, "state-v3-dense-q4_1.bin"},
        std::pair{GgmlType::Q5_0, "state-v3-dense-q5_0.bin"}, std::pair{GgmlType::Q5_1, "state-v3-dense-q5_1.bin"},
        std::pair{GgmlType::IQ4_NL, "state-v3-dense-iq4_nl.bin"}}) {
    SCOPED_TRACE(name);
    auto ours = write_from_f32(type, false, "state-v3-dense-f32.bin");
    ASSERT_TRUE(ours) << ours.error().what();
    auto theirs = read_state_file(kvshare::testing::data_path(name), nullptr);
    ASSERT_TRUE(theirs) << theirs.error().what();
    for (TensorKind kind : {TensorKind::k, TensorKind::v}) {
      const StateSection* theirs_section = theirs->find_section(kind, 0);
      ASSERT_NE(theirs_section, nullptr);
      EXPECT_EQ(theirs_section->type, type);
      const auto a = ours->section_bytes(*ours->find_section(kind, 0));
      const auto b = theirs->section_bytes(*theirs_section);
      ASSERT_EQ(b.size(), 5 * layout::ggml_row_size(type, 128));
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0) << "layer 0 " << layout::tensor_kind_name(kind);
    }
  }
}

// ---- a hybrid (LFM2-shaped) file, constructed byte by byte -------------------------------
// tests/data/make_state_lfm2_vector.py builds it from docs/state-file.md ("Worked example: an
// LFM2 file") with nothing of ours: KV block of attention layers 1 and 3, then a recurrent
// block with n_layer 4, R sections for conv layers 0 and 2, and two S headers of row size 0.

// Our writer, handed the vector's rows per layer (the S state as an empty view: LFM2 has
// none), writes the same file: it writes R/S sections for the recurrent layers only, not for
// every one of the n_layer trunk layers, which llama.cpp would refuse.
TEST_F(StateGoldenWriter, WritesTheLfm2ExampleFromItsRowsWithAnEmptySState) {
  const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path("state-v3-lfm2-hybrid.bin"));
  const auto shape = testing::lfm2_shape();
  auto theirs = parse_state_bytes(bytes, &shape, "state-v3-lfm2-hybrid.bin");
  ASSERT_TRUE(theirs) << theirs.error().what();
  const std::vector<int32_t> ids{1, 2, 3, 4, 5};
  StateFileWriterOptions options;
  options.state_version = layout::kStateSeqVersion3;
  const auto path = dir_ / "ours-lfm2.bin";
  auto writer = StateFileWriter::create(path, shape, ids, 5, options);
  ASSERT_TRUE(writer) << writer.error().what();
  for (uint32_t il : {0u, 1u, 2u, 3u}) {
    if (il % 2 == 1) {
      const auto k = theirs->rows(*theirs->find_section(TensorKind::k, il));
      const auto v = theirs->rows(*theirs->find_section(TensorKind::v, il));
      ASSERT_TRUE(
          writer->write_layer(il, RowsView{GgmlType::F16, k.data(), 5, 0}, RowsView{GgmlType::F16, v.data(), 5, 0}));
    } else {
      const auto r = theirs->rows(*theirs->find_section(TensorKind::r, il));
      auto rc = writer->write_recurrent_layer(il, RowsView{GgmlType::F32, r.data(), 1, 0}, RowsView{});
      ASSERT_TRUE(rc) << rc.error().what();
    }
  }
  auto info = writer->commit();
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_EQ(kvshare::testing::read_file_bytes(path), bytes);
}

}  // namespace
}  // namespace kvshare::statefile
