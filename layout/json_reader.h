// Reading the fields of a parsed JSON object with errors that name the message and the field,
// never throwing: the control channels' messages (layout/receiver_message.h,
// kvshare/share/provider_protocol.h) read their fields through it.
#pragma once

#include <cerrno>
#include <cstdint>
#include <string>
#include <string_view>

#include "layout/error.h"

namespace kvshare::layout {

// What an `"ok": false` reply of a control channel carries: an errno and a sentence.
struct ChannelRefusal {
  int error_errno = 0;
  std::string error;
};

// `Json` is nlohmann::json or nlohmann::ordered_json; `source` names the message in errors.
template <class Json>
struct JsonReader {
  const Json& json;
  std::string_view source;

  const Json* find(std::string_view key) const {
    auto it = json.find(key);
    return it == json.end() ? nullptr : &*it;
  }
  Result<uint64_t> u64(std::string_view key) const {
    const auto* value = find(key);
    if (value == nullptr) return fail(EINVAL, "{}: no \"{}\"", source, key);
    if (!value->is_number_unsigned())
      return fail(EINVAL, "{}: \"{}\" is {}, not an unsigned integer", source, key, value->dump());
    return value->template get<uint64_t>();
  }
  Result<uint32_t> u32(std::string_view key) const {
    auto value = u64(key);
    if (!value) return fail(value.error());
    if (*value > UINT32_MAX) return fail(EINVAL, "{}: \"{}\" is {}, past 2^32-1", source, key, *value);
    return static_cast<uint32_t>(*value);
  }
  Result<std::string> text(std::string_view key) const {
    const auto* value = find(key);
    if (value == nullptr) return fail(EINVAL, "{}: no \"{}\"", source, key);
    if (!value->is_string()) return fail(EINVAL, "{}: \"{}\" is {}, not a string", source, key, value->dump());
    return value->template get<std::string>();
  }
  Result<bool> boolean(std::string_view key) const {
    const auto* value = find(key);
    if (value == nullptr) return fail(EINVAL, "{}: no \"{}\"", source, key);
    if (!value->is_boolean()) return fail(EINVAL, "{}: \"{}\" is {}, not true or false", source, key, value->dump());
    return value->template get<bool>();
  }
  // "errno" (1..4095) and "error" of a refusal.
  Result<ChannelRefusal> refusal() const {
    auto error_errno = u32("errno");
    if (!error_errno) return fail(error_errno.error());
    auto error = text("error");
    if (!error) return fail(error.error());
    if (*error_errno == 0 || *error_errno > 4095)
      return fail(EINVAL, "{}: \"errno\" is {}, not an errno value 1..4095", source, *error_errno);
    return ChannelRefusal{static_cast<int>(*error_errno), std::move(*error)};
  }
  Result<double> number(std::string_view key) const {
    const auto* value = find(key);
    if (value == nullptr) return fail(EINVAL, "{}: no \"{}\"", source, key);
    if (!value->is_number()) return fail(EINVAL, "{}: \"{}\" is {}, not a number", source, key, value->dump());
    return value->template get<double>();
  }
};

template <class Json>
JsonReader(const Json&, std::string_view) -> JsonReader<Json>;

}  // namespace kvshare::layout
