// The provider's side of a grant with a cached prefix, in one process: RemotePrefiller
// prefills the whole prompt and sends only positions n_cached..n-1, into cells
// first_cell + p of the offer's stream, of a RemoteReceiver over arrays (UCX tcp loopback).
// Those rows are byte-equal to the same positions of a whole-prompt send; the cached
// positions' cells are never written.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "apps/provider/remote_prefill.h"
#include "kvshare/remote/remote_receiver.h"
#include "layout/remote_grant.h"
#include "layout/share_header.h"
#include "refmodel/engine.h"
#include "refmodel/model_generator.h"

namespace kvshare::refmodel {
namespace {

// flash_attn false: a transposed V, sent as one slice per element row of the stream.
void check_granted_send(bool flash_attn) {
  ::setenv("UCX_TLS", "tcp", 0);
  GeneratorOptions options;
  options.residual_gain = 3.0f;  // later layers' K/V depend on the attention over earlier cells
  auto bytes = generate_model_bytes(options);
  ASSERT_TRUE(bytes) << bytes.error().what();
  char dir_template[] = "/tmp/kvshare-remote-prefill-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::filesystem::path dir = dir_template;
  const auto path = dir / "tiny.gguf";
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  auto prefiller = RemotePrefiller::load(path.string(), 1);
  auto model = Model::from_gguf(*bytes, nullptr, "generated");
  std::filesystem::remove_all(dir);  // the prefiller mapped it already
  ASSERT_TRUE(prefiller) << prefiller.error().what();
  ASSERT_TRUE(model) << model.error().what();
  // -np 4 without --kv-unified: 4 streams of 256 cells.
  layout::KvParams params;
  params.n_ctx = 1024;
  params.flash_attn = flash_attn;
  params.n_seq_max = 4;
  params.kv_unified = false;
  auto header = layout::make_share_header(layout::model_fingerprint((*model)->metadata(), (*model)->tensor_infos()),
                                          (*model)->shape(), params);
  ASSERT_TRUE(header) << header.error().what();
  std::vector<std::vector<std::byte>> chunks;
  for (const auto& chunk : header->layout.chunks) chunks.emplace_back(chunk.size_bytes, std::byte{0});
  auto receiver = remote::RemoteReceiver::start(
      *header, std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()), [](const std::string&) {});
  if (!receiver && receiver.error().errno_value() == ENOTSUP) GTEST_SKIP() << receiver.error().what();
  ASSERT_TRUE(receiver) << receiver.error().what();

  std::vector<int32_t> tokens;
  for (int i = 0; i < 20; ++i) tokens.push_back((i * 37 + 5) % (*model)->tokenizer().n_vocab());
  // The whole prompt into stream 0 from cell 0, then the same prompt with its first 8
  // positions cached, placed from cell 50 of stream 2.
  auto whole = (*receiver)->grant({.stream = 0, .first_cell = 0, .n_cached = 0, .n_cells = 20});
  auto part = (*receiver)->grant({.stream = 2, .first_cell = 50, .n_cached = 8, .n_cells = 20});
  ASSERT_TRUE(whole && part);
  auto sent_whole = (*prefiller)->run(tokens, *whole);
  ASSERT_TRUE(sent_whole) << sent_whole.error().what();
  auto sent_part = (*prefiller)->run(tokens, *part);
  ASSERT_TRUE(sent_part) << sent_part.error().what();
  EXPECT_EQ(sent_whole->n_sent, 20u);
  EXPECT_EQ(sent_part->n_tokens, 20u);
  EXPECT_EQ(sent_part->n_sent, 12u);
  EXPECT_EQ(sent_part->bytes_sent, part->bytes);
  ASSERT_TRUE((*receiver)->complete(whole->share_id, 20));
  ASSERT_TRUE((*receiver)->complete(part->share_id, 20));

  const layout::ShareLayout& share_layout = header->layout;
  const layout::MemoryShape& memory = header->memory;
  auto bytes_of = [&](const layout::ChunkRange& r) { return chunks[r.chunk].data() + r.offset; };
  for (const auto& layer : memory.kv_caches[0].layers) {
    const auto reference = layout::cell_ranges(share_layout, memory, layer.il, 0, 8, 20);
    const auto placed = layout::cell_ranges(share_layout, memory, layer.il, 2, 58, 70);
    ASSERT_EQ(reference.size(), placed.size());
    for (size_t i = 0; i < placed.size(); ++i) {
      ASSERT_EQ(reference[i].size_bytes, placed[i].size_bytes);
      EXPECT_EQ(std::memcmp(bytes_of(reference[i]), bytes_of(placed[i]), placed[i].size_bytes), 0)
          << "layer " << layer.il << " range " << i;
    }
    // The cached positions' cells and the cell after the prompt were not written.
    for (const auto& untouched : {layout::cell_ranges(share_layout, memory, layer.il, 2, 50, 58),
                                  layout::cell_ranges(share_layout, memory, layer.il, 2, 70, 71)})
      for (const auto& r : untouched)
        for (uint64_t b = 0; b < r.size_bytes; ++b) ASSERT_EQ(bytes_of(r)[b], std::byte{0}) << "layer " << layer.il;
  }
}

TEST(RemotePrefillGrant, SendsOnlyTheGrantedPositionsIntoTheOffersStreamAndCells) { check_granted_send(true); }

TEST(RemotePrefillGrant, SendsOnlyTheGrantedPositionsOfATransposedV) { check_granted_send(false); }

}  // namespace
}  // namespace kvshare::refmodel
