// The worked examples of docs/layout.md beyond the plain KV cache, one per memory kind:
// tests/data/layout-<kind>-<arch>.json is what `kvshare-layout-dump MODEL --json` printed
// for the model `kvshare-mkmodel --arch <arch>` writes with its defaults. Each is decoded
// field by field, re-encoded to the same bytes, and built again from the model's metadata
// (tests/layout/shape_fixtures.h, the generator's keys) and the params.
//
// The model fingerprint's tensors_hash hashes the GGUF's tensor infos, which only the
// generator knows (layout_tests must not link refmodel): it is taken from the vector here,
// and every other byte of the rebuilt header is compared.
#include "layout/share_header.h"

#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "layout/shape_fixtures.h"
#include "support/test_support.h"

namespace kvshare::layout {
namespace {

using Ne = std::array<int64_t, 4>;

std::string read_vector(const std::string& name) {
  const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path(name));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

ShareHeader parse_vector(const std::string& name) {
  auto header = parse_share_header(read_vector(name), name);
  EXPECT_TRUE(header.has_value()) << header.error().what();
  return header ? *header : ShareHeader{};
}

// What kvshare-mkmodel writes into the fingerprint: general.name "kvshare-tiny-<arch>",
// embedding_length 128, 134 tokens.
ModelFingerprint mkmodel_fingerprint(const std::string& arch, uint32_t n_layer, uint64_t tensors_hash) {
  return {arch, "kvshare-tiny-" + arch, n_layer, 128, testing::kMkmodelVocab, tensors_hash};
}

// The dump's flags: -c N, and llama-server's defaults for the rest (-np 1, f16, -fa on, -ub 512).
KvParams dump_params(uint32_t n_ctx) {
  KvParams params;
  params.n_ctx = n_ctx;
  return params;
}

struct KindVector {
  const char* file;
  testing::MetadataBuilder (*metadata)();
  uint32_t n_ctx;  // the dump's -c
};

// Names the vector in test listings instead of the struct's bytes.
void PrintTo(const KindVector& vector, std::ostream* os) { *os << vector.file; }

const KindVector kVectors[] = {
    {"layout-recurrent-mamba2.json", testing::mkmodel_mamba2, 512},
    {"layout-kv_iswa-gemma3.json", testing::mkmodel_gemma3, 1024},
    {"layout-hybrid-qwen35.json", testing::mkmodel_qwen35, 512},
    {"layout-hybrid-lfm2.json", testing::mkmodel_lfm2, 512},
};

class LayoutKindVector : public ::testing::TestWithParam<KindVector> {};

TEST_P(LayoutKindVector, ReencodesToTheSameBytes) {
  const std::string bytes = read_vector(GetParam().file);
  auto header = parse_share_header(bytes, GetParam().file);
  ASSERT_TRUE(header.has_value()) << header.error().what();
  EXPECT_EQ(to_json(*header), bytes);
}

TEST_P(LayoutKindVector, IsWhatMakeShareHeaderBuildsFromTheModelMetadata) {
  const ShareHeader vector = parse_vector(GetParam().file);
  const GgufMetadata metadata = GetParam().metadata().metadata();
  auto shape = derive_model_shape(metadata);
  ASSERT_TRUE(shape.has_value()) << shape.error().what();
  // Everything but tensors_hash comes from the metadata (no tensor infos here).
  ModelFingerprint model = model_fingerprint(metadata, {});
  EXPECT_EQ(model.arch, vector.model.arch);
  EXPECT_EQ(model.n_layer, vector.model.n_layer);
  EXPECT_EQ(model.n_embd, vector.model.n_embd);
  model.name = vector.model.name;  // general.name and the token count: not shape keys
  model.n_vocab = testing::kMkmodelVocab;
  model.tensors_hash = vector.model.tensors_hash;
  auto header = make_share_header(model, *shape, dump_params(GetParam().n_ctx));
  ASSERT_TRUE(header.has_value()) << header.error().what();
  EXPECT_EQ(to_json(*header), read_vector(GetParam().file));
}

INSTANTIATE_TEST_SUITE_P(Kinds, LayoutKindVector, ::testing::ValuesIn(kVectors),
                         [](const ::testing::TestParamInfo<KindVector>& info) {
                           std::string name = info.param.file;
                           name = name.substr(7, name.size() - 7 - 5);  // drop "layout-" and ".json"
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

void expect_tensor(const SharedTensor& s, const std::string& name, uint32_t cache_index, uint32_t il, TensorKind kind,
                   GgmlType type, Ne ne, uint64_t row_bytes, uint32_t chunk, uint64_t offset, uint64_t padded_bytes) {
  SCOPED_TRACE(name);
  EXPECT_EQ(s.tensor.name, name);
  EXPECT_EQ(s.cache_index, cache_index);
  EXPECT_EQ(s.tensor.layer, il);
  EXPECT_EQ(s.tensor.kind, kind);
  EXPECT_EQ(s.tensor.type, type);
  EXPECT_EQ(s.tensor.ne, ne);
  EXPECT_EQ(s.tensor.row_bytes, row_bytes);
  EXPECT_EQ(s.tensor.nbytes, row_bytes * static_cast<uint64_t>(ne[1] * ne[2] * ne[3]));
  EXPECT_EQ(s.chunk, chunk);
  EXPECT_EQ(s.offset, offset);
  EXPECT_EQ(s.padded_bytes, padded_bytes);
}

void expect_chunk(const ShareChunk& chunk, uint32_t cache_index, uint64_t size_bytes, uint64_t layout_hash) {
  EXPECT_EQ(chunk.cache_index, cache_index);
  EXPECT_EQ(chunk.size_bytes, size_bytes);
  EXPECT_EQ(chunk.layout_hash, layout_hash);
}

void expect_dump_params(const KvParams& params, uint32_t n_ctx) { EXPECT_EQ(params, dump_params(n_ctx)); }

TEST(LayoutKinds, DecodesTheRecurrentMamba2VectorFieldByField) {
  const ShareHeader h = parse_vector("layout-recurrent-mamba2.json");
  EXPECT_EQ(h.format_version, 1u);
  EXPECT_EQ(h.model, mkmodel_fingerprint("mamba2", 2, 0xf27e1aa18047ef5aull));
  expect_dump_params(h.params, 512);
  EXPECT_EQ(h.memory.kind, MemoryKind::recurrent);
  EXPECT_EQ(h.memory.n_ctx, 512u);
  EXPECT_EQ(h.memory.n_pos_per_embd, 1u);
  EXPECT_TRUE(h.memory.kv_caches.empty());
  ASSERT_TRUE(h.memory.recurrent.has_value());
  const RecurrentShape& rs = *h.memory.recurrent;
  EXPECT_EQ(rs.rs_size, 1u);
  EXPECT_EQ(rs.n_layer, 2u);
  ASSERT_EQ(rs.layers.size(), 2u);
  for (uint32_t il = 0; il < 2; ++il) {
    EXPECT_EQ(rs.layers[il].il, il);
    EXPECT_EQ(rs.layers[il].n_embd_r, 864u);   // (d_conv - 1) x (d_inner + 2 n_group d_state) = 3 x 288
    EXPECT_EQ(rs.layers[il].n_embd_s, 4096u);  // d_state x d_inner = 16 x 256
  }
  // The recurrent state is cache object 0: there is no KV cache before it.
  ASSERT_EQ(h.layout.chunks.size(), 1u);
  expect_chunk(h.layout.chunks[0], 0, 40960, 0x2da3e95b6de5c84full);
  ASSERT_EQ(h.layout.tensors.size(), 4u);
  expect_tensor(h.layout.tensors[0], "cache_r_l0", 0, 0, TensorKind::r, GgmlType::F32, {864, 1, 1, 1}, 3456, 0, 0,
                4096);
  expect_tensor(h.layout.tensors[1], "cache_s_l0", 0, 0, TensorKind::s, GgmlType::F32, {4096, 1, 1, 1}, 16384, 0, 4096,
                16384);
  expect_tensor(h.layout.tensors[2], "cache_r_l1", 0, 1, TensorKind::r, GgmlType::F32, {864, 1, 1, 1}, 3456, 0, 20480,
                4096);
  expect_tensor(h.layout.tensors[3], "cache_s_l1", 0, 1, TensorKind::s, GgmlType::F32, {4096, 1, 1, 1}, 16384, 0, 24576,
                16384);
}

void expect_kv_cache(const KvCacheShape& c, const std::string& role, uint32_t kv_size, uint32_t n_swa, SwaType swa_type,
                     uint32_t il, uint32_t n_embd_gqa) {
  SCOPED_TRACE(role);
  EXPECT_EQ(c.role, role);
  EXPECT_EQ(c.kv_size, kv_size);
  EXPECT_EQ(c.n_stream, 1u);
  EXPECT_EQ(c.type_k, GgmlType::F16);
  EXPECT_EQ(c.type_v, GgmlType::F16);
  EXPECT_FALSE(c.v_trans);
  EXPECT_EQ(c.v_width, 0u);
  EXPECT_EQ(c.n_swa, n_swa);
  EXPECT_EQ(c.swa_type, swa_type);
  ASSERT_EQ(c.layers.size(), 1u);
  EXPECT_EQ(c.layers[0].il, il);
  EXPECT_EQ(c.layers[0].n_embd_k_gqa, n_embd_gqa);
  EXPECT_EQ(c.layers[0].n_embd_v_gqa, n_embd_gqa);
  EXPECT_TRUE(c.layers[0].has_v);
}

TEST(LayoutKinds, DecodesTheIswaGemma3VectorFieldByField) {
  const ShareHeader h = parse_vector("layout-kv_iswa-gemma3.json");
  EXPECT_EQ(h.format_version, 1u);
  EXPECT_EQ(h.model, mkmodel_fingerprint("gemma3", 2, 0xa1c4cdc877684332ull));
  expect_dump_params(h.params, 1024);
  EXPECT_EQ(h.memory.kind, MemoryKind::kv_iswa);
  EXPECT_EQ(h.memory.n_ctx, 1024u);
  EXPECT_EQ(h.memory.n_ctx_seq, 1024u);
  EXPECT_EQ(h.memory.n_pos_per_embd, 1u);
  EXPECT_FALSE(h.memory.recurrent.has_value());
  ASSERT_EQ(h.memory.kv_caches.size(), 2u);
  // Base: the full-attention layer 1, kv_size cells. SWA: layer 0, pad256(min(1024, 32 + 512)) = 768 cells.
  expect_kv_cache(h.memory.kv_caches[0], "base", 1024, 0, SwaType::none, 1, 128);
  expect_kv_cache(h.memory.kv_caches[1], "swa", 768, 32, SwaType::standard, 0, 128);
  ASSERT_EQ(h.layout.chunks.size(), 2u);
  expect_chunk(h.layout.chunks[0], 0, 524288, 0x77ffed82cc84afa1ull);
  expect_chunk(h.layout.chunks[1], 1, 393216, 0xa9f62cca6f8ceba1ull);
  ASSERT_EQ(h.layout.tensors.size(), 4u);
  // Creation order: the base cache's tensors first, so layer 1 before layer 0.
  expect_tensor(h.layout.tensors[0], "cache_k_l1", 0, 1, TensorKind::k, GgmlType::F16, {128, 1024, 1, 1}, 256, 0, 0,
                262144);
  expect_tensor(h.layout.tensors[1], "cache_v_l1", 0, 1, TensorKind::v, GgmlType::F16, {128, 1024, 1, 1}, 256, 0,
                262144, 262144);
  expect_tensor(h.layout.tensors[2], "cache_k_l0", 1, 0, TensorKind::k, GgmlType::F16, {128, 768, 1, 1}, 256, 1, 0,
                196608);
  expect_tensor(h.layout.tensors[3], "cache_v_l0", 1, 0, TensorKind::v, GgmlType::F16, {128, 768, 1, 1}, 256, 1, 196608,
                196608);
}

TEST(LayoutKinds, DecodesTheHybridQwen35VectorFieldByField) {
  const ShareHeader h = parse_vector("layout-hybrid-qwen35.json");
  EXPECT_EQ(h.format_version, 1u);
  EXPECT_EQ(h.model, mkmodel_fingerprint("qwen35", 4, 0xe3856525d7b7b363ull));
  expect_dump_params(h.params, 512);
  EXPECT_EQ(h.memory.kind, MemoryKind::hybrid);
  EXPECT_EQ(h.memory.n_ctx, 512u);
  EXPECT_EQ(h.memory.n_pos_per_embd, 4u);  // M-RoPE: cell records, not the region
  ASSERT_EQ(h.memory.kv_caches.size(), 1u);
  expect_kv_cache(h.memory.kv_caches[0], "kv", 512, 0, SwaType::none, 3, 128);
  ASSERT_TRUE(h.memory.recurrent.has_value());
  const RecurrentShape& rs = *h.memory.recurrent;
  EXPECT_EQ(rs.rs_size, 1u);
  EXPECT_EQ(rs.n_layer, 4u);
  ASSERT_EQ(rs.layers.size(), 3u);
  for (uint32_t il = 0; il < 3; ++il) {
    EXPECT_EQ(rs.layers[il].il, il);
    EXPECT_EQ(rs.layers[il].n_embd_r, 384u);   // (d_conv - 1) x (2 x 2 key heads x 16 + 4 value heads x 16)
    EXPECT_EQ(rs.layers[il].n_embd_s, 1024u);  // 16 x 16 x 4 value heads
  }
  ASSERT_EQ(h.layout.chunks.size(), 2u);
  // The plain example's running hash after two [128, 512] f16 tensors: names are not hashed.
  expect_chunk(h.layout.chunks[0], 0, 262144, 0x05b423ba98441fa1ull);
  expect_chunk(h.layout.chunks[1], 1, 24576, 0xe219213eb239adfdull);
  ASSERT_EQ(h.layout.tensors.size(), 8u);
  expect_tensor(h.layout.tensors[0], "cache_k_l3", 0, 3, TensorKind::k, GgmlType::F16, {128, 512, 1, 1}, 256, 0, 0,
                131072);
  expect_tensor(h.layout.tensors[1], "cache_v_l3", 0, 3, TensorKind::v, GgmlType::F16, {128, 512, 1, 1}, 256, 0, 131072,
                131072);
  for (uint32_t il = 0; il < 3; ++il) {
    expect_tensor(h.layout.tensors[2 + 2 * il], "cache_r_l" + std::to_string(il), 1, il, TensorKind::r, GgmlType::F32,
                  {384, 1, 1, 1}, 1536, 1, 8192 * il, 4096);
    expect_tensor(h.layout.tensors[3 + 2 * il], "cache_s_l" + std::to_string(il), 1, il, TensorKind::s, GgmlType::F32,
                  {1024, 1, 1, 1}, 4096, 1, 8192 * il + 4096, 4096);
  }
}

TEST(LayoutKinds, DecodesTheHybridLfm2VectorWithItsZeroWidthState) {
  const ShareHeader h = parse_vector("layout-hybrid-lfm2.json");
  EXPECT_EQ(h.format_version, 1u);
  EXPECT_EQ(h.model, mkmodel_fingerprint("lfm2", 2, 0x1cebcc261569d082ull));
  expect_dump_params(h.params, 512);
  EXPECT_EQ(h.memory.kind, MemoryKind::hybrid);
  EXPECT_EQ(h.memory.n_pos_per_embd, 1u);
  ASSERT_EQ(h.memory.kv_caches.size(), 1u);
  expect_kv_cache(h.memory.kv_caches[0], "kv", 512, 0, SwaType::none, 1, 64);
  ASSERT_TRUE(h.memory.recurrent.has_value());
  const RecurrentShape& rs = *h.memory.recurrent;
  EXPECT_EQ(rs.rs_size, 1u);
  EXPECT_EQ(rs.n_layer, 2u);
  ASSERT_EQ(rs.layers.size(), 1u);
  EXPECT_EQ(rs.layers[0].il, 0u);
  EXPECT_EQ(rs.layers[0].n_embd_r, 384u);  // n_embd x (l_cache - 1)
  EXPECT_EQ(rs.layers[0].n_embd_s, 0u);    // a short conv keeps no SSM state
  ASSERT_EQ(h.layout.chunks.size(), 2u);
  expect_chunk(h.layout.chunks[0], 0, 131072, 0xdef47d354c70c8a1ull);
  expect_chunk(h.layout.chunks[1], 1, 4096, 0x45d5aa0169942991ull);
  ASSERT_EQ(h.layout.tensors.size(), 4u);
  expect_tensor(h.layout.tensors[0], "cache_k_l1", 0, 1, TensorKind::k, GgmlType::F16, {64, 512, 1, 1}, 128, 0, 0,
                65536);
  expect_tensor(h.layout.tensors[1], "cache_v_l1", 0, 1, TensorKind::v, GgmlType::F16, {64, 512, 1, 1}, 128, 0, 65536,
                65536);
  expect_tensor(h.layout.tensors[2], "cache_r_l0", 1, 0, TensorKind::r, GgmlType::F32, {384, 1, 1, 1}, 1536, 1, 0,
                4096);
  // Listed and hashed, but 0 bytes: it sits at the end of its chunk and takes nothing.
  expect_tensor(h.layout.tensors[3], "cache_s_l0", 1, 0, TensorKind::s, GgmlType::F32, {0, 1, 1, 1}, 0, 1, 4096, 0);
  EXPECT_EQ(h.layout.total_bytes(), 131072u + 4096u);
}

}  // namespace
}  // namespace kvshare::layout
