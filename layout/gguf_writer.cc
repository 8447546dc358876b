#include "layout/gguf_writer.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <unordered_set>

#include "layout/half.h"
#include "layout/row_convert.h"

namespace kvshare::layout {
namespace {

// Appends little-endian fields (the host order; gguf_reader.cc asserts a little-endian host).
class ByteBuffer {
 public:
  template <class T>
  void put(T value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void put_string(std::string_view text) {
    put<uint64_t>(text.size());
    const auto* p = reinterpret_cast<const std::byte*>(text.data());
    bytes_.insert(bytes_.end(), p, p + text.size());
  }
  void pad_to(uint64_t alignment) { bytes_.resize(gguf_pad(bytes_.size(), alignment), std::byte{0}); }
  std::vector<std::byte>& bytes() { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

template <class T>
GgufValue make_value(T value) {
  return GgufValue{GgufValue::Storage(std::in_place_type<T>, std::move(value))};
}

template <class T>
GgufValue array_of(const std::vector<T>& values, GgufValueType element_type) {
  GgufArray array;
  array.element_type = element_type;
  array.elements.reserve(values.size());
  for (const T& v : values) array.elements.push_back(make_value<T>(v));
  return GgufValue{GgufValue::Storage(std::move(array))};
}

Result<void> check_value(std::string_view key, const GgufValue& value) {
  if (const auto* text = value.get_if<std::string>()) {
    if (text->size() > kGgufMaxStringLength)
      return fail(EINVAL, "GGUF writer: key \"{}\": string of {} bytes exceeds the GGUF maximum of {}", key,
                  text->size(), kGgufMaxStringLength);
  }
  const auto* array = value.get_if<GgufArray>();
  if (array == nullptr) return {};
  if (array->element_type == GgufValueType::ARRAY)
    return fail(EINVAL, "GGUF writer: key \"{}\": arrays of arrays are not valid GGUF", key);
  if (array->elements.size() > kGgufMaxArrayElements)
    return fail(EINVAL, "GGUF writer: key \"{}\": array of {} elements exceeds the GGUF maximum of {}", key,
                array->elements.size(), kGgufMaxArrayElements);
  for (size_t i = 0; i < array->elements.size(); ++i) {
    const GgufValue& element = array->elements[i];
    if (element.type() != array->element_type)
      return fail(EINVAL, "GGUF writer: key \"{}\": element {} is {}, the array holds {}", key, i,
                  gguf_value_type_name(element.type()), gguf_value_type_name(array->element_type));
    if (auto ok = check_value(key, element); !ok) return ok;
  }
  return {};
}

void put_scalar(ByteBuffer& out, const GgufValue& value) {
  std::visit(
      [&out](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          out.put_string(v);
        } else if constexpr (std::is_same_v<T, bool>) {
          out.put<uint8_t>(v ? 1 : 0);
        } else if constexpr (std::is_same_v<T, GgufArray>) {
          // Arrays are written by put_value; check_value refused nested ones.
        } else {
          out.put<T>(v);
        }
      },
      value.value);
}

void put_value(ByteBuffer& out, const GgufValue& value) {
  out.put<int32_t>(static_cast<int32_t>(value.type()));
  if (const auto* array = value.get_if<GgufArray>()) {
    out.put<int32_t>(static_cast<int32_t>(array->element_type));
    out.put<uint64_t>(array->elements.size());
    for (const GgufValue& element : array->elements) put_scalar(out, element);
    return;
  }
  put_scalar(out, value);
}

}  // namespace

Result<std::vector<std::byte>> encode_f32_as(GgmlType type, std::span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i]))
      return fail(EINVAL, "value {} is {}, only finite values can be encoded as {}", i, values[i],
                  ggml_type_name(type));
  std::vector<std::byte> bytes;
  switch (type) {
    case GgmlType::F32:
      bytes.resize(values.size() * sizeof(float));
      if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
      return bytes;
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
      // The cache types' encoders (layout/row_convert) are ggml's, byte for byte.
      if (values.size() % static_cast<size_t>(ggml_traits(type).block_size) != 0)
        return fail(EINVAL, "{} values cannot be encoded as {}: not a multiple of its block size {}", values.size(),
                    ggml_type_name(type), ggml_traits(type).block_size);
      bytes.resize(ggml_row_size(type, static_cast<int64_t>(values.size())));
      convert_row(GgmlType::F32, values.data(), type, bytes.data(), static_cast<int64_t>(values.size()));
      return bytes;
    default:
      break;
  }
  return fail(EINVAL, "cannot encode floats as {}: the GGUF writer encodes f32, f16, bf16 and q8_0",
              ggml_type_name(type));
}

