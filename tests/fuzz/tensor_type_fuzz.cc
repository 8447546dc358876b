// Fuzzes the cache-type parser: any string gives a type or an error, never a crash.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "layout/tensor_type.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto result = kvshare::layout::parse_cache_type(text);
  if (result) (void)kvshare::layout::ggml_row_size(*result, 256);
  return 0;
}
