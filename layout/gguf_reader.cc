#include "layout/gguf_reader.h"

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <unordered_set>

namespace kvshare::layout {

// GGUF is written in host order and every host we build for is little-endian; a
// byte-swapped file is caught by the version check, as in ggml.
static_assert(std::endian::native == std::endian::little, "the GGUF reader assumes a little-endian host");

namespace {

// What is being read, for messages: the header, key #3 / key "general.name",
// tensor #0 / tensor "token_embd.weight".
struct Where {
  enum class Part { kHeader, kKey, kTensor } part = Part::kHeader;
  uint64_t index = 0;
  std::string_view name;  // empty until read

  std::string describe() const {
    switch (part) {
      case Part::kHeader:
        return "header";
      case Part::kKey:
        return name.empty() ? fmt::format("key #{}", index) : fmt::format("key \"{}\"", name);
      case Part::kTensor:
        return name.empty() ? fmt::format("tensor #{}", index) : fmt::format("tensor \"{}\"", name);
    }
    return "?";
  }
};

// Bytes a value of `type` takes at least: the fixed size, 8 for a string's length, and
// 4 + 8 for an array's element type and count. Bounds counts before anything is reserved.
uint64_t min_value_bytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::UINT8:
    case GgufValueType::INT8:
    case GgufValueType::BOOL:
      return 1;
    case GgufValueType::UINT16:
    case GgufValueType::INT16:
      return 2;
    case GgufValueType::UINT32:
    case GgufValueType::INT32:
    case GgufValueType::FLOAT32:
      return 4;
    case GgufValueType::UINT64:
    case GgufValueType::INT64:
    case GgufValueType::FLOAT64:
      return 8;
    case GgufValueType::STRING:
      return 8;
    case GgufValueType::ARRAY:
      return 12;
  }
  return 1;
}

// The smallest key/value pair (a one-byte key and a u8 value) and tensor info (empty
// name, n_dims 0): a count larger than remaining/min cannot be honest.
constexpr uint64_t kMinKeyValueBytes = 8 + 1 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;

class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, std::string_view file_name) : bytes_(bytes), file_name_(file_name) {}

  size_t offset() const { return offset_; }
  size_t remaining() const { return bytes_.size() - offset_; }

  template <class... Args>
  tl::unexpected<Error> error_at(size_t at, const Where& where, fmt::format_string<Args...> format,
                                 Args&&... args) const {
    return fail(EINVAL, "GGUF {}: {}: {} at byte offset {}", file_name_, where.describe(),
                fmt::format(format, std::forward<Args>(args)...), at);
  }

  // A fixed-size little-endian field; `field` names it in the truncation message.
  template <class T>
  Result<T> read(const Where& where, std::string_view field) {
    if (remaining() < sizeof(T))
      return error_at(offset_, where, "file ends inside {} ({} bytes needed, {} left)", field, sizeof(T), remaining());
    T value;
    std::memcpy(&value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }

  // A u64 length and that many bytes, as a view into the image.
  Result<std::string_view> read_string(const Where& where, std::string_view field) {
    const size_t at = offset_;
    // Not read<uint64_t>: its field name would be formatted for every string of a vocabulary.
    if (remaining() < sizeof(uint64_t))
      return error_at(offset_, where, "file ends inside the length of {} (8 bytes needed, {} left)", field,
                      remaining());
    auto length = read<uint64_t>(where, field);
    if (!length) return fail(length.error());
    if (*length > kGgufMaxStringLength)
      return error_at(at, where, "{} length {} exceeds the GGUF maximum of {} bytes", field, *length,
                      kGgufMaxStringLength);
    if (*length > remaining())
      return error_at(at, where, "{} length {} runs past the end of the file ({} bytes left)", field, *length,
                      remaining());
    std::string_view text(reinterpret_cast<const char*>(bytes_.data() + offset_), static_cast<size_t>(*length));
    offset_ += static_cast<size_t>(*length);
    return text;
  }

  bool seek(size_t to) {
    if (to > bytes_.size()) return false;
    offset_ = to;
    return true;
  }

 private:
  std::span<const std::byte> bytes_;
  std::string_view file_name_;
  size_t offset_ = 0;
};

