// Fuzzes the sequence-state file decoder: any bytes give a layout or an error naming the
// offset, never a crash, an out-of-bounds read or an allocation beyond the input's size.
// Valid inputs are also decoded against a fixed shape and their rows dequantized.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvshare/statefile/state_file_reader.h"
#include "layout/memory_shape.h"
#include "layout/state_format.h"

namespace {

kvshare::layout::MemoryShape dense_expectation() {
  using namespace kvshare::layout;
  MemoryShape shape;
  shape.kind = MemoryKind::kv;
  KvCacheShape cache;
  cache.role = "kv";
  cache.kv_size = 512;
  cache.layers = {KvCacheLayer{0, 128, 128, true}, KvCacheLayer{1, 128, 128, true}};
  shape.kv_caches.push_back(cache);
  return shape;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const kvshare::layout::MemoryShape expect = dense_expectation();
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data),
                               reinterpret_cast<const std::byte*>(data) + size);
  (void)kvshare::layout::decode_state_layout(bytes, &expect, "fuzz.bin");
  auto file = kvshare::statefile::parse_state_bytes(std::move(bytes), nullptr, "fuzz.bin");
  if (!file) return 0;
  for (const auto* section : file->sections()) {
    if (uint64_t{section->n_rows} * section->n_embd > (uint64_t{1} << 24)) continue;  // bounded work per input
    (void)file->rows_f32(*section);
  }
  (void)kvshare::layout::memory_shape_from_layout(file->layout());
  // Moving a decoded layout to the other generation must keep its offsets consistent.
  kvshare::layout::StateLayout other = file->layout();
  if (kvshare::layout::set_state_version(other, other.version == 2 ? 3 : 2)) {
    if (other.token_form == kvshare::layout::StateTokenForm::ids && other.n_token != other.n_prompt_ids)
      __builtin_trap();
  }
  return 0;
}
