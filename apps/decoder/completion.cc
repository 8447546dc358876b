#include "apps/decoder/completion.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "layout/json_reader.h"

namespace kvshare::decoder {
namespace {

using json = Json;

// server-schema.cpp has_value: a null value counts as absent, so clients can send null
// to ask for the server's default.
using Reader = layout::JsonReader<json>;
Reader request_reader(const json& body) { return Reader{body, "completion request", "", true}; }

// A reader's error as llama-server's answer to a wrongly typed field: 400 invalid_request.
ApiResult<void> invalid_field(const Error& error) { return api_fail(ErrorType::invalid_request, error.message()); }

ApiResult<void> read_boolean(const Reader& read, const char* key, bool& out) {
  auto value = read.optional_boolean(key);
  if (!value) return invalid_field(value.error());
  if (*value) out = **value;
  return {};
}

// The first of `names` present (llama-server's aliases), or nullptr.
const char* first_present(const Reader& read, std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (read.find(name) != nullptr) return name;
  return nullptr;
}

// server-schema.cpp set_hard_limits: an integer field outside [min, max] is refused with
// its words. A float is truncated, as value.get<T>() would; one past the range of T is
// refused instead of being cast (undefined behaviour).
ApiResult<void> read_limited(const Reader& read, std::initializer_list<const char*> names, int32_t& out, int32_t min,
                             int32_t max) {
  const char* name = first_present(read, names);
  if (name == nullptr) return {};
  auto value = read.number(name);
  if (!value) return invalid_field(value.error());
  if (!(*value >= min && *value <= max))
    return api_fail(ErrorType::invalid_request, fmt::format("Field '{}': Value must be between {} <= value <= {}, but "
                                                            "got {}",
                                                            name, min, max, *value));
  out = static_cast<int32_t>(*value);
  return {};
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
  const Reader read = request_reader(body);
  std::vector<ApiResult<void>> results;
  results.push_back(read_boolean(read, "timings_per_token", p.timings_per_token));
  results.push_back(read_boolean(read, "stream", p.stream));
  if (auto it = body.find("stream_options"); it != body.end() && it->is_object()) {
    const Reader options{*it, "completion request", "stream_options.", true};
    results.push_back(read_boolean(options, "include_usage", p.include_usage));
  }
  results.push_back(read_boolean(read, "cache_prompt", p.cache_prompt));
  results.push_back(read_boolean(read, "return_tokens", p.return_tokens));
  results.push_back(read_limited(read, {"n_predict", "max_completion_tokens", "max_tokens"}, p.n_predict, -1, kMax));
  results.push_back(read_limited(read, {"n_keep"}, p.n_keep, -1, kMax));
  if (auto temperature = read.optional_number("temperature"); !temperature) {
    results.push_back(invalid_field(temperature.error()));
  } else if (*temperature) {
    // set_limits, not set_hard_limits: out-of-range temperatures are clamped.
    // Clamped in double first: a float cannot hold 1e300.
    const double t = **temperature;
    p.temperature =
        std::isnan(t) ? 0.0f : static_cast<float>(std::clamp(t, 0.0, double(std::numeric_limits<float>::max())));
  }
  if (auto seed = read.optional_number("seed"); !seed) {
    results.push_back(invalid_field(seed.error()));
  } else if (*seed) {
    // value.get<uint32_t>(): -1 is LLAMA_DEFAULT_SEED (a negative seed wraps, as in C);
    // past 32 bits it is refused rather than cut.
    const double d = **seed;
    if (!(d >= std::numeric_limits<int32_t>::min() && d <= std::numeric_limits<uint32_t>::max()))
      results.push_back(api_fail(ErrorType::invalid_request,
                                 fmt::format("completion request: \"seed\" is {}, not a 32-bit seed", d)));
    else
      p.seed = static_cast<uint32_t>(static_cast<int64_t>(d));
  }
  results.push_back(read_boolean(read, "ignore_eos", p.ignore_eos));
  if (const json* stop = read.find("stop")) {
    // A string or an array of strings; any other type leaves no stop word, as llama-server.
    p.stop.clear();
    if (stop->is_string()) p.stop.push_back(stop->get<std::string>());
    for (size_t i = 0; stop->is_array() && i < stop->size(); ++i) {
      const json& word = (*stop)[i];
      if (word.is_null()) continue;
      if (!word.is_string()) {
        results.push_back(api_fail(ErrorType::invalid_request,
                                   fmt::format("completion request: \"stop[{}]\" is {}, not a string", i,
                                               word.dump(-1, ' ', false, json::error_handler_t::replace))));
        break;
      }
      p.stop.push_back(word.get<std::string>());
    }
  }
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
