// A SlotEngine without a transformer, for testing the decoder's HTTP, slot and
// prompt-cache logic in process. Its "KV cache" is one int per cell (the token the cell
// was computed from), and its next-token logits are a hash of every cell 0..pos, so a
// decoder that attends to the wrong cells, forgets to evaluate one, or reuses a stale
// prefix gets another continuation. Vocabulary: ids 0..255 are bytes, then specials.
#pragma once

#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "apps/decoder/slot_engine.h"

namespace kvshare::decoder::testing {

class FakeEngine : public SlotEngine {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static constexpr int32_t kImStart = 258;
  static constexpr int32_t kImEnd = 259;
  static constexpr int32_t kVocab = 260;

  explicit FakeEngine(int32_t n_ctx = 64, ShareAvailability share = ShareAvailability::flag_not_set)
      : n_ctx_(n_ctx), share_(share), cells_(n_ctx, -1) {
    info_.model_path = "fake.gguf";
    info_.chat_template = "chatml";
    info_.bos_token = "<s>";
    info_.eos_token = "</s>";
    info_.n_vocab = kVocab;
  }

  const ModelInfo& info() const override { return info_; }
  int32_t n_ctx() const override { return n_ctx_; }
  int32_t n_vocab() const override { return kVocab; }

  Result<std::vector<int32_t>> tokenize(std::string_view text, bool add_special, bool parse_special) const override {
    std::vector<int32_t> ids;
    if (add_special) ids.push_back(kBos);
    for (size_t i = 0; i < text.size();) {
      bool matched = false;
      if (parse_special) {
        for (int32_t id = kBos; id < kVocab; ++id) {
          const std::string s = special_text(id);
          if (text.substr(i, s.size()) == s) {
            ids.push_back(id);
            i += s.size();
            matched = true;
            break;
          }
        }
      }
      if (!matched) ids.push_back(static_cast<unsigned char>(text[i++]));
    }
    return ids;
  }

  std::string token_to_piece(int32_t id, bool special) const override {
    if (id < 256) return std::string(1, static_cast<char>(id));
    return special ? special_text(id) : std::string();
  }
  bool is_end_of_generation(int32_t id) const override { return id == kEos || id == kImEnd; }

  Result<std::string> apply_chat_template(const std::vector<refmodel::ChatMessage>& messages,
                                          bool add_generation_prompt) const override {
    std::string out;
    for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }

  Result<std::vector<float>> eval(std::span<const int32_t> tokens, int32_t pos0) override {
    std::lock_guard lock(mutex_);
    if (pos0 < 0 || pos0 + static_cast<int32_t>(tokens.size()) > n_ctx_) {
      return fail(ENOSPC, "fake eval: positions {}..{} outside {} cells", pos0, pos0 + tokens.size(), n_ctx_);
    }
    for (int32_t p = 0; p < pos0; ++p) {
      if (cells_[p] < 0) return fail(EINVAL, "fake eval at {}: cell {} holds nothing", pos0, p);
    }
    for (size_t i = 0; i < tokens.size(); ++i) cells_[pos0 + i] = tokens[i];
    n_evaluated_ += static_cast<int64_t>(tokens.size());
    return logits_after(pos0 + static_cast<int32_t>(tokens.size()));
  }

  Result<uint64_t> save_state(const std::filesystem::path& path, std::span<const int32_t> tokens) override {
    std::lock_guard lock(mutex_);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) return fail(errno, "fake save: cannot open {}", path.string());
    out << "FAKE " << tokens.size();
    for (int32_t t : tokens) out << ' ' << t;
    for (size_t i = 0; i < tokens.size(); ++i) out << ' ' << cells_[i];
    out.flush();
    if (!out) return fail(EIO, "fake save: write to {} failed", path.string());
    return static_cast<uint64_t>(out.tellp());
  }

