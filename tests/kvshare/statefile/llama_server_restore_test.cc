// The test that matters: a file our writer produced is restored by a real llama-server
// (POST /slots/0?action=restore) and the next completion of the same prompt evaluates one
// token only. Needs LLAMA_SERVER=path/to/llama-server; skips with a message otherwise.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "kvshare/mapping.h"
#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "kvshare/statefile/state_tools.h"
#include "layout/gguf_reader.h"
#include "layout/memory_shape.h"
#include "layout/model_shape.h"
#include "refmodel/model_generator.h"
#include "route/state_version_probe.h"
#include "support/test_support.h"

extern char** environ;

namespace kvshare::statefile {
namespace {

using layout::GgmlType;

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

// One llama-server child: started with the given flags, stopped (SIGTERM, then SIGKILL) by
// the destructor. Its output goes to a log file the test prints on failure.
class LlamaServer {
 public:
  LlamaServer(const std::string& binary, std::vector<std::string> args, const std::filesystem::path& log) : log_(log) {
    port_ = free_port();
    args.insert(args.begin(), binary);
    for (const char* flag : {"--host", "127.0.0.1", "--port"}) args.push_back(flag);
    args.push_back(std::to_string(port_));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    if (posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
  }
  ~LlamaServer() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 50; ++i) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  bool wait_ready(int timeout_s) {
    httplib::Client client("127.0.0.1", port_);
    for (int i = 0; i < timeout_s * 10; ++i) {
      if (pid_ <= 0 || ::waitpid(pid_, nullptr, WNOHANG) == pid_) return false;
      if (auto res = client.Get("/health"); res && res->status == 200) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  nlohmann::json post(const std::string& path, const nlohmann::json& body, int* status) {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(120, 0);
    auto res = client.Post(path, body.dump(), "application/json");
    *status = res ? res->status : -1;
    if (!res) return {};
    return nlohmann::json::parse(res->body, nullptr, false);
  }
  std::string log() const {
    auto bytes = kvshare::testing::read_file_bytes(log_);
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }

 private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
  int port_ = 0;
};

struct RestoreCase {
  const char* name;
  GgmlType type_k;
  GgmlType type_v;
  bool flash_attn;
};

class LlamaServerRestore : public kvshare::testing::FdLeakCheck, public ::testing::WithParamInterface<RestoreCase> {};

TEST_P(LlamaServerRestore, RestoresOurFileAndEvaluatesOneToken) {
  const char* binary = std::getenv("LLAMA_SERVER");
  if (binary == nullptr || *binary == '\0')
    GTEST_SKIP() << "set LLAMA_SERVER=/path/to/llama-server to run the interop test against a real llama.cpp";
  const RestoreCase& c = GetParam();
  kvshare::testing::TempDir dir;

  // The model: qwen3, 2 layers, 2 KV heads of 64 (the worked example's cache shape).
  refmodel::GeneratorOptions model_options;
  auto model_bytes = refmodel::generate_model_bytes(model_options);
  ASSERT_TRUE(model_bytes) << model_bytes.error().what();
  const auto model_path = dir / "tiny.gguf";
  kvshare::testing::write_file_bytes(model_path, *model_bytes);
  auto gguf = layout::parse_gguf(*model_bytes, "tiny.gguf");
  ASSERT_TRUE(gguf) << gguf.error().what();
  auto model = layout::derive_model_shape(gguf->metadata);
  ASSERT_TRUE(model) << model.error().what();
  layout::KvParams params;
  params.n_ctx = 512;
  params.type_k = c.type_k;
  params.type_v = c.type_v;
  params.flash_attn = c.flash_attn;
  auto memory = layout::derive_memory_shape(*model, params);
  ASSERT_TRUE(memory) << memory.error().what();

  const auto slots = dir / "slots";
  std::filesystem::create_directory(slots);
  LlamaServer server(binary,
                     {"-m", model_path.string(), "-c", "512", "-np", "1", "-t", "1", "--no-warmup", "--cache-ram", "0",
                      "-fa", c.flash_attn ? "on" : "off", "-ctk", std::string(layout::ggml_type_name(c.type_k)), "-ctv",
                      std::string(layout::ggml_type_name(c.type_v)), "--slot-save-path", slots.string()},
                     dir / "server.log");
  ASSERT_TRUE(server.wait_ready(120)) << "llama-server did not come up:\n" << server.log();

  const std::string prompt = "The quick brown fox jumps over the lazy dog, again and again.";
  int status = 0;
  auto tokenized =
      server.post("/tokenize", {{"content", prompt}, {"add_special", true}, {"parse_special", true}}, &status);
  ASSERT_EQ(status, 200) << server.log();
  const auto tokens = tokenized["tokens"].get<std::vector<int32_t>>();
  ASSERT_GT(tokens.size(), 4u);

  // The version this llama-server reads: the one its save of the empty slot writes (how
  // kvshare-serve learns it). 3 for the pinned tree, 2 for d32676d.
  server.post("/slots/0?action=save", {{"filename", "probe.bin"}}, &status);
  ASSERT_EQ(status, 200) << server.log();
  auto version = route::read_state_file_version(slots / "probe.bin");
  ASSERT_TRUE(version) << version.error().what();

  // Our file: random K/V rows (the cache reuse does not depend on their values).
  StateFileWriterOptions options;
  options.state_version = *version;
  options.n_embd_head_k = model->layers.at(0).n_embd_head_k;
  options.n_embd_head_v = model->layers.at(0).n_embd_head_v;
  auto writer =
      StateFileWriter::create(slots / "ours.bin", *memory, tokens, static_cast<int32_t>(tokens.size()), options);
  ASSERT_TRUE(writer) << writer.error().what();
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (const auto& cache : memory->kv_caches)
    for (const auto& layer : cache.layers) {
      std::vector<float> k(tokens.size() * layer.n_embd_k_gqa), v(tokens.size() * layer.n_embd_v_gqa);
      for (float& x : k) x = dist(rng);
      for (float& x : v) x = dist(rng);
      const auto n = static_cast<uint32_t>(tokens.size());
      ASSERT_TRUE(writer->write_layer(layer.il, RowsView{GgmlType::F32, k.data(), n, 0},
                                      RowsView{GgmlType::F32, v.data(), n, 0}));
    }
  auto info = writer->commit();
  ASSERT_TRUE(info) << info.error().what();

  auto restored = server.post("/slots/0?action=restore", {{"filename", "ours.bin"}}, &status);
  ASSERT_EQ(status, 200) << restored.dump() << "\n" << server.log();
  EXPECT_EQ(restored["n_restored"].get<size_t>(), tokens.size());
  EXPECT_EQ(restored["n_read"].get<uint64_t>(), info->size_bytes);

  auto completion = server.post(
      "/completion", {{"prompt", tokens}, {"n_predict", 1}, {"id_slot", 0}, {"cache_prompt", true}}, &status);
  ASSERT_EQ(status, 200) << completion.dump() << "\n" << server.log();
  EXPECT_EQ(completion["timings"]["prompt_n"].get<int>(), 1) << completion["timings"].dump();
  EXPECT_EQ(completion["timings"]["cache_n"].get<size_t>(), tokens.size() - 1);

  // And the reverse direction: what llama-server saves, our reader accepts against the shape.
  auto saved = server.post("/slots/0?action=save", {{"filename", "theirs.bin"}}, &status);
  ASSERT_EQ(status, 200) << saved.dump();
  auto theirs = read_state_file(slots / "theirs.bin", &*memory);
  ASSERT_TRUE(theirs) << theirs.error().what();
  EXPECT_EQ(theirs->layout().version, *version);
  // Version 3's llama-server packs the prompt (server_tokens::serialize); the ids inside are
  // the prompt's, whichever form the file has.
  ASSERT_GE(theirs->tokens().size(), tokens.size());
  EXPECT_TRUE(std::equal(tokens.begin(), tokens.end(), theirs->tokens().begin()));
  if (*version >= layout::kStateSeqVersion3) {
    EXPECT_EQ(theirs->layout().token_form, layout::StateTokenForm::server_packed);
  }

  // A file of the other generation is refused by this llama-server (it reads its own only),
  // and our converter makes it restorable.
  const uint32_t other = *version == layout::kStateSeqVersion3 ? layout::kStateSeqVersion2 : layout::kStateSeqVersion3;
  ConvertOptions to_other;
  to_other.type_k.reset();
  to_other.type_v.reset();
  to_other.to_version = other;
  ASSERT_TRUE(convert_state_file(slots / "ours.bin", slots / "other.bin", to_other));
  auto refused = server.post("/slots/0?action=restore", {{"filename", "other.bin"}}, &status);
  EXPECT_EQ(status, 400) << refused.dump();
  ConvertOptions back = to_other;
  back.to_version = *version;
  ASSERT_TRUE(convert_state_file(slots / "other.bin", slots / "back.bin", back));
  auto again = server.post("/slots/0?action=restore", {{"filename", "back.bin"}}, &status);
  ASSERT_EQ(status, 200) << again.dump() << "\n" << server.log();
  EXPECT_EQ(again["n_restored"].get<size_t>(), tokens.size());
}

INSTANTIATE_TEST_SUITE_P(CacheTypes, LlamaServerRestore,
                         ::testing::Values(RestoreCase{"f16_fa_on", GgmlType::F16, GgmlType::F16, true},
                                           RestoreCase{"f16_fa_off", GgmlType::F16, GgmlType::F16, false},
                                           RestoreCase{"q8_0", GgmlType::Q8_0, GgmlType::Q8_0, true}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvshare::statefile
