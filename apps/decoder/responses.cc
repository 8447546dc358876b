#include "apps/decoder/responses.h"

#include <ctime>
#include <random>

namespace kvshare::decoder {
namespace {

Json usage(const CompletionResult& r) {
  return Json{
      {"completion_tokens", r.n_decoded},
      {"prompt_tokens", r.n_prompt_tokens},
      {"total_tokens", r.n_decoded + r.n_prompt_tokens},
      {"prompt_tokens_details", Json{{"cached_tokens", r.n_prompt_tokens_cache}}},
  };
}

const char* finish_reason(StopType stop) { return stop == StopType::word || stop == StopType::eos ? "stop" : "length"; }

Json chat_chunk(const ResponseContext& c, std::time_t t, Json choices) {
  return Json{
      {"choices", std::move(choices)},
      {"created", t},
      {"id", c.completion_id},
      {"model", c.model},
      {"system_fingerprint", build_info()},
      {"object", "chat.completion.chunk"},
  };
}

Json native_final(const ResponseContext& c, const CompletionResult& r) {
  return Json{
      {"index", 0},
      {"content", r.content},
      {"tokens", r.tokens},
      {"id_slot", r.id_slot},
      {"stop", true},
      {"model", c.model},
      {"tokens_predicted", r.n_decoded},
      {"tokens_evaluated", r.n_prompt_tokens},
      {"generation_settings", c.params.to_json()},
      {"prompt", r.prompt},
      {"has_new_line", r.has_new_line},
      {"truncated", r.truncated},
      {"stop_type", stop_type_name(r.stop)},
      {"stopping_word", r.stopping_word},
      {"tokens_cached", r.n_tokens_cached},
      {"timings", r.timings.to_json()},
  };
}

Json oai_completion_final(const ResponseContext& c, const CompletionResult& r) {
  Json res{
      {"choices", Json::array({Json{
                      {"text", r.content},
                      {"index", 0},
                      {"logprobs", nullptr},
                      {"finish_reason", finish_reason(r.stop)},
                  }})},
      {"created", std::time(nullptr)},
      {"model", c.model},
      {"system_fingerprint", build_info()},
      {"object", "text_completion"},
      {"usage", usage(r)},
      {"id", c.completion_id},
  };
  if (r.timings.prompt_n >= 0) res["timings"] = r.timings.to_json();
  return res;
}

Json oai_chat_final(const ResponseContext& c, const CompletionResult& r) {
  Json res{
      {"choices", Json::array({Json{
                      {"finish_reason", finish_reason(r.stop)},
                      {"index", 0},
                      {"message", Json{{"role", "assistant"}, {"content", r.content}}},
                  }})},
      {"created", std::time(nullptr)},
      {"model", c.model},
      {"system_fingerprint", build_info()},
      {"object", "chat.completion"},
      {"usage", usage(r)},
      {"id", c.completion_id},
  };
  if (r.timings.prompt_n >= 0) res["timings"] = r.timings.to_json();
  return res;
}

Json oai_chat_stream_final(const ResponseContext& c, const CompletionResult& r) {
  const std::time_t t = std::time(nullptr);
  Json chunks = Json::array();
  chunks.push_back(chat_chunk(c, t,
                              Json::array({Json{
                                  {"finish_reason", finish_reason(r.stop)},
                                  {"index", 0},
                                  {"delta", Json::object()},
                              }})));
  if (c.params.include_usage) {
    // OpenAI's last chunk with usage has an empty choices array.
    Json last = chat_chunk(c, t, Json::array());
    last["usage"] = usage(r);
    chunks.push_back(std::move(last));
  }
  if (r.timings.prompt_n >= 0) chunks.back()["timings"] = r.timings.to_json();
  return chunks;
}

}  // namespace

std::string make_completion_id() {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<size_t> pick(0, sizeof(kChars) - 2);
  std::string id = "chatcmpl-";
  for (int i = 0; i < 32; ++i) id += kChars[pick(rng)];
  return id;
}

std::string build_info() { return "kvshare-decoder"; }

Json final_response(const ResponseContext& c, const CompletionResult& r) {
  switch (c.format) {
    case ResponseFormat::native:
      return native_final(c, r);
    case ResponseFormat::oai_completion:
      return oai_completion_final(c, r);
    case ResponseFormat::oai_chat:
      return c.params.stream ? oai_chat_stream_final(c, r) : oai_chat_final(c, r);
  }
  return native_final(c, r);
}

Json partial_response(const ResponseContext& c, const PartialToken& p) {
  switch (c.format) {
    case ResponseFormat::native: {
      Json res{
          {"index", 0},
          {"content", p.text},
          {"tokens", Json::array({p.id})},
          {"stop", false},
          {"id_slot", -1},
          {"tokens_predicted", p.n_decoded},
          {"tokens_evaluated", p.n_prompt_tokens},
      };
      if (p.timings && p.timings->prompt_n > 0) res["timings"] = p.timings->to_json();
      return res;
    }
    case ResponseFormat::oai_completion: {
      Json res{
          {"choices", Json::array({Json{
                          {"text", p.text},
                          {"index", 0},
                          {"logprobs", nullptr},
                          {"finish_reason", nullptr},
                      }})},
          {"created", std::time(nullptr)},
          {"model", c.model},
          {"system_fingerprint", build_info()},
          {"object", "text_completion"},
          {"id", c.completion_id},
      };
      if (p.timings) res["timings"] = p.timings->to_json();
      return res;
    }
    case ResponseFormat::oai_chat: {
      const std::time_t t = std::time(nullptr);
      Json chunks = Json::array();
      const auto add_delta = [&](Json delta) {
        chunks.push_back(chat_chunk(c, t,
                                    Json::array({Json{
                                        {"finish_reason", nullptr},
                                        {"index", 0},
                                        {"delta", std::move(delta)},
                                    }})));
      };
      // OpenAI clients expect the role first, in its own chunk.
      if (p.n_decoded == 1) add_delta(Json{{"role", "assistant"}, {"content", nullptr}});
      if (!p.text.empty()) add_delta(Json{{"content", p.text}});
      if (!chunks.empty() && p.timings) chunks.back()["timings"] = p.timings->to_json();
      return chunks;
    }
  }
  return Json::array();
}

std::string format_sse(const Json& data) {
  std::string out;
  const auto one = [&](const Json& event) {
    out += "data: ";
    out += event.dump(-1, ' ', false, Json::error_handler_t::replace);
    out += "\n\n";
  };
  if (data.is_array()) {
    for (const auto& event : data) one(event);
  } else {
    one(data);
  }
  return out;
}

}  // namespace kvshare::decoder