Result<GgufValueType> read_value_type(Cursor& in, const Where& where, std::string_view field) {
  const size_t at = in.offset();
  auto id = in.read<int32_t>(where, field);
  if (!id) return fail(id.error());
  if (*id < 0 || *id > static_cast<int32_t>(GgufValueType::FLOAT64))
    return in.error_at(at, where, "invalid GGUF value type id {} in {} (valid ids are 0 to 12)", *id, field);
  return static_cast<GgufValueType>(*id);
}

// One non-array value of `type`.
Result<GgufValue> read_scalar(Cursor& in, GgufValueType type, const Where& where) {
  auto wrap = [](auto result) -> Result<GgufValue> {
    if (!result) return fail(result.error());
    return GgufValue{GgufValue::Storage(*result)};
  };
  switch (type) {
    case GgufValueType::UINT8:
      return wrap(in.read<uint8_t>(where, "a u8 value"));
    case GgufValueType::INT8:
      return wrap(in.read<int8_t>(where, "an i8 value"));
    case GgufValueType::UINT16:
      return wrap(in.read<uint16_t>(where, "a u16 value"));
    case GgufValueType::INT16:
      return wrap(in.read<int16_t>(where, "an i16 value"));
    case GgufValueType::UINT32:
      return wrap(in.read<uint32_t>(where, "a u32 value"));
    case GgufValueType::INT32:
      return wrap(in.read<int32_t>(where, "an i32 value"));
    case GgufValueType::FLOAT32:
      return wrap(in.read<float>(where, "an f32 value"));
    case GgufValueType::UINT64:
      return wrap(in.read<uint64_t>(where, "a u64 value"));
    case GgufValueType::INT64:
      return wrap(in.read<int64_t>(where, "an i64 value"));
    case GgufValueType::FLOAT64:
      return wrap(in.read<double>(where, "an f64 value"));
    case GgufValueType::BOOL: {
      // ggml reads an int8 and takes any non-zero byte as true.
      auto byte = in.read<int8_t>(where, "a bool value");
      if (!byte) return fail(byte.error());
      return GgufValue{GgufValue::Storage(*byte != 0)};
    }
    case GgufValueType::STRING: {
      auto text = in.read_string(where, "a string value");
      if (!text) return fail(text.error());
      return GgufValue{GgufValue::Storage(std::string(*text))};
    }
    case GgufValueType::ARRAY:
      break;
  }
  return in.error_at(in.offset(), where, "an array cannot be read as a scalar");
}

Result<GgufValue> read_array(Cursor& in, const Where& where) {
  const size_t type_at = in.offset();
  auto element_type = read_value_type(in, where, "the array element type");
  if (!element_type) return fail(element_type.error());
  if (*element_type == GgufValueType::ARRAY)
    return in.error_at(type_at, where, "arrays of arrays are not valid GGUF (ggml refuses them)");
  const size_t count_at = in.offset();
  auto count = in.read<uint64_t>(where, "the array length");
  if (!count) return fail(count.error());
  if (*count > kGgufMaxArrayElements)
    return in.error_at(count_at, where, "array of {} elements exceeds the GGUF maximum of {}", *count,
                       kGgufMaxArrayElements);
  const uint64_t min_bytes = min_value_bytes(*element_type);
  if (*count > in.remaining() / min_bytes)
    return in.error_at(count_at, where, "array of {} {} elements needs at least {} bytes, {} left", *count,
                       gguf_value_type_name(*element_type), *count * min_bytes, in.remaining());
  GgufArray array;
  array.element_type = *element_type;
  array.elements.reserve(static_cast<size_t>(*count));
  for (uint64_t i = 0; i < *count; ++i) {
    auto element = read_scalar(in, *element_type, where);
    if (!element) return fail(element.error());
    array.elements.push_back(std::move(*element));
  }
  return GgufValue{GgufValue::Storage(std::move(array))};
}

