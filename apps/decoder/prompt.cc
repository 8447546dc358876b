#include "apps/decoder/prompt.h"

#include <fmt/format.h>

namespace kvshare::decoder {
namespace {

using json = Json;

ApiResult<std::vector<int32_t>> tokenize_text(const SlotEngine& engine, const std::string& text, bool add_special,
                                              bool parse_special) {
  auto ids = engine.tokenize(text, add_special, parse_special);
  if (!ids) return api_fail(ErrorType::invalid_request, ids.error().what());
  return std::move(*ids);
}

bool is_array_of_numbers(const json& value) {
  if (!value.is_array()) return false;
  for (const auto& e : value) {
    if (!e.is_number_integer()) return false;
  }
  return true;
}

bool is_array_of_mixed(const json& value) {
  bool has_string = false;
  bool has_number = false;
  if (!value.is_array()) return false;
  for (const auto& e : value) {
    if (e.is_string()) {
      has_string = true;
    } else if (e.is_number_integer()) {
      has_number = true;
    } else {
      return false;
    }
  }
  return has_string && has_number;
}

bool contains_numbers(const json& value) {
  if (!value.is_array()) return false;
  for (const auto& e : value) {
    if (e.is_number_integer()) return true;
  }
  return false;
}

}  // namespace

ApiResult<std::vector<int32_t>> tokenize_mixed(const SlotEngine& engine, const json& content, bool add_special,
                                               bool parse_special) {
  std::vector<int32_t> ids;
  if (content.is_string()) return tokenize_text(engine, content.get<std::string>(), add_special, parse_special);
  if (!content.is_array()) {
    return api_fail(ErrorType::invalid_request,
                    "\"content\" must be a string, a list of tokens, or a list of mixed strings & tokens");
  }
  bool first = true;
  for (const auto& part : content) {
    if (part.is_string()) {
      auto piece = tokenize_text(engine, part.get<std::string>(), first && add_special, parse_special);
      if (!piece) return piece;
      ids.insert(ids.end(), piece->begin(), piece->end());
    } else if (part.is_number_integer()) {
      ids.push_back(part.get<int32_t>());
    } else {
      return api_fail(ErrorType::invalid_request,
                      fmt::format("prompt elements must be strings or token ids, got {}", part.type_name()));
    }
    first = false;
  }
  return ids;
}

ApiResult<std::vector<int32_t>> tokenize_completion_prompt(const SlotEngine& engine, const json& prompt) {
  // tokenize_input_prompts: an array without numbers is a list of prompts.
  if (prompt.is_array() && !contains_numbers(prompt)) {
    if (prompt.empty()) return api_fail(ErrorType::invalid_request, "\"prompt\" must not be empty");
    if (prompt.size() > 1) {
      return api_fail(ErrorType::invalid_request,
                      fmt::format("\"prompt\" holds {} prompts; kvshare-decoder has one slot and answers one prompt "
                                  "per request: send them one at a time",
                                  prompt.size()));
    }
    return tokenize_completion_prompt(engine, prompt.front());
  }
  if (prompt.is_string() || is_array_of_mixed(prompt)) return tokenize_mixed(engine, prompt, true, true);
  if (is_array_of_numbers(prompt)) return prompt.get<std::vector<int32_t>>();
  if (prompt.is_object() && prompt.contains("prompt_string")) {
    if (prompt.contains("multimodal_data")) {
      return api_fail(ErrorType::invalid_request,
                      "Multimodal data provided, but model does not support multimodal requests.");
    }
    return tokenize_mixed(engine, prompt.at("prompt_string"), true, true);
  }
  return api_fail(ErrorType::invalid_request,
                  "\"prompt\" elements must be a string, a list of tokens, a JSON object containing a prompt string, "
                  "or a list of mixed strings & tokens.");
}

ApiResult<json> chat_to_completion_request(const SlotEngine& engine, const json& body) {
  if (!body.is_object()) return api_fail(ErrorType::invalid_request, "request body must be a JSON object");
  json request = json::object();
  if (auto tools = body.find("tools"); tools != body.end() && tools->is_array() && !tools->empty()) {
    return api_fail(ErrorType::server, "tools param requires --jinja flag");
  }
  if (body.contains("stop") && body.at("stop").is_string()) {
    request["stop"] = json::array({body.at("stop")});
  } else if (auto stop = body.find("stop"); stop != body.end() && stop->is_array()) {
    request["stop"] = *stop;
  } else {
    request["stop"] = json::array();
  }
  if (!body.contains("messages")) return api_fail(ErrorType::invalid_request, "'messages' is required");
  const json& messages = body.at("messages");
  if (!messages.is_array()) return api_fail(ErrorType::invalid_request, "Expected 'messages' to be an array");

  std::vector<refmodel::ChatMessage> chat;
  for (const auto& msg : messages) {
    if (!msg.is_object()) return api_fail(ErrorType::invalid_request, "Each message must be a JSON object");
    std::string role;
    if (auto r = msg.find("role"); r != msg.end() && r->is_string()) role = r->get<std::string>();
    if (role != "assistant" && !msg.contains("content")) {
      return api_fail(ErrorType::invalid_request, "All non-assistant messages must contain 'content'");
    }
    if (role == "assistant" && !msg.contains("content")) {
      return api_fail(ErrorType::invalid_request, "Assistant message must contain either 'content' or 'tool_calls'!");
    }
    const json& content = msg.at("content");
    std::string text;
    if (content.is_string()) {
      text = content.get<std::string>();
    } else if (content.is_array()) {
      // Text parts joined by "\n", as common_chat_templates_apply_legacy joins them.
      for (const auto& part : content) {
        std::string type;
        if (part.is_object()) {
          if (auto t = part.find("type"); t != part.end() && t->is_string()) type = t->get<std::string>();
        }
        if (type != "text") {
          return api_fail(ErrorType::invalid_request,
                          type == "image_url" || type == "input_audio"
                              ? std::string("image/audio input is not supported - this decoder has no mmproj")
                              : std::string("unsupported content[].type"));
        }
        if (!text.empty()) text += "\n";
        if (auto t = part.find("text"); t != part.end() && t->is_string()) text += t->get<std::string>();
      }
    } else if (!content.is_null()) {
      return api_fail(ErrorType::invalid_request, "Expected 'content' to be a string or an array");
    }
    chat.push_back({role, text});
  }

  bool add_generation_prompt = true;
  if (auto a = body.find("add_generation_prompt"); a != body.end() && a->is_boolean()) add_generation_prompt = *a;
  auto rendered = engine.apply_chat_template(chat, add_generation_prompt);
  if (!rendered) return api_fail(ErrorType::server, rendered.error().what());
  std::string prompt = std::move(*rendered);
  // The tokenizer adds BOS itself: a template's leading BOS text would make it twice.
  const std::string& bos = engine.info().bos_token;
  auto with_bos = engine.tokenize("", true, true);
  if (!bos.empty() && with_bos && !with_bos->empty() && prompt.rfind(bos, 0) == 0) prompt.erase(0, bos.size());
  request["prompt"] = prompt;

  for (const auto& [key, value] : body.items()) {
    // n_predict overrides an earlier max_tokens, as in llama-server.
    if (!request.contains(key) || key == "n_predict") request[key] = value;
  }
  return request;
}

ApiResult<std::string> detokenize(const SlotEngine& engine, const std::vector<int32_t>& ids) {
  std::string text;
  const int32_t n_vocab = engine.n_vocab();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= n_vocab) {
      return api_fail(ErrorType::server,
                      fmt::format("tokens[{}] is {}, outside the vocabulary (0..{})", i, ids[i], n_vocab - 1));
    }
    text += engine.token_to_piece(ids[i], true);
  }
  return text;
}

}  // namespace kvshare::decoder
