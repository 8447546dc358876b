#include "layout/state_format.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "layout/model_shape.h"
#include "layout/shape_fixtures.h"
#include "layout/state_test_shapes.h"
#include "support/test_support.h"

namespace kvshare::layout {
namespace {

using kvshare::testing::dense_shape;
using kvshare::testing::hybrid_shape;
using kvshare::testing::iswa_shape;
using kvshare::testing::lfm2_shape;
using kvshare::testing::mamba2_shape;
using kvshare::testing::mamba_shape;

std::vector<int32_t> token_ids(uint32_t n) {
  std::vector<int32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(i + 1);
  return ids;
}

// Rows whose bytes say where they are: byte i of a section is (il * 31 + kind * 7 + i) & 0xff.
std::vector<std::byte> pattern_file(const StateLayout& layout, std::span<const int32_t> tokens) {
  std::map<const StateSection*, std::vector<std::byte>> storage;
  return encode_state_file(layout, tokens, [&](const StateSection& section) {
    auto& rows = storage[&section];
    rows.resize(section.data_bytes());
    for (size_t i = 0; i < rows.size(); ++i)
      rows[i] = std::byte((section.il * 31 + static_cast<int>(section.kind) * 7 + i) & 0xff);
    return std::span<const std::byte>(rows);
  });
}

template <class T>
T read_at(const std::vector<std::byte>& file, uint64_t offset) {
  T value;
  std::memcpy(&value, file.data() + offset, sizeof value);
  return value;
}

template <class T>
void append(std::vector<std::byte>& out, T value) {
  const auto* p = reinterpret_cast<const std::byte*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

TEST(StateFormat, PlansTheWorkedExampleAt5276Bytes) {
  auto layout = plan_state_layout(dense_shape(), 5, 5);
  ASSERT_TRUE(layout) << layout.error().what();
  EXPECT_EQ(layout->content_bytes, 5276u);
  const auto& stream = layout->blocks.at(0).streams.at(0);
  ASSERT_EQ(stream.sections.size(), 4u);
  EXPECT_EQ(stream.cells_offset, 40u);
  EXPECT_EQ(stream.data_header_offset, 100u);
  EXPECT_EQ(stream.sections[0].header_offset, 108u);
  EXPECT_EQ(stream.sections[1].header_offset, 1400u);
  EXPECT_EQ(stream.sections[2].header_offset, 2692u);
  EXPECT_EQ(stream.sections[3].header_offset, 3984u);
  EXPECT_EQ(stream.sections[3].row_bytes, 256u);
}

// The construction docs/state-file.md spells out, done by hand here so encoder and decoder
// cannot share a mistake.
TEST(StateFormat, EncodesTheWorkedExampleExactlyAsTheDocumentConstructsIt) {
  const auto tokens = token_ids(5);
  auto layout = plan_state_layout(dense_shape(), 5, 5, kStateSeqVersion2);
  ASSERT_TRUE(layout);
  const auto encoded = pattern_file(*layout, tokens);

  std::vector<std::byte> expected;
  append<uint32_t>(expected, 0x67677371);
  append<uint32_t>(expected, 2);
  append<uint32_t>(expected, 5);
  for (int32_t t : tokens) append<int32_t>(expected, t);
  append<uint32_t>(expected, 1);  // n_stream
  append<uint32_t>(expected, 5);  // cell_count
  for (int32_t pos = 0; pos < 5; ++pos) {
    append<int32_t>(expected, pos);
    append<uint32_t>(expected, 1);
    append<int32_t>(expected, 0);
  }
  append<uint32_t>(expected, 0);  // v_trans
  append<uint32_t>(expected, 2);  // n_layer
  for (int kind : {0, 1})
    for (uint32_t il = 0; il < 2; ++il) {
      append<int32_t>(expected, 1);
      append<uint64_t>(expected, 256);
      for (size_t i = 0; i < 1280; ++i) expected.push_back(std::byte((il * 31 + kind * 7 + i) & 0xff));
    }
  EXPECT_EQ(encoded, expected);
}

TEST(StateFormat, WritesTransposedVHeadersWithElementSizeAndWidth) {
  auto layout = plan_state_layout(dense_shape(GgmlType::F16, GgmlType::F16, true), 5, 5);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->content_bytes, 5276u);
  const auto file = pattern_file(*layout, token_ids(5));
  EXPECT_EQ(read_at<uint32_t>(file, 100), 1u);   // v_trans
  EXPECT_EQ(read_at<int32_t>(file, 2692), 1);    // V type f16
  EXPECT_EQ(read_at<uint32_t>(file, 2696), 2u);  // element size
  EXPECT_EQ(read_at<uint32_t>(file, 2700), 128u);
}

TEST(StateFormat, SizesTheQ8_0VariantAt2876Bytes) {
  auto layout = plan_state_layout(dense_shape(GgmlType::Q8_0, GgmlType::Q8_0), 5, 5);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->content_bytes, 2876u);
  EXPECT_EQ(layout->blocks[0].streams[0].sections[0].row_bytes, 136u);
}

TEST(StateFormat, KeepsOnlyTheWindowInTheSwaBlock) {
  auto layout = plan_state_layout(iswa_shape(8), 19, 19);
  ASSERT_TRUE(layout);
  ASSERT_EQ(layout->blocks.size(), 2u);
  EXPECT_EQ(layout->blocks[0].end_offset - layout->blocks[0].offset, 9996u);
  EXPECT_EQ(layout->blocks[1].end_offset - layout->blocks[1].offset, 4232u);
  EXPECT_EQ(layout->content_bytes, 14316u);
  const auto& swa_cells = layout->blocks[1].streams[0].cells;
  ASSERT_EQ(swa_cells.size(), 8u);
  EXPECT_EQ(swa_cells.front().pos, 11);
  EXPECT_EQ(swa_cells.back().pos, 18);
}

TEST(StateFormat, KeepsTheCurrentChunkInAChunkedSwaBlock) {
  auto shape = iswa_shape(8);
  shape.kv_caches[1].swa_type = SwaType::chunked;
  auto layout = plan_state_layout(shape, 19, 19);
  ASSERT_TRUE(layout);
  const auto& cells = layout->blocks[1].streams[0].cells;
  ASSERT_EQ(cells.size(), 3u);  // positions 16, 17, 18: the chunk of position 18
  EXPECT_EQ(cells.front().pos, 16);
}

TEST(StateFormat, SizesTheMambaExampleAt19556BytesWithTheLastPosition) {
  auto layout = plan_state_layout(mamba_shape(), 5, 5);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->content_bytes, 19556u);
  const auto& stream = layout->blocks[0].streams[0];
  ASSERT_EQ(stream.cells.size(), 1u);
  EXPECT_EQ(stream.cells[0].pos, 4);
  EXPECT_EQ(stream.cells[0].n_seq_id, 0u);
}