Result<uint32_t> read_version(Cursor& in) {
  const Where where;
  auto version = in.read<uint32_t>(where, "the version");
  if (!version) return fail(version.error());
  // Checks and their order as in gguf_init_from_reader.
  if (*version == 0) return in.error_at(4, where, "bad GGUF version 0");
  if ((*version & 0xFFFFu) == 0)
    return in.error_at(4, where,
                       "GGUF version {:#x} is absurdly large: the file was written on a host of the other "
                       "endianness",
                       *version);
  if (*version == 1)
    return in.error_at(4, where, "GGUF version 1 is no longer supported (32-bit counts); re-convert the model");
  if (*version > kGgufVersion)
    return in.error_at(4, where, "GGUF version {} is newer than the newest supported, {}", *version, kGgufVersion);
  return *version;
}

Result<uint64_t> read_count(Cursor& in, std::string_view field, uint64_t min_item_bytes) {
  const Where where;
  const size_t at = in.offset();
  auto count = in.read<int64_t>(where, field);
  if (!count) return fail(count.error());
  if (*count < 0) return in.error_at(at, where, "{} is {}, must not be negative", field, *count);
  // The items follow the other count; the remaining bytes are an upper bound either way.
  if (static_cast<uint64_t>(*count) > in.remaining() / min_item_bytes)
    return in.error_at(at, where, "{} is {}, but the {} bytes left hold at most {}", field, *count, in.remaining(),
                       in.remaining() / min_item_bytes);
  return static_cast<uint64_t>(*count);
}

// `key_at`: where the general.alignment key starts, for messages.
Result<uint64_t> read_alignment(const GgufMetadata& metadata, Cursor& in, size_t key_at) {
  const GgufValue* value = metadata.find(kGgufAlignmentKey);
  if (value == nullptr) return kGgufDefaultAlignment;
  Where where{Where::Part::kKey, 0, kGgufAlignmentKey};
  // ggml reads it with gguf_get_val_u32, which aborts on any other type: refuse instead.
  const auto* alignment = value->get_if<uint32_t>();
  if (alignment == nullptr)
    return in.error_at(key_at, where, "has type {}, must be u32", gguf_value_type_name(value->type()));
  if (*alignment == 0 || (*alignment & (*alignment - 1)) != 0)
    return in.error_at(key_at, where, "alignment {} is not a power of 2", *alignment);
  return *alignment;
}

// One tensor info record; `names` holds the names seen so far (views into the image).
Result<GgufTensorInfo> read_tensor_info(Cursor& in, uint64_t index, std::unordered_set<std::string_view>& names,
                                        size_t& offset_field_at) {
  Where where{Where::Part::kTensor, index, {}};
  const size_t name_at = in.offset();
  auto name = in.read_string(where, "the tensor name");
  if (!name) return fail(name.error());
  where.name = *name;
  if (name->size() > kGgufMaxTensorNameLength)
    return in.error_at(name_at, where, "name is {} bytes, longer than ggml's limit of {}", name->size(),
                       kGgufMaxTensorNameLength);
  if (!names.insert(*name).second) return in.error_at(name_at, where, "duplicate tensor name");

  GgufTensorInfo info;
  info.name = std::string(*name);
  const size_t dims_at = in.offset();
  auto n_dims = in.read<uint32_t>(where, "n_dims");
  if (!n_dims) return fail(n_dims.error());
  if (*n_dims > kGgufMaxDims) return in.error_at(dims_at, where, "n_dims is {}, at most {}", *n_dims, kGgufMaxDims);
  info.n_dims = *n_dims;
  for (uint32_t j = 0; j < *n_dims; ++j) {
    const size_t ne_at = in.offset();
    static constexpr std::string_view kNeNames[kGgufMaxDims] = {"ne[0]", "ne[1]", "ne[2]", "ne[3]"};
    auto ne = in.read<int64_t>(where, kNeNames[j]);
    if (!ne) return fail(ne.error());
    if (*ne < 0) return in.error_at(ne_at, where, "ne[{}] is {}, must not be negative", j, *ne);
    info.ne[j] = *ne;
  }
  int64_t n_elements = 1;
  for (int64_t ne : info.ne) {
    // ggml requires the element count to stay below INT64_MAX (it divides by ne[j]
    // there, which a zero dimension turns into a crash; we multiply instead).
    if (__builtin_mul_overflow(n_elements, ne, &n_elements) || n_elements == std::numeric_limits<int64_t>::max())
      return in.error_at(dims_at, where, "shape ({}, {}, {}, {}) has more than INT64_MAX elements", info.ne[0],
                         info.ne[1], info.ne[2], info.ne[3]);
  }

  const size_t type_at = in.offset();
  auto type_id = in.read<int32_t>(where, "the ggml type");
  if (!type_id) return fail(type_id.error());
  const auto traits = ggml_type_traits(*type_id);
  if (!traits) return in.error_at(type_at, where, "invalid ggml type id {}", *type_id);
  info.type = static_cast<GgmlType>(*type_id);
  auto nbytes = gguf_tensor_nbytes(info.type, info.ne);
  if (!nbytes) return in.error_at(type_at, where, "{}", nbytes.error().message());
  info.size_bytes = *nbytes;

  offset_field_at = in.offset();
  auto offset = in.read<uint64_t>(where, "the data offset");
  if (!offset) return fail(offset.error());
  info.offset = *offset;
  return info;
}

}  // namespace

