#include "layout/tensor_type.h"

#include <array>
#include <cerrno>

namespace kvshare::layout {
namespace {

struct TypeRow {
  int32_t id;
  GgmlTypeTraits traits;
};

// Block sizes and bytes per block from ggml/src/ggml.c type_traits (QK_K = 256).
constexpr std::array<TypeRow, 32> kTypes{{
    {0, {"f32", 1, 4}},         {1, {"f16", 1, 2}},         {2, {"q4_0", 32, 18}},      {3, {"q4_1", 32, 20}},
    {6, {"q5_0", 32, 22}},      {7, {"q5_1", 32, 24}},      {8, {"q8_0", 32, 34}},      {9, {"q8_1", 32, 36}},
    {10, {"q2_K", 256, 84}},    {11, {"q3_K", 256, 110}},   {12, {"q4_K", 256, 144}},   {13, {"q5_K", 256, 176}},
    {14, {"q6_K", 256, 210}},   {15, {"q8_K", 256, 292}},   {16, {"iq2_xxs", 256, 66}}, {17, {"iq2_xs", 256, 74}},
    {18, {"iq3_xxs", 256, 98}}, {19, {"iq1_s", 256, 50}},   {20, {"iq4_nl", 32, 18}},   {21, {"iq3_s", 256, 110}},
    {22, {"iq2_s", 256, 82}},   {23, {"iq4_xs", 256, 136}}, {24, {"i8", 1, 1}},         {25, {"i16", 1, 2}},
    {26, {"i32", 1, 4}},        {27, {"i64", 1, 8}},        {28, {"f64", 1, 8}},        {29, {"iq1_m", 256, 56}},
    {30, {"bf16", 1, 2}},       {34, {"tq1_0", 256, 54}},   {35, {"tq2_0", 256, 66}},   {39, {"mxfp4", 32, 17}},
}};

constexpr std::array<GgmlType, 9> kCacheTypes{GgmlType::F32,    GgmlType::F16,  GgmlType::BF16,
                                              GgmlType::Q8_0,   GgmlType::Q4_0, GgmlType::Q4_1,
                                              GgmlType::IQ4_NL, GgmlType::Q5_0, GgmlType::Q5_1};

}  // namespace

std::optional<GgmlTypeTraits> ggml_type_traits(int32_t type_id) {
  for (const auto& row : kTypes)
    if (row.id == type_id) return row.traits;
  return std::nullopt;
}

GgmlTypeTraits ggml_traits(GgmlType type) { return *ggml_type_traits(static_cast<int32_t>(type)); }

std::string_view ggml_type_name(GgmlType type) { return ggml_traits(type).name; }

uint64_t ggml_row_size(GgmlType type, int64_t n_elements) {
  const auto traits = ggml_traits(type);
  return static_cast<uint64_t>(n_elements / traits.block_size) * static_cast<uint64_t>(traits.type_size);
}

bool is_row_aligned(GgmlType type, int64_t n_elements) {
  return n_elements >= 0 && n_elements % ggml_traits(type).block_size == 0;
}

Result<GgmlType> parse_cache_type(std::string_view name) {
  for (GgmlType type : kCacheTypes)
    if (ggml_type_name(type) == name) return type;
  return fail(
      EINVAL,
      "cache type \"{}\" is not one llama-server accepts (f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1)", name);
}

bool is_quantized(GgmlType type) { return ggml_traits(type).block_size > 1; }

}  // namespace kvshare::layout
