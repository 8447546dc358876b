#include "layout/llama_flags.h"

#include <string_view>
#include <utility>

namespace kvshare::layout {

namespace {

constexpr std::pair<std::string_view, std::string_view> kLongForms[] = {
    {"-np", "--parallel"},   {"-kvu", "--kv-unified"}, {"-ctk", "--cache-type-k"}, {"-ctv", "--cache-type-v"},
    {"-fa", "--flash-attn"}, {"-ub", "--ubatch-size"}, {"-ngl", "--n-gpu-layers"}, {"-dev", "--device"},
};

}  // namespace

std::vector<std::string> normalize_llama_flags(std::vector<std::string> args) {
  for (std::string& arg : args) {
    if (arg == "--") break;
    const std::string_view name = std::string_view(arg).substr(0, arg.find('='));
    for (const auto& [short_form, long_form] : kLongForms) {
      if (name != short_form) continue;
      arg = std::string(long_form) + arg.substr(name.size());
      break;
    }
  }
  return args;
}

}  // namespace kvshare::layout
