// Reading the fields of a parsed JSON object with errors that name the message and the field,
// never throwing: the one reader of "field X of type T, or say which field is wrong". The
// control channels' messages (layout/receiver_message.h, kvshare/share/provider_protocol.h),
// the share handshake (kvshare/handshake/message.h) and the reference decoder's completion
// fields (apps/decoder/completion.h) read their fields through it.
#pragma once

#include <cerrno>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "layout/error.h"

namespace kvshare::layout {

// What an `"ok": false` reply of a control channel carries: an errno and a sentence.
struct ChannelRefusal {
  int error_errno = 0;
  std::string error;
};

// `Json` is nlohmann::json or nlohmann::ordered_json; `source` names the message in errors,
// `path` is put before every key there (a nested object's place: "fds[1].").
template <class Json>
struct JsonReader {
  const Json& json;
  std::string_view source;
  std::string_view path = {};
  // A null value reads as absent (llama-server's server-schema.cpp has_value: an HTTP
  // client sends null to ask for the default); otherwise null is a value of the wrong type.
  bool null_is_absent = false;

  const Json* find(std::string_view key) const {
    auto it = json.find(key);
    if (it == json.end() || (null_is_absent && it->is_null())) return nullptr;
    return &*it;
  }
  // The value of `key`, of any type.
  Result<const Json*> value(std::string_view key) const {
    const auto* value = find(key);
    if (value == nullptr) return fail(EINVAL, "{}: no \"{}{}\"", source, path, key);
    return value;
  }
  Result<uint64_t> u64(std::string_view key) const {
    return typed<uint64_t>(key, &Json::is_number_unsigned, "an unsigned integer");
  }
  Result<uint64_t> u64(std::string_view key, uint64_t max) const {
    auto value = u64(key);
    if (!value) return fail(value.error());
    if (*value > max) return fail(EINVAL, "{}: \"{}{}\" is {}, not an integer 0..{}", source, path, key, *value, max);
    return *value;
  }
  Result<uint32_t> u32(std::string_view key) const {
    auto value = u64(key);
    if (!value) return fail(value.error());
    if (*value > UINT32_MAX) return fail(EINVAL, "{}: \"{}{}\" is {}, past 2^32-1", source, path, key, *value);
    return static_cast<uint32_t>(*value);
  }
  Result<std::string> text(std::string_view key) const { return typed<std::string>(key, &Json::is_string, "a string"); }
  Result<bool> boolean(std::string_view key) const { return typed<bool>(key, &Json::is_boolean, "true or false"); }
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
  Result<double> number(std::string_view key) const { return typed<double>(key, &Json::is_number, "a number"); }

  // The same readers for a field that may be absent: nullopt then, an error only for a
  // present value of the wrong type or range.
  Result<std::optional<uint64_t>> optional_u64(std::string_view key, uint64_t max) const {
    return optional(key, [&] { return u64(key, max); });
  }
  Result<std::optional<bool>> optional_boolean(std::string_view key) const {
    return optional(key, [&] { return boolean(key); });
  }
  Result<std::optional<double>> optional_number(std::string_view key) const {
    return optional(key, [&] { return number(key); });
  }

 private:
  // Invalid UTF-8 in a peer's string must not make an error message throw.
  static std::string dump(const Json& value) { return value.dump(-1, ' ', false, Json::error_handler_t::replace); }

  // The value of `key` as a T when `is` says it has that type; else the error naming it.
  template <class T>
  Result<T> typed(std::string_view key, bool (Json::*is)() const noexcept, std::string_view expected) const {
    auto value = this->value(key);
    if (!value) return fail(value.error());
    if (!((*value)->*is)())
      return fail(EINVAL, "{}: \"{}{}\" is {}, not {}", source, path, key, dump(**value), expected);
    return (*value)->template get<T>();
  }

  template <class Read>
  auto optional(std::string_view key, Read read) const -> Result<std::optional<typename decltype(read())::value_type>> {
    if (find(key) == nullptr) return std::nullopt;
    auto value = read();
    if (!value) return fail(value.error());
    return std::optional(std::move(*value));
  }
};

template <class Json>
JsonReader(const Json&, std::string_view) -> JsonReader<Json>;
template <class Json>
JsonReader(const Json&, std::string_view, std::string_view) -> JsonReader<Json>;
template <class Json>
JsonReader(const Json&, std::string_view, std::string_view, bool) -> JsonReader<Json>;

}  // namespace kvshare::layout
