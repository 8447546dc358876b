// Fuzzes the remote state payload's reader: any bytes give a payload or an error, never a
// crash, a hang or an unbounded allocation. A payload that parses must re-encode to bytes
// that parse to the same binding and state again.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "layout/remote_state_payload.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto payload = kvshare::layout::parse_remote_state(bytes, "fuzz");
  if (!payload) return 0;
  const std::vector<std::byte> again = kvshare::layout::encode_remote_state(payload->binding, payload->state);
  auto reparsed = kvshare::layout::parse_remote_state(again, "fuzz re-encode");
  if (!reparsed || !(reparsed->binding == payload->binding) || reparsed->state.size() != payload->state.size())
    std::abort();
  if (!kvshare::layout::check_binding(payload->binding, reparsed->binding, "fuzz")) std::abort();
  return 0;
}