  Result<RestoredState> restore_state(const std::filesystem::path& path, uint32_t max_tokens) override {
    std::lock_guard lock(mutex_);
    std::ifstream in(path, std::ios::binary);
    if (!in) return fail(ENOENT, "fake restore: cannot open {}", path.string());
    std::string magic;
    size_t n = 0;
    in >> magic >> n;
    if (magic != "FAKE" || !in) return fail(EINVAL, "fake restore: {} is not a fake state file", path.string());
    if (n > max_tokens) return fail(ENOSPC, "fake restore: {} tokens > {}", n, max_tokens);
    RestoredState state;
    state.tokens.resize(n);
    std::vector<int32_t> cells(n);
    for (auto& t : state.tokens) in >> t;
    for (auto& c : cells) in >> c;
    if (!in) return fail(EINVAL, "fake restore: {} is truncated", path.string());
    std::copy(cells.begin(), cells.end(), cells_.begin());
    state.n_bytes_read = std::filesystem::file_size(path);
    return state;
  }

  ShareAvailability share_availability() const override { return share_; }
  Result<ShareReply> share(const std::string& socket_path) override {
    std::lock_guard lock(mutex_);
    last_socket_ = socket_path;
    ShareReply reply;
    reply.share_id = ++share_id_;
    reply.backend = "fake";
    reply.n_fds = 1;
    reply.region_bytes = static_cast<uint64_t>(n_ctx_) * sizeof(int32_t);
    return reply;
  }
  tl::expected<void, AdoptError> adopt(std::span<const int32_t> tokens, uint64_t share_id) override {
    std::lock_guard lock(mutex_);
    if (share_id != share_id_ || share_id == 0) {
      return tl::unexpected(
          AdoptError{AdoptRefusal::stale_share_id,
                     Error(ESTALE, fmt::format("share_id {} is not the latest ({})", share_id, share_id_))});
    }
    if (static_cast<int32_t>(tokens.size()) > n_ctx_) {
      return tl::unexpected(AdoptError{AdoptRefusal::too_many_tokens, Error(ENOSPC, "too many tokens")});
    }
    return {};
  }

  // What a provider would write into the shared cells (no copy on adopt: these are the
  // cells): tokens[first..] into cells first.., the cells before left as they are (an
  // incremental handoff's cached prefix).
  void provider_writes(std::span<const int32_t> tokens, size_t first = 0) {
    std::lock_guard lock(mutex_);
    for (size_t i = first; i < tokens.size(); ++i) cells_[i] = tokens[i];
  }
  int64_t n_evaluated() const {
    std::lock_guard lock(mutex_);
    return n_evaluated_;
  }
  const std::string& last_socket() const { return last_socket_; }

  // The greedy continuation the fake gives after cells holding `context`.
  static int32_t next_token(std::span<const int32_t> context) {
    uint64_t h = 1469598103934665603ull;
    for (int32_t t : context) h = (h ^ static_cast<uint64_t>(t + 1)) * 1099511628211ull;
    if (h % 11 == 0) return kEos;
    return 'a' + static_cast<int32_t>((h >> 8) % 26);
  }

 private:
  static std::string special_text(int32_t id) {
    switch (id) {
      case kBos:
        return "<s>";
      case kEos:
        return "</s>";
      case kImStart:
        return "<|im_start|>";
      case kImEnd:
        return "<|im_end|>";
    }
    return {};
  }

  std::vector<float> logits_after(int32_t n_cells) const {
    std::vector<float> logits(kVocab, 0.0f);
    for (int32_t id = 0; id < kVocab; ++id) logits[id] = static_cast<float>((id * 7919) % 13) * 0.01f;
    logits[next_token(std::span<const int32_t>(cells_.data(), n_cells))] = 10.0f;
    return logits;
  }

  int32_t n_ctx_;
  ShareAvailability share_;
  ModelInfo info_;
  mutable std::mutex mutex_;
  std::vector<int32_t> cells_;
  int64_t n_evaluated_ = 0;
  uint64_t share_id_ = 0;
  std::string last_socket_;
};

}  // namespace kvshare::decoder::testing