void GgufWriter::add_u32(std::string key, uint32_t value) { set(std::move(key), make_value<uint32_t>(value)); }
void GgufWriter::add_i32(std::string key, int32_t value) { set(std::move(key), make_value<int32_t>(value)); }
void GgufWriter::add_u64(std::string key, uint64_t value) { set(std::move(key), make_value<uint64_t>(value)); }
void GgufWriter::add_f32(std::string key, float value) { set(std::move(key), make_value<float>(value)); }
void GgufWriter::add_bool(std::string key, bool value) { set(std::move(key), make_value<bool>(value)); }
void GgufWriter::add_string(std::string key, std::string value) {
  set(std::move(key), make_value<std::string>(std::move(value)));
}
void GgufWriter::add_string_array(std::string key, const std::vector<std::string>& values) {
  set(std::move(key), array_of(values, GgufValueType::STRING));
}
void GgufWriter::add_u32_array(std::string key, const std::vector<uint32_t>& values) {
  set(std::move(key), array_of(values, GgufValueType::UINT32));
}
void GgufWriter::add_i32_array(std::string key, const std::vector<int32_t>& values) {
  set(std::move(key), array_of(values, GgufValueType::INT32));
}
void GgufWriter::add_f32_array(std::string key, const std::vector<float>& values) {
  set(std::move(key), array_of(values, GgufValueType::FLOAT32));
}
void GgufWriter::add_bool_array(std::string key, const std::vector<bool>& values) {
  GgufArray array;
  array.element_type = GgufValueType::BOOL;
  for (bool v : values) array.elements.push_back(make_value<bool>(v));
  set(std::move(key), GgufValue{GgufValue::Storage(std::move(array))});
}

Result<void> GgufWriter::set_alignment(uint32_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    return fail(EINVAL, "GGUF writer: alignment {} is not a power of 2", alignment);
  add_u32(std::string(kGgufAlignmentKey), alignment);
  return {};
}

Result<uint64_t> GgufWriter::alignment() const {
  const GgufValue* value = metadata_.find(kGgufAlignmentKey);
  if (value == nullptr) return kGgufDefaultAlignment;
  const auto* alignment = value->get_if<uint32_t>();
  if (alignment == nullptr)
    return fail(EINVAL, "GGUF writer: key \"{}\" has type {}, must be u32", kGgufAlignmentKey,
                gguf_value_type_name(value->type()));
  if (*alignment == 0 || (*alignment & (*alignment - 1)) != 0)
    return fail(EINVAL, "GGUF writer: key \"{}\": alignment {} is not a power of 2", kGgufAlignmentKey, *alignment);
  return *alignment;
}

Result<void> GgufWriter::set_version(uint32_t version) {
  if (version != 2 && version != 3)
    return fail(EINVAL, "GGUF writer: version {} cannot be written (2 or 3; they share one layout)", version);
  version_ = version;
  return {};
}

Result<GgufWriter::Tensor> GgufWriter::make_tensor(std::string name, GgmlType type,
                                                   const std::vector<int64_t>& ne) const {
  if (name.size() > kGgufMaxTensorNameLength)
    return fail(EINVAL, "GGUF writer: tensor \"{}\": name is {} bytes, longer than ggml's limit of {}", name,
                name.size(), kGgufMaxTensorNameLength);
  for (const Tensor& existing : tensors_)
    if (existing.info.name == name) return fail(EINVAL, "GGUF writer: tensor \"{}\": duplicate tensor name", name);
  if (ne.empty() || ne.size() > kGgufMaxDims)
    return fail(EINVAL, "GGUF writer: tensor \"{}\": {} dimensions, must be 1 to {}", name, ne.size(), kGgufMaxDims);
  if (!ggml_type_traits(static_cast<int32_t>(type)))
    return fail(EINVAL, "GGUF writer: tensor \"{}\": invalid ggml type id {}", name, static_cast<int32_t>(type));
  Tensor tensor;
  tensor.info.n_dims = static_cast<uint32_t>(ne.size());
  for (size_t j = 0; j < ne.size(); ++j) tensor.info.ne[j] = ne[j];
  tensor.info.type = type;
  auto nbytes = gguf_tensor_nbytes(type, tensor.info.ne);
  if (!nbytes) return fail(EINVAL, "GGUF writer: tensor \"{}\": {}", name, nbytes.error().message());
  tensor.info.size_bytes = *nbytes;
  tensor.info.name = std::move(name);
  return tensor;
}