const GgufTensorInfo* GgufFile::find_tensor(std::string_view tensor_name) const {
  for (const auto& tensor : tensors)
    if (tensor.name == tensor_name) return &tensor;
  return nullptr;
}

Result<uint64_t> gguf_tensor_nbytes(GgmlType type, const std::array<int64_t, 4>& ne) {
  const auto traits = ggml_type_traits(static_cast<int32_t>(type));
  if (!traits) return fail(EINVAL, "invalid ggml type id {}", static_cast<int32_t>(type));
  for (size_t j = 0; j < ne.size(); ++j)
    if (ne[j] < 0) return fail(EINVAL, "ne[{}] is {}, must not be negative", j, ne[j]);
  if (ne[0] % traits->block_size != 0)
    return fail(EINVAL, "type {} has {} elements per row, not a multiple of its block size {}", traits->name, ne[0],
                traits->block_size);
  uint64_t nbytes = static_cast<uint64_t>(ne[0] / traits->block_size);
  bool overflow = __builtin_mul_overflow(nbytes, static_cast<uint64_t>(traits->type_size), &nbytes);
  for (size_t j = 1; j < ne.size(); ++j)
    overflow |= __builtin_mul_overflow(nbytes, static_cast<uint64_t>(ne[j]), &nbytes);
  if (overflow)
    return fail(EINVAL, "shape ({}, {}, {}, {}) of type {} is more than 2^64 bytes", ne[0], ne[1], ne[2], ne[3],
                traits->name);
  return nbytes;
}

