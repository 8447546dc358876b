#include "apps/decoder/completion.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <type_traits>

namespace kvshare::decoder {
namespace {

using json = Json;

// server-schema.cpp has_value: a null value counts as absent, so clients can send null
// to ask for the server's default.
const json* find_value(const json& body, std::initializer_list<const char*> names, const char** found) {
  for (const char* name : names) {
    auto it = body.find(name);
    if (it != body.end() && !it->is_null()) {
      *found = name;
      return &*it;
    }
  }
  return nullptr;
}

// Runs `read` on the first present name; any exception becomes llama-server's
// "Field '<name>': <what>" 400.
ApiResult<void> read_field(const json& body, std::initializer_list<const char*> names,
                           const std::function<void(const json&)>& read) {
  const char* name = nullptr;
  const json* value = find_value(body, names, &name);
  if (value == nullptr) return {};
  try {
    read(*value);
  } catch (const std::exception& e) {
    return api_fail(ErrorType::invalid_request, fmt::format("Field '{}': {}", name, e.what()));
  }
  return {};
}

// value.get<T>() of a JSON float casts it, which is undefined behaviour when it does not fit
// T (1e30 as an int): such a value is refused instead, by name.
template <class T>
T number_as(const json& value) {
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (!std::isfinite(d) || d < static_cast<double>(std::numeric_limits<T>::lowest()) ||
        d > static_cast<double>(std::numeric_limits<T>::max()))
      throw std::out_of_range(fmt::format("{} is out of the range of a {}-bit {}", d, sizeof(T) * 8,
                                          std::is_integral_v<T> ? "integer" : "float"));
    return static_cast<T>(d);
  }
  return value.get<T>();
}

template <class T>
std::function<void(const json&)> hard_limited(T& out, T min, T max) {
  return [&out, min, max](const json& value) {
    const T v = number_as<T>(value);
    if (v < min || v > max) {
      throw std::invalid_argument("Value must be between " + std::to_string(min) +
                                  " <= value <= " + std::to_string(max) + ", but got " + std::to_string(v));
    }
    out = v;
  };
}

std::function<void(const json&)> boolean(bool& out) {
  return [&out](const json& value) { out = value.get<bool>(); };
}

}  // namespace

std::string_view stop_type_name(StopType stop) {
  switch (stop) {
    case StopType::eos:
      return "eos";
    case StopType::word:
      return "word";
    case StopType::limit:
      return "limit";
    case StopType::none:
      break;
  }
  return "none";
}

ApiResult<CompletionParams> parse_completion_params(const json& body) {
  CompletionParams p;
  if (!body.is_object()) return p;
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
  std::vector<ApiResult<void>> results;
  results.push_back(read_field(body, {"timings_per_token"}, boolean(p.timings_per_token)));
  results.push_back(read_field(body, {"stream"}, boolean(p.stream)));
  if (auto it = body.find("stream_options"); it != body.end() && it->is_object()) {
    results.push_back(read_field(*it, {"include_usage"}, boolean(p.include_usage)));
  }
  results.push_back(read_field(body, {"cache_prompt"}, boolean(p.cache_prompt)));
  results.push_back(read_field(body, {"return_tokens"}, boolean(p.return_tokens)));
  results.push_back(read_field(body, {"n_predict", "max_completion_tokens", "max_tokens"},
                               hard_limited<int32_t>(p.n_predict, -1, kMax)));
  results.push_back(read_field(body, {"n_keep"}, hard_limited<int32_t>(p.n_keep, -1, kMax)));
  results.push_back(read_field(body, {"temperature"}, [&](const json& value) {
    // set_limits, not set_hard_limits: out-of-range temperatures are clamped.
    // Clamped in double first: a float cannot hold 1e300.
    const double t = value.get<double>();
    p.temperature =
        std::isnan(t) ? 0.0f : static_cast<float>(std::clamp(t, 0.0, double(std::numeric_limits<float>::max())));
  }));
  results.push_back(read_field(body, {"seed"}, [&](const json& value) { p.seed = number_as<uint32_t>(value); }));
  results.push_back(read_field(body, {"ignore_eos"}, boolean(p.ignore_eos)));
  results.push_back(read_field(body, {"stop"}, [&](const json& value) {
    p.stop.clear();
    if (value.is_array()) {
      for (const auto& word : value) {
        if (!word.empty()) p.stop.push_back(word.get<std::string>());
      }
    } else if (value.is_string()) {
      p.stop.push_back(value.get<std::string>());
    }
  }));
  for (auto& r : results) {
    if (!r) return tl::unexpected(r.error());
  }
  // json_value(data, "id_slot", -1): a wrongly typed id_slot falls back to "any slot".
  if (auto it = body.find("id_slot"); it != body.end() && it->is_number_integer()) {
    p.id_slot = it->get<int32_t>();
  }
  return p;
}

json CompletionParams::to_json() const {
  return json{
      {"seed", seed},
      {"temperature", temperature},
      {"max_tokens", n_predict},
      {"n_predict", n_predict},
      {"n_keep", n_keep},
      {"ignore_eos", ignore_eos},
      {"stream", stream},
      {"stop", stop},
      {"timings_per_token", timings_per_token},
      {"samplers", temperature > 0 ? json::array({"temperature"}) : json::array()},
  };
}

json Timings::to_json() const {
  return json{
      {"cache_n", cache_n},
      {"prompt_n", prompt_n},
      {"prompt_ms", prompt_ms},
      {"prompt_per_token_ms", prompt_per_token_ms},
      {"prompt_per_second", prompt_per_second},
      {"predicted_n", predicted_n},
      {"predicted_ms", predicted_ms},
      {"predicted_per_token_ms", predicted_per_token_ms},
      {"predicted_per_second", predicted_per_second},
  };
}

}  // namespace kvshare::decoder