TEST(StateFormat, WritesTheRecurrentHeaderEvenWithNoCells) {
  auto layout = plan_state_layout(mamba_shape(), 0, 0);
  ASSERT_TRUE(layout);
  // header 12 + cell_count 4 + s_trans/n_layer 8 + 4 section headers of 12
  EXPECT_EQ(layout->content_bytes, 12u + 4 + 8 + 4 * 12);
}

TEST(StateFormat, WritesNoMetaForAnEmptyKvStream) {
  auto layout = plan_state_layout(dense_shape(), 0, 0);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->content_bytes, 12u + 4 + 4);
}

TEST(StateFormat, GivesVersion2MropeCellsTwentyBytesWithXAndYEqualToPos) {
  auto shape = dense_shape();
  shape.n_pos_per_embd = 4;
  auto layout = plan_state_layout(shape, 3, 3, kStateSeqVersion2);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->blocks[0].streams[0].cell_record_bytes, 20u);
  const auto file = pattern_file(*layout, token_ids(3));
  const uint64_t cell2 = layout->blocks[0].streams[0].cells_offset + 2 * 20;
  EXPECT_EQ(read_at<int32_t>(file, cell2), 2);        // pos
  EXPECT_EQ(read_at<uint32_t>(file, cell2 + 4), 1u);  // n_seq_id
  EXPECT_EQ(read_at<int32_t>(file, cell2 + 8), 2);    // x
  EXPECT_EQ(read_at<int32_t>(file, cell2 + 12), 2);   // y
  EXPECT_EQ(read_at<int32_t>(file, cell2 + 16), 0);   // seq id
}

// Version 3 (llama.cpp 80fb11ac) widened llama_kv_cell_ext by the cell's token: x, y, tok.
TEST(StateFormat, GivesVersion3MropeCellsTwentyFourBytesWithTheCellsToken) {
  auto shape = dense_shape();
  shape.n_pos_per_embd = 4;
  auto layout = plan_state_layout(shape, 3, 3, kStateSeqVersion3);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->blocks[0].streams[0].cell_record_bytes, 24u);
  const std::vector<int32_t> ids{70, 71, 72};
  set_cell_tokens(*layout, ids);
  const auto file = pattern_file(*layout, ids);
  EXPECT_EQ(read_at<uint32_t>(file, 4), 3u);  // version
  const uint64_t cell2 = layout->blocks[0].streams[0].cells_offset + 2 * 24;
  EXPECT_EQ(read_at<int32_t>(file, cell2), 2);        // pos
  EXPECT_EQ(read_at<uint32_t>(file, cell2 + 4), 1u);  // n_seq_id
  EXPECT_EQ(read_at<int32_t>(file, cell2 + 8), 2);    // x
  EXPECT_EQ(read_at<int32_t>(file, cell2 + 12), 2);   // y
  EXPECT_EQ(read_at<int32_t>(file, cell2 + 16), 72);  // tok
  EXPECT_EQ(read_at<int32_t>(file, cell2 + 20), 0);   // seq id
  auto decoded = decode_state_layout(file, &shape, "mrope3.bin");
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->blocks[0].streams[0].cells, layout->blocks[0].streams[0].cells);
  // Without M-RoPE the cells are 12 bytes in both versions: the files differ in the version word only.
  auto plain2 = plan_state_layout(dense_shape(), 5, 5, kStateSeqVersion2);
  auto plain3 = plan_state_layout(dense_shape(), 5, 5, kStateSeqVersion3);
  auto file2 = pattern_file(*plain2, token_ids(5));
  auto file3 = pattern_file(*plain3, token_ids(5));
  ASSERT_EQ(file2.size(), file3.size());
  file2[4] = std::byte{3};
  EXPECT_EQ(file2, file3);
}

TEST(StateFormat, SetStateVersionRewritesMropeCellsAndOffsets) {
  auto shape = dense_shape();
  shape.n_pos_per_embd = 4;
  auto v2 = plan_state_layout(shape, 4, 4, kStateSeqVersion2);
  auto v3 = plan_state_layout(shape, 4, 4, kStateSeqVersion3);
  ASSERT_TRUE(v2 && v3);
  StateLayout converted = *v2;
  ASSERT_TRUE(set_state_version(converted, kStateSeqVersion3));
  EXPECT_EQ(converted.version, 3u);
  EXPECT_EQ(converted.content_bytes, v3->content_bytes);
  EXPECT_EQ(converted.content_bytes, v2->content_bytes + 4 * 4);
  ASSERT_TRUE(set_state_version(converted, kStateSeqVersion2));
  EXPECT_EQ(converted.content_bytes, v2->content_bytes);
  auto refused = set_state_version(converted, 4);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("version 4 is unknown"), std::string::npos) << refused.error().message();
}

