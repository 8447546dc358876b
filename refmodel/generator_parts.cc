#include "refmodel/generator_parts.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace kvshare::refmodel::detail {
namespace {

using layout::GgmlType;

uint64_t fnv1a(std::string_view s, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull ^ seed;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Uniform values in [-scale, scale] around offset from a stream keyed by seed and tensor
// name. Built from raw 64-bit draws: the same seed gives the same model with any
// standard library.
std::vector<float> random_values(uint64_t seed, const std::string& tensor, size_t n, float scale, float offset) {
  std::mt19937_64 rng(fnv1a(tensor, seed));
  std::vector<float> v(n);
  for (auto& x : v) x = offset + scale * static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-52 - 1.0);
  return v;
}

}  // namespace

TensorAdder::TensorAdder(layout::GgufWriter& writer, const GeneratorOptions& options, int64_t n_vocab,
                         std::vector<int64_t> control_ids, bool is_tied)
    : writer_(writer), options_(options), n_vocab_(n_vocab), control_ids_(std::move(control_ids)), is_tied_(is_tied) {}

float TensorAdder::proj(int64_t fan_in) { return std::sqrt(3.0f) / std::sqrt(static_cast<float>(fan_in)); }

void TensorAdder::weight(const std::string& name, int64_t fan_in, int64_t n_out, float scale) {
  add(name, options_.wtype, {fan_in, n_out}, {scale, 0.0f});
}

void TensorAdder::f32(const std::string& name, std::vector<int64_t> ne, Init init) {
  add(name, GgmlType::F32, std::move(ne), init);
}

void TensorAdder::token_embd() { weight("token_embd.weight", options_.n_embd, n_vocab_, std::sqrt(3.0f)); }

void TensorAdder::output(bool zero_control_rows) {
  if (is_tied_) return;
  add("output.weight", options_.wtype, {options_.n_embd, n_vocab_}, {4.0f * proj(options_.n_embd), 0.0f},
      zero_control_rows ? control_ids_ : std::vector<int64_t>{});
}

void TensorAdder::swiglu_ffn(const std::string& p) {
  const int64_t E = options_.n_embd, F = options_.n_ff;
  weight(p + "ffn_gate.weight", E, F, proj(E));
  weight(p + "ffn_up.weight", E, F, proj(E));
  weight(p + "ffn_down.weight", F, E, residual(F));
}

void TensorAdder::add(const std::string& name, GgmlType type, std::vector<int64_t> ne, Init init,
                      std::vector<int64_t> zero_rows) {
  if (!status_) return;
  if (options_.shape_only) {
    status_ = writer_.add_tensor_shape(name, type, ne);
    return;
  }
  size_t n = 1;
  for (int64_t d : ne) n *= static_cast<size_t>(d);
  const auto row = static_cast<size_t>(ne[0]);
  const uint64_t seed = options_.seed;
  status_ = writer_.add_tensor_generated(name, type, ne, [=](std::span<std::byte> out) -> Result<void> {
    std::vector<float> values = random_values(seed, name, n, init.scale, init.offset);
    for (int64_t r : zero_rows) std::fill_n(values.begin() + static_cast<std::ptrdiff_t>(r * row), row, 0.0f);
    auto bytes = layout::encode_f32_as(type, values);
    if (!bytes) return fail(bytes.error());
    if (bytes->size() != out.size())
      return fail(EINVAL, "tensor {}: encoded {} bytes, expected {}", name, bytes->size(), out.size());
    std::copy(bytes->begin(), bytes->end(), out.begin());
    return {};
  });
}

Result<void> check_rows(const GeneratorOptions& o, std::initializer_list<std::pair<const char*, int64_t>> rows) {
  for (auto [what, n] : rows)
    if (!layout::is_row_aligned(o.wtype, n))
      return fail(EINVAL, "{} = {} is not a multiple of the {} block size {}", what, n, layout::ggml_type_name(o.wtype),
                  layout::ggml_traits(o.wtype).block_size);
  return {};
}

}  // namespace kvshare::refmodel::detail