Result<void> GgufWriter::add_tensor(std::string name, GgmlType type, const std::vector<int64_t>& ne,
                                    std::span<const std::byte> data) {
  auto tensor = make_tensor(std::move(name), type, ne);
  if (!tensor) return fail(tensor.error());
  if (data.size() != tensor->info.size_bytes)
    return fail(EINVAL, "GGUF writer: tensor \"{}\": {} bytes of data, its shape and type take {}", tensor->info.name,
                data.size(), tensor->info.size_bytes);
  tensor->bytes.assign(data.begin(), data.end());
  tensor->has_data = true;
  tensors_.push_back(std::move(*tensor));
  return {};
}

Result<void> GgufWriter::add_tensor_from_f32(std::string name, GgmlType type, const std::vector<int64_t>& ne,
                                             std::span<const float> values) {
  auto tensor = make_tensor(std::move(name), type, ne);
  if (!tensor) return fail(tensor.error());
  uint64_t n_elements = 1;
  for (int64_t n : tensor->info.ne) n_elements *= static_cast<uint64_t>(n);  // bounded: nbytes did not overflow
  if (values.size() != n_elements)
    return fail(EINVAL, "GGUF writer: tensor \"{}\": {} values given, its shape holds {}", tensor->info.name,
                values.size(), n_elements);
  auto bytes = encode_f32_as(type, values);
  if (!bytes) return fail(bytes.error().with_context(fmt::format("GGUF writer: tensor \"{}\"", tensor->info.name)));
  tensor->bytes = std::move(*bytes);
  tensor->has_data = true;
  tensors_.push_back(std::move(*tensor));
  return {};
}

Result<void> GgufWriter::add_tensor_generated(std::string name, GgmlType type, const std::vector<int64_t>& ne,
                                              GgufTensorFill fill) {
  auto tensor = make_tensor(std::move(name), type, ne);
  if (!tensor) return fail(tensor.error());
  if (!fill) return fail(EINVAL, "GGUF writer: tensor \"{}\": no fill function given", tensor->info.name);
  tensor->fill = std::move(fill);
  tensor->has_data = true;
  tensors_.push_back(std::move(*tensor));
  return {};
}

Result<void> GgufWriter::add_tensor_shape(std::string name, GgmlType type, const std::vector<int64_t>& ne) {
  auto tensor = make_tensor(std::move(name), type, ne);
  if (!tensor) return fail(tensor.error());
  tensors_.push_back(std::move(*tensor));
  return {};
}

Result<std::vector<GgufTensorInfo>> GgufWriter::tensor_infos() const {
  auto alignment = this->alignment();
  if (!alignment) return fail(alignment.error());
  std::vector<GgufTensorInfo> infos;
  infos.reserve(tensors_.size());
  uint64_t offset = 0;
  for (const Tensor& tensor : tensors_) {
    infos.push_back(tensor.info);
    infos.back().offset = offset;
    const uint64_t padded = gguf_pad(tensor.info.size_bytes, *alignment);
    if (padded < tensor.info.size_bytes || __builtin_add_overflow(offset, padded, &offset))
      return fail(EINVAL, "GGUF writer: tensor \"{}\": the data section size overflows 64 bits", tensor.info.name);
  }
  return infos;
}

Result<uint64_t> GgufWriter::size_bytes(GgufPayload payload) const {
  uint64_t total = 0;
  auto counting_sink = [&total](std::span<const std::byte> bytes) -> Result<void> {
    total += bytes.size();
    return {};
  };
  // The header is built for real (it is small); data is only counted.
  auto alignment = this->alignment();
  if (!alignment) return fail(alignment.error());
  auto infos = tensor_infos();
  if (!infos) return fail(infos.error());
  if (auto ok = write(counting_sink, GgufPayload::kMetaOnly); !ok) return fail(ok.error());
  if (payload == GgufPayload::kWithData && !infos->empty())
    total += infos->back().offset + gguf_pad(infos->back().size_bytes, *alignment);
  return total;
}