TEST(StateFormat, RefusesToPlanAnUnknownVersion) {
  auto layout = plan_state_layout(dense_shape(), 5, 5, 1);
  ASSERT_FALSE(layout);
  EXPECT_NE(layout.error().message().find("state file version 1 is unknown"), std::string::npos)
      << layout.error().message();
}

TEST(StateFormat, WritesEmptyStreamsAsZeroCountsForANonUnifiedCache) {
  auto shape = dense_shape();
  shape.kv_caches[0].n_stream = 3;
  auto layout = plan_state_layout(shape, 5, 5);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->content_bytes, 5276u + 8);
  const auto file = pattern_file(*layout, token_ids(5));
  EXPECT_EQ(read_at<uint32_t>(file, 32), 3u);
  EXPECT_EQ(read_at<uint32_t>(file, 5276), 0u);
  EXPECT_EQ(read_at<uint32_t>(file, 5280), 0u);
}

TEST(StateFormat, RefusesMoreCellsThanTheCacheHolds) {
  auto shape = dense_shape();
  shape.kv_caches[0].kv_size = 4;
  auto layout = plan_state_layout(shape, 5, 5);
  ASSERT_FALSE(layout);
  EXPECT_NE(layout.error().message().find("kv_size of 4"), std::string::npos) << layout.error().message();
}

TEST(StateFormat, RefusesQuantizedTransposedV) {
  auto layout = plan_state_layout(dense_shape(GgmlType::F16, GgmlType::Q8_0, true), 5, 5);
  ASSERT_FALSE(layout);
  EXPECT_NE(layout.error().message().find("flash attention"), std::string::npos);
}

// ---- decoding ----------------------------------------------------------------------------

struct Case {
  const char* name;
  MemoryShape shape;
  uint32_t n_tokens;
};

std::vector<Case> round_trip_cases() {
  auto mrope = dense_shape();
  mrope.n_pos_per_embd = 4;
  auto multi_stream = dense_shape();
  multi_stream.kv_caches[0].n_stream = 2;
  return {
      {"dense f16", dense_shape(), 5},
      {"dense one token", dense_shape(), 1},
      {"dense v_trans", dense_shape(GgmlType::F16, GgmlType::F16, true), 7},
      {"dense f32", dense_shape(GgmlType::F32, GgmlType::F32, false), 3},
      {"dense bf16 v_trans", dense_shape(GgmlType::BF16, GgmlType::BF16, true), 3},
      {"dense q8_0", dense_shape(GgmlType::Q8_0, GgmlType::Q8_0), 9},
      {"dense q4_0 k f16 v", dense_shape(GgmlType::Q4_0, GgmlType::F16), 9},
      {"mrope", mrope, 4},
      {"two streams", multi_stream, 4},
      {"iswa", iswa_shape(8), 19},
      {"iswa short prompt", iswa_shape(8), 3},
      {"mamba", mamba_shape(), 5},
      {"hybrid", hybrid_shape(), 6},
      {"hybrid v_trans", hybrid_shape(true), 6},
      {"lfm2", lfm2_shape(), 5},
      {"mamba2", mamba2_shape(), 7},
  };
}

TEST(StateFormatDecode, RoundTripsEveryMemoryKindWithAndWithoutTheShape) {
  for (const auto& c : round_trip_cases())
    for (uint32_t version : {kStateSeqVersion2, kStateSeqVersion3}) {
      SCOPED_TRACE(fmt::format("{}, version {}", c.name, version));
      const auto tokens = token_ids(c.n_tokens);
      auto planned = plan_state_layout(c.shape, c.n_tokens, c.n_tokens, version);
      ASSERT_TRUE(planned) << planned.error().what();
      const auto file = pattern_file(*planned, tokens);
      ASSERT_EQ(file.size(), planned->content_bytes);

      for (const MemoryShape* expect : {&c.shape, static_cast<const MemoryShape*>(nullptr)}) {
        auto decoded = decode_state_layout(file, expect, "case.bin");
        ASSERT_TRUE(decoded) << decoded.error().what();
        EXPECT_EQ(decoded->memory_kind, c.shape.kind);
        EXPECT_EQ(decoded->version, version);
        EXPECT_EQ(decoded->has_mrope_cells, c.shape.n_pos_per_embd > 1);
        EXPECT_EQ(decoded->trailing_bytes, 0u);
        EXPECT_EQ(decode_state_tokens(file, *decoded), tokens);
        // Re-encoding what was decoded, rows taken from the file, gives the same bytes.
        const auto again = encode_state_file(*decoded, tokens, [&](const StateSection& s) {
          return std::span<const std::byte>(file).subspan(s.data_offset, s.data_bytes());
        });
        EXPECT_EQ(again, file);
        ASSERT_EQ(decoded->blocks.size(), planned->blocks.size());
        for (size_t b = 0; b < planned->blocks.size(); ++b) {
          const auto& want = planned->blocks[b].streams;
          const auto& got = decoded->blocks[b].streams;
          ASSERT_EQ(got.size(), want.size());
          for (size_t s = 0; s < want.size(); ++s) {
            EXPECT_EQ(got[s].cells, want[s].cells);
            ASSERT_EQ(got[s].sections.size(), want[s].sections.size());
            for (size_t i = 0; i < want[s].sections.size(); ++i) {
              EXPECT_EQ(got[s].sections[i].type, want[s].sections[i].type);
              EXPECT_EQ(got[s].sections[i].n_embd, want[s].sections[i].n_embd);
              EXPECT_EQ(got[s].sections[i].data_offset, want[s].sections[i].data_offset);
              if (expect) {
                EXPECT_EQ(got[s].sections[i].il, want[s].sections[i].il);
              }
            }
          }
        }
      }
    }
}

