// Fuzzes the GGUF reader: any bytes give a parsed file or an error, never a crash, a hang
// or an allocation the input cannot justify. On success every value and every tensor's
// data is walked, and the file is re-encoded, so a parse that lies about bounds shows up.
#include <cstddef>
#include <cstdint>
#include <span>
#include <variant>

#include "layout/gguf_reader.h"
#include "layout/gguf_writer.h"

namespace {

size_t walk(const kvshare::layout::GgufValue& value) {
  size_t n = 1;
  if (const auto* text = value.get_if<std::string>()) n += text->size();
  if (const auto* array = value.get_if<kvshare::layout::GgufArray>())
    for (const auto& element : array->elements) n += walk(element);
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvshare::layout;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto file = parse_gguf(bytes, "fuzz.gguf");
  if (!file) return 0;
  volatile size_t sink = 0;
  for (const auto& [key, value] : file->metadata.entries()) sink = sink + key.size() + walk(value);
  uint8_t checksum = 0;
  for (const GgufTensorInfo& tensor : file->tensors) {
    auto tensor_bytes = tensor_data(*file, tensor);
    if (!tensor_bytes) continue;
    for (std::byte b : *tensor_bytes) checksum = static_cast<uint8_t>(checksum ^ static_cast<uint8_t>(b));
  }
  sink = sink + checksum;
  // Re-encoding a parsed file must work and give a file that parses again (only when the
  // data is small, so the fuzzer does not spend its time copying).
  if (file->data_size < (1u << 20)) {
    auto writer = GgufWriter::from_file(*file);
    if (!writer) __builtin_trap();
    const auto payload = file->has_tensor_data() ? GgufPayload::kWithData : GgufPayload::kMetaOnly;
    auto again = writer->finish(payload);
    if (!again) __builtin_trap();
    if (!parse_gguf(*again, "again.gguf")) __builtin_trap();
  }
  return 0;
}