Result<void> GgufWriter::write(const GgufSink& sink, GgufPayload payload) const {
  auto alignment = this->alignment();
  if (!alignment) return fail(alignment.error());
  auto infos = tensor_infos();
  if (!infos) return fail(infos.error());
  for (const auto& [key, value] : metadata_.entries()) {
    if (key.empty()) return fail(EINVAL, "GGUF writer: a key is empty (ggml refuses empty keys)");
    if (auto ok = check_value(key, value); !ok) return ok;
  }
  if (payload == GgufPayload::kWithData)
    for (const Tensor& tensor : tensors_)
      if (!tensor.has_data)
        return fail(EINVAL,
                    "GGUF writer: tensor \"{}\" has no data (added with add_tensor_shape); write with "
                    "GgufPayload::kMetaOnly for a shape-only file",
                    tensor.info.name);

  // Layout of gguf_write_out: magic, version, n_tensors (i64), n_kv (i64), key/values,
  // tensor infos, zero padding to the alignment (always, even with no tensors), data.
  ByteBuffer header;
  header.put<uint32_t>(0x46554747u);  // "GGUF"
  header.put<uint32_t>(version_);
  header.put<int64_t>(static_cast<int64_t>(tensors_.size()));
  header.put<int64_t>(static_cast<int64_t>(metadata_.entries().size()));
  for (const auto& [key, value] : metadata_.entries()) {
    header.put_string(key);
    put_value(header, value);
  }
  for (const GgufTensorInfo& info : *infos) {
    header.put_string(info.name);
    header.put<uint32_t>(info.n_dims);
    for (uint32_t j = 0; j < info.n_dims; ++j) header.put<int64_t>(info.ne[j]);
    header.put<int32_t>(static_cast<int32_t>(info.type));
    header.put<uint64_t>(info.offset);
  }
  header.pad_to(*alignment);
  if (auto ok = sink(header.bytes()); !ok) return ok;
  if (payload == GgufPayload::kMetaOnly) return {};

  const std::vector<std::byte> zeros(*alignment, std::byte{0});
  std::vector<std::byte> generated;
  for (const Tensor& tensor : tensors_) {
    std::span<const std::byte> data = tensor.bytes;
    if (tensor.fill) {
      generated.assign(tensor.info.size_bytes, std::byte{0});
      if (auto ok = tensor.fill(generated); !ok)
        return fail(ok.error().with_context(fmt::format("GGUF writer: tensor \"{}\"", tensor.info.name)));
      data = generated;
    }
    if (!data.empty())
      if (auto ok = sink(data); !ok) return ok;
    const uint64_t padding = gguf_pad(tensor.info.size_bytes, *alignment) - tensor.info.size_bytes;
    if (padding > 0)
      if (auto ok = sink(std::span<const std::byte>(zeros).first(padding)); !ok) return ok;
  }
  return {};
}

Result<std::vector<std::byte>> GgufWriter::finish(GgufPayload payload) const {
  std::vector<std::byte> bytes;
  auto append = [&bytes](std::span<const std::byte> chunk) -> Result<void> {
    bytes.insert(bytes.end(), chunk.begin(), chunk.end());
    return {};
  };
  if (auto ok = write(append, payload); !ok) return fail(ok.error());
  return bytes;
}

Result<GgufWriter> GgufWriter::from_file(const GgufFile& file) {
  GgufWriter writer;
  if (auto ok = writer.set_version(file.version); !ok) return fail(ok.error());
  writer.metadata_ = file.metadata;
  for (const GgufTensorInfo& info : file.tensors) {
    const std::vector<int64_t> ne(info.ne.begin(), info.ne.begin() + std::max<uint32_t>(info.n_dims, 1));
    auto tensor = writer.make_tensor(info.name, info.type, ne);
    if (!tensor) return fail(tensor.error());
    // Keep the file's n_dims (0 is legal there) so the infos re-encode byte for byte.
    tensor->info.n_dims = info.n_dims;
    if (auto data = tensor_data(file, info)) {
      tensor->bytes.assign(data->begin(), data->end());
      tensor->has_data = true;
    }
    writer.tensors_.push_back(std::move(*tensor));
  }
  return writer;
}

}  // namespace kvshare::layout