TEST(StateFormatDecode, AcceptsAndCountsTrailingBytesAsLlamaCppIgnoresThem) {
  auto planned = plan_state_layout(dense_shape(), 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  file.resize(file.size() + 7, std::byte{0x5a});
  auto decoded = decode_state_layout(file, nullptr, "t.bin");
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->trailing_bytes, 7u);
  EXPECT_EQ(decoded->memory_kind, MemoryKind::kv);
  const auto shape = dense_shape();
  auto with_shape = decode_state_layout(file, &shape, "t.bin");
  ASSERT_TRUE(with_shape);
  EXPECT_EQ(with_shape->trailing_bytes, 7u);
}

TEST(StateFormatDecode, RejectsAWrongMagicNamingTheValueAndOffset) {
  auto planned = plan_state_layout(dense_shape(), 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  file[0] = std::byte{0x6e};  // "ggsn": the whole-context session magic
  auto decoded = decode_state_layout(file, nullptr, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_EQ(decoded.error().errno_value(), EINVAL);
  EXPECT_NE(decoded.error().message().find("state file slot0.bin: magic is 0x6767736e"), std::string::npos)
      << decoded.error().message();
  EXPECT_NE(decoded.error().message().find("(offset 0)"), std::string::npos);
}

TEST(StateFormatDecode, RejectsAnUnknownVersion) {
  auto planned = plan_state_layout(dense_shape(), 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  file[4] = std::byte{4};
  auto decoded = decode_state_layout(file, nullptr, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_NE(decoded.error().message().find("version is 4, this reader knows versions 2 and 3 (offset 4)"),
            std::string::npos)
      << decoded.error().message();
  auto peeked = peek_state_version(file, "slot0.bin");
  ASSERT_FALSE(peeked);
  EXPECT_NE(peeked.error().message().find("version 4 is unknown"), std::string::npos) << peeked.error().message();
}

TEST(StateFormatDecode, PeeksTheVersionFromTheFirstEightBytes) {
  for (uint32_t version : {kStateSeqVersion2, kStateSeqVersion3}) {
    auto planned = plan_state_layout(dense_shape(), 5, 5, version);
    const auto file = pattern_file(*planned, token_ids(5));
    auto peeked = peek_state_version(std::span<const std::byte>(file).first(8), "p.bin");
    ASSERT_TRUE(peeked) << peeked.error().what();
    EXPECT_EQ(*peeked, version);
  }
  const std::vector<std::byte> short_file(7);
  auto peeked = peek_state_version(short_file, "short.bin");
  ASSERT_FALSE(peeked);
  EXPECT_NE(peeked.error().message().find("state file short.bin: 7 bytes"), std::string::npos);
}

// llama-server 80fb11ac saves a slot's prompt packed by server_tokens::serialize into the
// token words: -1, packing version 1, the id count, the ids, a media-key count, keys, chunks.
std::vector<int32_t> packed_words(const std::vector<int32_t>& ids) {
  std::vector<int32_t> words{-1, 1, static_cast<int32_t>(ids.size())};
  words.insert(words.end(), ids.begin(), ids.end());
  words.push_back(0);  // no media
  return words;
}

TEST(StateFormatDecode, ReadsTheIdsOfLlamaServersPackedTokens) {
  const auto ids = token_ids(5);
  const auto words = packed_words(ids);
  auto planned = plan_state_layout(dense_shape(), static_cast<uint32_t>(words.size()), 5, kStateSeqVersion3);
  ASSERT_TRUE(planned);
  const auto file = pattern_file(*planned, words);
  const auto shape = dense_shape();
  for (const MemoryShape* expect : {&shape, static_cast<const MemoryShape*>(nullptr)}) {
    auto decoded = decode_state_layout(file, expect, "packed.bin");
    ASSERT_TRUE(decoded) << decoded.error().what();
    EXPECT_EQ(decoded->token_form, StateTokenForm::server_packed);
    EXPECT_EQ(decoded->n_token, 9u);
    EXPECT_EQ(decoded->n_prompt_ids, 5u);
    EXPECT_EQ(decoded->prompt_ids_offset, 24u);
    EXPECT_EQ(decoded->n_media, 0u);
    EXPECT_EQ(decode_state_tokens(file, *decoded), ids);
    EXPECT_NE(describe_state_layout(*decoded).find("packed by llama-server in 9 token words"), std::string::npos);
  }
  // In a version 2 file the same words are plain ids (that llama-server never packed).
  auto v2 = plan_state_layout(dense_shape(), static_cast<uint32_t>(words.size()), 5, kStateSeqVersion2);
  const auto file2 = pattern_file(*v2, words);
  auto decoded2 = decode_state_layout(file2, nullptr, "v2.bin");
  ASSERT_TRUE(decoded2) << decoded2.error().what();
  EXPECT_EQ(decoded2->token_form, StateTokenForm::ids);
  EXPECT_EQ(decode_state_tokens(file2, *decoded2), words);
}

TEST(StateFormatDecode, CountsMediaChunksOfPackedTokens) {
  // 3 ids (the middle one an image's placeholder), one media key at index 1, a 5-byte chunk
  // padded to two words.
  std::vector<int32_t> words{-1, 1, 3, 7, -1, 9, 1, 1, 5, 0x04030201, 0x05};
  auto planned = plan_state_layout(dense_shape(), static_cast<uint32_t>(words.size()), 3, kStateSeqVersion3);
  const auto file = pattern_file(*planned, words);
  auto decoded = decode_state_layout(file, nullptr, "media.bin");
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->n_media, 1u);
  EXPECT_EQ(decode_state_tokens(file, *decoded), (std::vector<int32_t>{7, -1, 9}));
  StateLayout to_v2 = *decoded;
  auto refused = set_state_version(to_v2, kStateSeqVersion2);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("1 media chunks"), std::string::npos) << refused.error().message();
}

TEST(StateFormatDecode, RefusesMalformedPackedTokensNamingTheWord) {
  struct Bad {
    const char* name;
    std::vector<int32_t> words;
    const char* message;
  };
  const std::vector<Bad> cases{
      {"only the marker", {-1}, "the token words end inside the packing version (offset 16)"},
      {"packing version 2", {-1, 2, 0, 0}, "packing version is 2, llama-server writes 1 (offset 16)"},
      {"ids past the words", {-1, 1, 9, 5, 0}, "9 ids do not fit the 5 token words (offset 20)"},
      {"no media count", {-1, 1, 1, 5}, "the token words end inside the media-key count (offset 28)"},
      {"media key past the ids", {-1, 1, 1, 5, 1, 3, 1, 0}, "media key 0 is 3, past the 1 ids (offset 32)"},
      {"empty media chunk", {-1, 1, 1, 5, 1, 0, 0}, "media chunk 0 has 0 bytes"},
      {"a word too many", {-1, 1, 1, 5, 0, 42}, "4 bytes after the last media chunk (offset 32)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto planned = plan_state_layout(dense_shape(), static_cast<uint32_t>(c.words.size()), 1, kStateSeqVersion3);
    const auto file = pattern_file(*planned, c.words);
    auto decoded = decode_state_layout(file, nullptr, "bad.bin");
    ASSERT_FALSE(decoded);
    EXPECT_NE(decoded.error().message().find("state file bad.bin: packed slot tokens"), std::string::npos)
        << decoded.error().message();
    EXPECT_NE(decoded.error().message().find(c.message), std::string::npos) << decoded.error().message();
  }
}

TEST(StateFormatDecode, NamesLayerFieldAndOffsetOfAWrongRowSize) {
  const auto shape = dense_shape();
  auto planned = plan_state_layout(shape, 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  const uint64_t row_size_offset = 1400 + 4;  // layer 1 K row size
  const uint64_t bad = 512;
  std::memcpy(file.data() + row_size_offset, &bad, 8);
  auto decoded = decode_state_layout(file, &shape, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_EQ(decoded.error().message(),
            "state file slot0.bin: kv layer 1 K row size is 512 bytes, layout says 256 (offset 1404)");
}

TEST(StateFormatDecode, NamesAMismatchedCacheType) {
  const auto shape = dense_shape(GgmlType::Q8_0, GgmlType::Q8_0);
  auto planned = plan_state_layout(dense_shape(), 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  auto decoded = decode_state_layout(file, &shape, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_NE(decoded.error().message().find("kv layer 0 K type is 1 (f16), layout says 8 (q8_0) (offset 108)"),
            std::string::npos)
      << decoded.error().message();
}

TEST(StateFormatDecode, NamesAnIncompatibleVTransposition) {
  const auto shape = dense_shape(GgmlType::F16, GgmlType::F16, true);
  auto planned = plan_state_layout(dense_shape(), 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  auto decoded = decode_state_layout(file, &shape, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_NE(decoded.error().message().find("v_trans is 0, layout says 1"), std::string::npos);
  EXPECT_NE(decoded.error().message().find("(offset 100)"), std::string::npos);
}

TEST(StateFormatDecode, NamesAStreamCountMismatch) {
  auto shape = dense_shape();
  shape.kv_caches[0].n_stream = 4;
  auto planned = plan_state_layout(dense_shape(), 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  auto decoded = decode_state_layout(file, &shape, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_NE(decoded.error().message().find("n_stream is 1, layout says 4"), std::string::npos);
}

TEST(StateFormatDecode, RejectsACellWithTwoSequences) {
  auto planned = plan_state_layout(dense_shape(), 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  const uint32_t two = 2;
  std::memcpy(file.data() + 40 + 12 * 3 + 4, &two, 4);
  auto decoded = decode_state_layout(file, nullptr, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_NE(decoded.error().message().find("cell 3: n_seq_id is 2"), std::string::npos) << decoded.error().message();
  EXPECT_NE(decoded.error().message().find("(offset 80)"), std::string::npos);
}

TEST(StateFormatDecode, GivesAClearErrorAtEveryTruncationPoint) {
  for (const auto& c : round_trip_cases()) {
    SCOPED_TRACE(c.name);
    auto planned = plan_state_layout(c.shape, c.n_tokens, c.n_tokens);
    const auto file = pattern_file(*planned, token_ids(c.n_tokens));
    // Every cut outside row data, and the first and last bytes of each row run (a cut deeper
    // inside rows takes the same path).
    std::vector<std::pair<uint64_t, uint64_t>> row_interiors;
    for (const auto& block : planned->blocks)
      for (const auto& stream : block.streams)
        for (const auto& section : stream.sections)
          if (section.data_bytes() > 4) row_interiors.emplace_back(section.data_offset + 2, section.end_offset() - 2);
    for (size_t cut = 0; cut < file.size(); ++cut) {
      const bool inside_rows = std::any_of(row_interiors.begin(), row_interiors.end(),
                                           [&](const auto& r) { return cut > r.first && cut < r.second; });
      if (inside_rows) continue;
      const std::span<const std::byte> prefix(file.data(), cut);
      auto with_shape = decode_state_layout(prefix, &c.shape, "cut.bin");
      ASSERT_FALSE(with_shape) << "cut at " << cut;
      EXPECT_NE(with_shape.error().message().find("state file cut.bin: "), std::string::npos);
      EXPECT_NE(with_shape.error().message().find("(offset "), std::string::npos) << with_shape.error().message();
      // Inspect mode may find a shorter reading (e.g. fewer blocks) but never crashes.
      (void)decode_state_layout(prefix, nullptr, "cut.bin");
    }
  }
}

TEST(StateFormatDecode, SaysWhereAFileEndsInsideRows) {
  const auto shape = dense_shape();
  auto planned = plan_state_layout(shape, 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  file.resize(2000);  // inside layer 1 K rows
  auto decoded = decode_state_layout(file, &shape, "slot0.bin");
  ASSERT_FALSE(decoded);
  EXPECT_EQ(decoded.error().message(),
            "state file slot0.bin: file ends at byte 2000 inside kv layer 1 K rows (5 x 256 bytes needed, 588 left) "
            "(offset 1412)");
}

TEST(StateFormatDecode, NeverTrustsHugeCountsForAllocation) {
  const auto shape = dense_shape();
  auto planned = plan_state_layout(shape, 5, 5);
  auto file = pattern_file(*planned, token_ids(5));
  for (uint64_t offset : {8u, 32u, 36u, 104u}) {
    auto copy = file;
    const uint32_t huge = 0xfffffff0u;
    std::memcpy(copy.data() + offset, &huge, 4);
    auto decoded = decode_state_layout(copy, nullptr, "huge.bin");
    EXPECT_FALSE(decoded) << "offset " << offset;
  }
}

TEST(StateFormatDecode, DerivesAShapeThatReplansTheSameFile) {
  for (const auto& c : round_trip_cases()) {
    SCOPED_TRACE(c.name);
    auto planned = plan_state_layout(c.shape, c.n_tokens, c.n_tokens);
    const auto file = pattern_file(*planned, token_ids(c.n_tokens));
    auto decoded = decode_state_layout(file, nullptr, "x.bin");
    ASSERT_TRUE(decoded);
    const MemoryShape derived = memory_shape_from_layout(*decoded);
    auto again = decode_state_layout(file, &derived, "x.bin");
    ASSERT_TRUE(again) << again.error().what();
    EXPECT_EQ(again->content_bytes, file.size());
  }
}

TEST(StateFormat, RecomputesOffsetsAfterARetype) {
  auto layout = *plan_state_layout(dense_shape(), 5, 5);
  for (auto& section : layout.blocks[0].streams[0].sections) {
    section.type = GgmlType::Q8_0;
    section.row_bytes = ggml_row_size(GgmlType::Q8_0, section.n_embd);
  }
  assign_state_offsets(layout);
  EXPECT_EQ(layout.content_bytes, 2876u);
}

// ---- recurrent blocks: how many R/S sections (issue 26) --------------------------------

// The worked example of docs/state-file.md, built by tests/data/make_state_lfm2_vector.py.
constexpr const char* kLfm2Vector = "state-v3-lfm2-hybrid.bin";
constexpr uint64_t kLfm2RecurrentBlock = 2716;  // offset of the recurrent cell_count
constexpr uint64_t kLfm2R0 = 2736, kLfm2R2 = 3260, kLfm2S0 = 3784, kLfm2S2 = 3796, kLfm2End = 3808;

std::vector<std::byte> lfm2_vector() {
  return kvshare::testing::read_file_bytes(kvshare::testing::data_path(kLfm2Vector));
}

const StateBlock* recurrent_block(const StateLayout& layout) {
  for (const auto& block : layout.blocks)
    if (block.kind == StateBlockKind::recurrent) return &block;
  return nullptr;
}

// Issue 26: inspect read this file as "recurrent: 1 cells x 1 layers" with 24 trailing bytes
// (it took the row-size-0 S headers for garbage and the second R section for an S section).
TEST(StateFormatRecurrent, ReadsTheLfm2ExampleWithoutTheModelAsTwoRecurrentLayersOfFour) {
  const auto file = lfm2_vector();
  ASSERT_EQ(file.size(), kLfm2End);
  auto decoded = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->memory_kind, MemoryKind::hybrid);
  EXPECT_EQ(decoded->trailing_bytes, 0u);
  EXPECT_EQ(decoded->content_bytes, kLfm2End);
  ASSERT_EQ(decoded->blocks.size(), 2u);
  EXPECT_EQ(decoded->blocks[0].streams.at(0).n_layer, 2u);
  const StateBlock* recurrent = recurrent_block(*decoded);
  ASSERT_NE(recurrent, nullptr);
  EXPECT_EQ(recurrent->offset, kLfm2RecurrentBlock);
  const StateStream& stream = recurrent->streams.at(0);
  EXPECT_EQ(stream.n_layer, 4u);
  ASSERT_EQ(stream.cells.size(), 1u);
  EXPECT_EQ(stream.cells[0].pos, 4);
  ASSERT_EQ(stream.sections.size(), 4u);
  const TensorKind kinds[] = {TensorKind::r, TensorKind::r, TensorKind::s, TensorKind::s};
  const uint64_t headers[] = {kLfm2R0, kLfm2R2, kLfm2S0, kLfm2S2};
  const uint64_t rows[] = {512, 512, 0, 0};
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(stream.sections[i].kind, kinds[i]);
    EXPECT_EQ(stream.sections[i].type, GgmlType::F32);
    EXPECT_EQ(stream.sections[i].row_bytes, rows[i]);
    EXPECT_EQ(stream.sections[i].header_offset, headers[i]);
    EXPECT_EQ(stream.sections[i].n_rows, 1u);
  }
  EXPECT_NE(describe_state_layout(*decoded).find("recurrent: 1 cells x 2 recurrent of 4 layers (f32, R row 512 B, S "
                                                 "row 0 B)"),
            std::string::npos)
      << describe_state_layout(*decoded);
}

TEST(StateFormatRecurrent, ReadsTheLfm2ExampleAgainstItsShapeWithTheRealLayerNumbers) {
  const auto file = lfm2_vector();
  const auto shape = lfm2_shape();
  auto decoded = decode_state_layout(file, &shape, kLfm2Vector);
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->trailing_bytes, 0u);
  const auto& kv = decoded->blocks.at(0).streams.at(0).sections;
  ASSERT_EQ(kv.size(), 4u);
  EXPECT_EQ(kv[0].il, 1u);
  EXPECT_EQ(kv[1].il, 3u);
  const auto& sections = recurrent_block(*decoded)->streams.at(0).sections;
  ASSERT_EQ(sections.size(), 4u);
  EXPECT_EQ(sections[0].il, 0u);
  EXPECT_EQ(sections[1].il, 2u);
  EXPECT_EQ(sections[3].kind, TensorKind::s);
  EXPECT_EQ(sections[3].il, 2u);
  EXPECT_EQ(sections[3].n_embd, 0u);
}

TEST(StateFormatRecurrent, PlansAndReencodesTheLfm2ExampleByteForByte) {
  const auto file = lfm2_vector();
  const std::vector<int32_t> ids{1, 2, 3, 4, 5};
  auto planned = plan_state_layout(lfm2_shape(), 5, 5, kStateSeqVersion3);
  ASSERT_TRUE(planned) << planned.error().what();
  EXPECT_EQ(planned->content_bytes, kLfm2End);
  auto rows_of = [&](const StateSection& s) {
    return std::span<const std::byte>(file).subspan(s.data_offset, s.data_bytes());
  };
  EXPECT_EQ(encode_state_file(*planned, ids, rows_of), file);
  auto decoded = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(encode_state_file(*decoded, ids, rows_of), file);
}

// The shape the reader checks against comes from the model's metadata: from the GGUF keys of
// the vector's model, the recurrent block has R/S sections for layers 0 and 2 only.
TEST(StateFormatRecurrent, ReadsTheLfm2ExampleAgainstTheShapeOfItsModelsMetadata) {
  auto builder = layout::testing::transformer("lfm2", 4, 64, 1, 1);
  builder.set("attention.head_count_kv", layout::testing::u32_array({0, 1, 0, 1})).u32("shortconv.l_cache", 3);
  auto model = derive_model_shape(builder.metadata());
  ASSERT_TRUE(model) << model.error().what();
  KvParams params;
  params.n_ctx = 512;
  auto memory = derive_memory_shape(*model, params);
  ASSERT_TRUE(memory) << memory.error().what();
  ASSERT_TRUE(memory->recurrent);
  EXPECT_EQ(memory->recurrent->n_layer, 4u);
  ASSERT_EQ(memory->recurrent->layers.size(), 2u);
  const auto file = lfm2_vector();
  auto decoded = decode_state_layout(file, &*memory, kLfm2Vector);
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->trailing_bytes, 0u);
  auto planned = plan_state_layout(*memory, 5, 5, kStateSeqVersion3);
  ASSERT_TRUE(planned) << planned.error().what();
  EXPECT_EQ(planned->content_bytes, file.size());
}

TEST(StateFormatRecurrent, ReadsAMamba2FileWithEveryLayerRecurrentWithoutTheModel) {
  const auto shape = mamba2_shape();
  auto planned = plan_state_layout(shape, 7, 7);
  ASSERT_TRUE(planned);
  // 12 + 28 tokens, cell_count 4 + cell 8 + s_trans/n_layer 8, 3 x (12 + 1152), 3 x (12 + 4096)
  EXPECT_EQ(planned->content_bytes, 40u + 20 + 3 * 1164 + 3 * 4108);
  const auto file = pattern_file(*planned, token_ids(7));
  auto decoded = decode_state_layout(file, nullptr, "mamba2.bin");
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->memory_kind, MemoryKind::recurrent);
  EXPECT_EQ(decoded->trailing_bytes, 0u);
  const StateStream& stream = decoded->blocks.at(0).streams.at(0);
  EXPECT_EQ(stream.n_layer, 3u);
  ASSERT_EQ(stream.sections.size(), 6u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(stream.sections[i].kind, TensorKind::r);
    EXPECT_EQ(stream.sections[i].il, i);  // every layer recurrent: the ordinals are the layers
    EXPECT_EQ(stream.sections[i].n_embd, 288u);
    EXPECT_EQ(stream.sections[3 + i].kind, TensorKind::s);
    EXPECT_EQ(stream.sections[3 + i].n_embd, 1024u);
  }
}

// With every layer's R and S present the block's end is known: what follows is trailing.
TEST(StateFormatRecurrent, CountsBytesAfterAFullRecurrentBlockAsTrailing) {
  auto planned = plan_state_layout(mamba2_shape(), 7, 7);
  auto file = pattern_file(*planned, token_ids(7));
  file.resize(file.size() + 13, std::byte{0});
  auto decoded = decode_state_layout(file, nullptr, "mamba2.bin");
  ASSERT_TRUE(decoded) << decoded.error().what();
  EXPECT_EQ(decoded->memory_kind, MemoryKind::recurrent);
  EXPECT_EQ(decoded->trailing_bytes, 13u);
}

TEST(StateFormatRecurrent, NamesTheByteOffsetOfATruncatedRecurrentSection) {
  auto file = lfm2_vector();
  file.resize(3500);  // inside the rows of layer 2's R
  auto inspected = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_FALSE(inspected);
  EXPECT_EQ(inspected.error().message(),
            fmt::format("state file {}: file ends at byte 3500 inside recurrent section 1 rows (1 x 512 bytes "
                        "needed, 228 left) (offset 3272)",
                        kLfm2Vector));
  const auto shape = lfm2_shape();
  auto verified = decode_state_layout(file, &shape, kLfm2Vector);
  ASSERT_FALSE(verified);
  EXPECT_NE(verified.error().message().find("inside recurrent layer 2 R rows"), std::string::npos)
      << verified.error().message();
  EXPECT_NE(verified.error().message().find("(offset 3272)"), std::string::npos) << verified.error().message();
}

TEST(StateFormatRecurrent, NamesTheOffsetOfASectionHeaderCutShort) {
  auto file = lfm2_vector();
  file.resize(kLfm2S2 + 6);  // half of layer 2's S header
  auto inspected = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_FALSE(inspected);
  EXPECT_NE(inspected.error().message().find("recurrent section 3 row size"), std::string::npos)
      << inspected.error().message();
  EXPECT_NE(inspected.error().message().find("(offset 3800)"), std::string::npos) << inspected.error().message();
}

TEST(StateFormatRecurrent, RefusesARecurrentSectionTypeThatIsNotF32NamingTheField) {
  auto file = lfm2_vector();
  const int32_t f16 = 1;
  std::memcpy(file.data() + kLfm2R2, &f16, 4);
  // Without the model: not read as a KV file with the recurrent block as trailing bytes.
  auto inspected = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_FALSE(inspected);
  EXPECT_EQ(inspected.error().message(),
            fmt::format("state file {}: recurrent section 1 type is 1 (f16), llama.cpp writes recurrent state as f32 "
                        "(0) (offset 3260)",
                        kLfm2Vector));
  const auto shape = lfm2_shape();
  auto verified = decode_state_layout(file, &shape, kLfm2Vector);
  ASSERT_FALSE(verified);
  EXPECT_EQ(verified.error().message(),
            fmt::format("state file {}: recurrent layer 2 R type is 1 (f16), layout says 0 (f32) (offset 3260)",
                        kLfm2Vector));
}

TEST(StateFormatRecurrent, RefusesAnOddNumberOfRecurrentSections) {
  auto file = lfm2_vector();
  file.resize(kLfm2S2);  // drop layer 2's S header: R, R, S
  auto inspected = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_FALSE(inspected);
  EXPECT_NE(inspected.error().message().find("3 sections"), std::string::npos) << inspected.error().message();
  EXPECT_NE(inspected.error().message().find("R and S sections come in pairs"), std::string::npos)
      << inspected.error().message();
  EXPECT_NE(inspected.error().message().find("(offset 2736)"), std::string::npos) << inspected.error().message();
}

TEST(StateFormatRecurrent, RefusesARowSizeThatIsNotWholeF32Elements) {
  auto file = lfm2_vector();
  const uint64_t odd = 510;
  std::memcpy(file.data() + kLfm2R0 + 4, &odd, 8);
  auto inspected = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_FALSE(inspected);
  EXPECT_NE(inspected.error().message().find("recurrent section 0 row size 510 bytes is not a whole number of f32 "
                                             "elements"),
            std::string::npos)
      << inspected.error().message();
  EXPECT_NE(inspected.error().message().find("(offset 2740)"), std::string::npos) << inspected.error().message();
}

// n_embd_r and n_embd_s are one value per model (llama_hparams), so all R rows are one size
// and all S rows another: a reading that pairs them otherwise is not llama.cpp's.
TEST(StateFormatRecurrent, RefusesSectionsOfOneKindWithDifferentRowSizes) {
  auto file = lfm2_vector();
  const uint64_t four = 4;
  std::memcpy(file.data() + kLfm2S2 + 4, &four, 8);
  file.resize(file.size() + 4, std::byte{0});  // its one row
  auto inspected = decode_state_layout(file, nullptr, kLfm2Vector);
  ASSERT_FALSE(inspected);
  EXPECT_NE(inspected.error().message().find("recurrent section 3 (S of recurrent layer 1) row size is 4 bytes, "
                                             "section 2 has 0"),
            std::string::npos)
      << inspected.error().message();
  EXPECT_NE(inspected.error().message().find("(offset 3800)"), std::string::npos) << inspected.error().message();
}

// With the model the count comes from it: a shape that took every trunk layer for recurrent
// (n_layer R sections, what a writer must not produce) meets layer 0's S header where it
// expects layer 2's R.
TEST(StateFormatRecurrent, NamesLayerFieldAndOffsetWhenTheShapeExpectsOtherSections) {
  const auto file = lfm2_vector();
  auto every_layer = lfm2_shape();
  every_layer.recurrent = kvshare::testing::recurrent_part(4, {0, 1, 2, 3}, 128, 0);
  auto decoded = decode_state_layout(file, &every_layer, kLfm2Vector);
  ASSERT_FALSE(decoded);
  EXPECT_EQ(decoded.error().message(),
            fmt::format("state file {}: recurrent layer 2 R row size is 0 bytes, layout says 512 (offset 3788)",
                        kLfm2Vector));

  auto with_s = lfm2_shape();
  with_s.recurrent = kvshare::testing::recurrent_part(4, {0, 2}, 128, 16);
  decoded = decode_state_layout(file, &with_s, kLfm2Vector);
  ASSERT_FALSE(decoded);
  EXPECT_EQ(
      decoded.error().message(),
      fmt::format("state file {}: recurrent layer 0 S row size is 0 bytes, layout says 64 (offset 3788)", kLfm2Vector));

  auto wrong_n_layer = lfm2_shape();
  wrong_n_layer.recurrent->n_layer = 2;
  decoded = decode_state_layout(file, &wrong_n_layer, kLfm2Vector);
  ASSERT_FALSE(decoded);
  EXPECT_EQ(decoded.error().message(),
            fmt::format("state file {}: recurrent n_layer is 4, layout says 2 (offset 2732)", kLfm2Vector));
}

}  // namespace
}  // namespace kvshare::layout