Result<GgufFile> parse_gguf(std::span<const std::byte> bytes, std::string_view name) {
  Cursor in(bytes, name);
  const Where header;
  GgufFile file;
  file.name = std::string(name);
  file.data = bytes;

  auto magic = in.read<uint32_t>(header, "the magic");
  if (!magic) return fail(magic.error());
  if (std::memcmp(bytes.data(), "GGUF", 4) != 0) {
    auto shown = [](std::byte b) {
      const auto c = static_cast<unsigned char>(b);
      return c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
    };
    return in.error_at(0, header, "invalid magic '{}{}{}{}', expected 'GGUF'", shown(bytes[0]), shown(bytes[1]),
                       shown(bytes[2]), shown(bytes[3]));
  }
  auto version = read_version(in);
  if (!version) return fail(version.error());
  file.version = *version;
  auto n_tensors = read_count(in, "n_tensors", kMinTensorInfoBytes);
  if (!n_tensors) return fail(n_tensors.error());
  auto n_kv = read_count(in, "n_kv", kMinKeyValueBytes);
  if (!n_kv) return fail(n_kv.error());

  size_t alignment_key_at = 0;
  std::unordered_set<std::string_view> keys;
  keys.reserve(static_cast<size_t>(*n_kv));
  for (uint64_t i = 0; i < *n_kv; ++i) {
    Where where{Where::Part::kKey, i, {}};
    const size_t key_at = in.offset();
    auto key = in.read_string(where, "the key");
    if (!key) return fail(key.error());
    if (key->empty()) return in.error_at(key_at, where, "key is empty");
    where.name = *key;
    if (!keys.insert(*key).second) return in.error_at(key_at, where, "duplicate key");
    if (*key == kGgufAlignmentKey) alignment_key_at = key_at;
    auto type = read_value_type(in, where, "the value type");
    if (!type) return fail(type.error());
    auto value = *type == GgufValueType::ARRAY ? read_array(in, where) : read_scalar(in, *type, where);
    if (!value) return fail(value.error());
    file.metadata.append_unique(std::string(*key), std::move(*value));
  }

  auto alignment = read_alignment(file.metadata, in, alignment_key_at);
  if (!alignment) return fail(alignment.error());
  file.alignment = *alignment;

  std::unordered_set<std::string_view> names;
  names.reserve(static_cast<size_t>(*n_tensors));
  file.tensors.reserve(static_cast<size_t>(*n_tensors));
  std::vector<size_t> offset_fields_at;  // [n_tensors] file offset of each info's offset field
  offset_fields_at.reserve(static_cast<size_t>(*n_tensors));
  for (uint64_t i = 0; i < *n_tensors; ++i) {
    size_t offset_field_at = 0;
    auto info = read_tensor_info(in, i, names, offset_field_at);
    if (!info) return fail(info.error());
    file.tensors.push_back(std::move(*info));
    offset_fields_at.push_back(offset_field_at);
  }

  // ggml pads to the alignment only when there are tensors; the padding must be there
  // even in a shape-only file (gguf_write_to_file with only_meta writes it).
  const size_t end_of_infos = in.offset();
  const uint64_t data_offset = *n_tensors > 0 ? gguf_pad(end_of_infos, file.alignment) : end_of_infos;
  if (!in.seek(static_cast<size_t>(std::min<uint64_t>(data_offset, bytes.size() + 1))))
    return in.error_at(end_of_infos, header,
                       "file ends inside the padding before the data section (which starts at {} with alignment {}, "
                       "the file has {} bytes)",
                       data_offset, file.alignment, bytes.size());
  file.data_offset = data_offset;

  // ggml requires each offset to be the running sum of the padded sizes before it.
  uint64_t expected = 0;
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const GgufTensorInfo& tensor = file.tensors[i];
    const Where where{Where::Part::kTensor, i, tensor.name};
    if (tensor.offset != expected)
      return in.error_at(offset_fields_at[i], where,
                         "data offset is {}, expected {} (the previous tensors' sizes, each padded to {})",
                         tensor.offset, expected, file.alignment);
    if (tensor.size_bytes > std::numeric_limits<uint64_t>::max() - (file.alignment - 1))
      return in.error_at(offset_fields_at[i], where, "size {} overflows when padded", tensor.size_bytes);
    const uint64_t padded = gguf_pad(tensor.size_bytes, file.alignment);
    if (__builtin_add_overflow(expected, padded, &expected))
      return in.error_at(offset_fields_at[i], where, "the data section size overflows 64 bits");
  }
  file.data_size = expected;
  return file;
}

Result<std::span<const std::byte>> tensor_data(const GgufFile& file, const GgufTensorInfo& tensor) {
  uint64_t begin = 0;
  uint64_t end = 0;
  if (__builtin_add_overflow(file.data_offset, tensor.offset, &begin) ||
      __builtin_add_overflow(begin, tensor.size_bytes, &end))
    return fail(EINVAL, "GGUF {}: tensor \"{}\": data offset {} + {} + size {} overflows", file.name, tensor.name,
                file.data_offset, tensor.offset, tensor.size_bytes);
  if (end > file.data.size())
    return fail(ENODATA,
                "GGUF {}: tensor \"{}\": data at bytes [{}, {}) lies past the end of the file ({} bytes); a "
                "shape-only or truncated file has no data for it",
                file.name, tensor.name, begin, end, file.data.size());
  return file.data.subspan(static_cast<size_t>(begin), static_cast<size_t>(tensor.size_bytes));
}

}  // namespace kvshare::layout
