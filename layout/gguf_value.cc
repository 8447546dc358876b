#include "layout/gguf_value.h"

#include <cerrno>
#include <cstring>

namespace kvshare::layout {

std::string_view gguf_value_type_name(GgufValueType type) {
  // ggml's GGUF_TYPE_NAME (gguf.cpp), so our messages read like llama.cpp's.
  switch (type) {
    case GgufValueType::UINT8:
      return "u8";
    case GgufValueType::INT8:
      return "i8";
    case GgufValueType::UINT16:
      return "u16";
    case GgufValueType::INT16:
      return "i16";
    case GgufValueType::UINT32:
      return "u32";
    case GgufValueType::INT32:
      return "i32";
    case GgufValueType::FLOAT32:
      return "f32";
    case GgufValueType::BOOL:
      return "bool";
    case GgufValueType::STRING:
      return "str";
    case GgufValueType::ARRAY:
      return "arr";
    case GgufValueType::UINT64:
      return "u64";
    case GgufValueType::INT64:
      return "i64";
    case GgufValueType::FLOAT64:
      return "f64";
  }
  return "unknown";
}

namespace {

// "u32", or "arr[i32]" for an array, as messages name a stored type.
std::string describe_type(const GgufValue& value) {
  if (const auto* array = value.get_if<GgufArray>())
    return fmt::format("arr[{}]", gguf_value_type_name(array->element_type));
  return std::string(gguf_value_type_name(value.type()));
}

template <class T>
Result<T> get_exact(const GgufMetadata& metadata, std::string_view key, GgufValueType expected) {
  const GgufValue* value = metadata.find(key);
  if (value == nullptr) return fail(ENOENT, "GGUF key \"{}\" not found", key);
  if (const T* typed = value->get_if<T>()) return *typed;
  // Same words as llama_model_loader's "key %s has wrong type %s but expected type %s".
  return fail(EINVAL, "GGUF key \"{}\" has wrong type {} but expected type {}", key, describe_type(*value),
              gguf_value_type_name(expected));
}

template <class T>
Result<std::optional<T>> find_exact(const GgufMetadata& metadata, std::string_view key, GgufValueType expected) {
  if (!metadata.contains(key)) return std::optional<T>();
  auto value = get_exact<T>(metadata, key, expected);
  if (!value) return fail(value.error());
  return std::optional<T>(*value);
}

}  // namespace

void GgufMetadata::set(std::string key, GgufValue value) {
  for (auto& entry : entries_) {
    if (entry.first == key) {
      entry.second = std::move(value);
      return;
    }
  }
  entries_.emplace_back(std::move(key), std::move(value));
}

const GgufValue* GgufMetadata::find(std::string_view key) const {
  for (const auto& entry : entries_)
    if (entry.first == key) return &entry.second;
  return nullptr;
}

Result<uint32_t> GgufMetadata::get_u32(std::string_view key) const {
  return get_exact<uint32_t>(*this, key, GgufValueType::UINT32);
}
Result<float> GgufMetadata::get_f32(std::string_view key) const {
  return get_exact<float>(*this, key, GgufValueType::FLOAT32);
}
Result<bool> GgufMetadata::get_bool(std::string_view key) const {
  return get_exact<bool>(*this, key, GgufValueType::BOOL);
}
Result<std::string> GgufMetadata::get_string(std::string_view key) const {
  return get_exact<std::string>(*this, key, GgufValueType::STRING);
}

Result<const GgufArray*> GgufMetadata::get_array(std::string_view key) const {
  const GgufValue* value = find(key);
  if (value == nullptr) return fail(ENOENT, "GGUF key \"{}\" not found", key);
  if (const auto* array = value->get_if<GgufArray>()) return array;
  return fail(EINVAL, "GGUF key \"{}\" has wrong type {} but expected type arr", key, describe_type(*value));
}

Result<std::optional<uint32_t>> GgufMetadata::find_u32(std::string_view key) const {
  return find_exact<uint32_t>(*this, key, GgufValueType::UINT32);
}
Result<std::optional<float>> GgufMetadata::find_f32(std::string_view key) const {
  return find_exact<float>(*this, key, GgufValueType::FLOAT32);
}

Result<std::optional<std::vector<uint32_t>>> GgufMetadata::find_per_layer(std::string_view key,
                                                                          uint32_t n_layer) const {
  using PerLayer = std::optional<std::vector<uint32_t>>;
  const GgufValue* value = find(key);
  if (value == nullptr) return PerLayer();
  const auto* array = value->get_if<GgufArray>();
  if (array == nullptr) {
    // Mirrors llama_model_loader::get_key_or_arr: a scalar goes through get_key<uint32_t>,
    // which takes exactly UINT32 (an INT32 scalar is "wrong type" there too).
    const auto* scalar = value->get_if<uint32_t>();
    if (scalar == nullptr)
      return fail(EINVAL, "GGUF key \"{}\" has wrong type {} but expected type u32 or an array of {} u32", key,
                  describe_type(*value), n_layer);
    return PerLayer(std::vector<uint32_t>(n_layer, *scalar));
  }
  if (array->elements.size() != n_layer)
    return fail(EINVAL, "GGUF key \"{}\" has wrong array length; expected {}, got {}", key, n_layer,
                array->elements.size());
  std::vector<uint32_t> per_layer;
  per_layer.reserve(n_layer);
  for (const GgufValue& element : array->elements) {
    if (const auto* u = element.get_if<uint32_t>()) {
      per_layer.push_back(*u);
    } else if (const auto* i = element.get_if<int32_t>()) {
      // llama.cpp copies INT32 elements bit for bit into its uint32_t array.
      per_layer.push_back(static_cast<uint32_t>(*i));
    } else if (const auto* b = element.get_if<bool>()) {
      per_layer.push_back(*b ? 1u : 0u);
    } else {
      return fail(EINVAL, "GGUF key \"{}\" is an array of {}, expected bool, i32 or u32 elements", key,
                  gguf_value_type_name(element.type()));
    }
  }
  return PerLayer(std::move(per_layer));
}

}  // namespace kvshare::layout
