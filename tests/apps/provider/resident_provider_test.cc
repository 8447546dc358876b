// kvshare-prefill --serve / --serve-fd, the resident reference provider (issue 24): it
// answers serve's region and prefill requests with the bytes the per-request provider
// writes, keeps one region, refuses what it cannot do with a reply and goes on serving.
// The session runs on a thread over a socket pair; this test plays kvshare-serve.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "apps/provider/prefill_provider.h"
#include "apps/provider/resident_provider.h"
#include "kvshare/fd.h"
#include "kvshare/handshake/message.h"
#include "kvshare/handshake/transport.h"
#include "kvshare/share/provider_channel.h"
#include "kvshare/share/provider_protocol.h"
#include "kvshare/share/spawn.h"
#include "layout/share_header.h"
#include "layout/tensor_type.h"
#include "refmodel/model_generator.h"
#include "refmodel/tiny_model.h"
#include "support/test_support.h"

namespace kvshare::refmodel {
namespace {

using kvshare::testing::TempDir;
using kvshare::testing::tool_path;

constexpr int kTimeoutMs = static_cast<int>(std::chrono::milliseconds(kvshare::testing::kLoadedDeadline).count());

void write_text(const std::filesystem::path& p, const std::string& s) { std::ofstream(p) << s; }

std::string ids_lines(std::span<const int32_t> ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + "\n";
  return s;
}

// The first byte at which `a` and `b` differ, -1 when they are equal (a vector of bytes
// would print megabytes on a failed EXPECT_EQ).
int64_t first_difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int64_t>(n);
}

bool all_zero(const std::vector<std::byte>& bytes) {
  for (std::byte b : bytes)
    if (b != std::byte{0}) return false;
  return true;
}

// A decoder's region as a CPU decoder exports it: one sealed memfd per chunk of `header`,
// zero-filled, mapped here. Close-on-exec: it reaches the provider by SCM_RIGHTS (or, for
// the per-request provider run in this process, by number).
class MemfdRegion {
 public:
  MemfdRegion(const layout::ShareHeader& header, const std::string& name) : header_(header), name_(name) {
    for (const auto& chunk : header.layout.chunks) {
      Fd fd(memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
      EXPECT_TRUE(fd) << std::strerror(errno);
      if (!fd) return;
      EXPECT_EQ(ftruncate(fd.get(), static_cast<off_t>(chunk.size_bytes)), 0);
      EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
      void* p = mmap(nullptr, chunk.size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
      EXPECT_NE(p, MAP_FAILED);
      if (p == MAP_FAILED) return;
      fds_.push_back(std::move(fd));
      chunks_.emplace_back(static_cast<std::byte*>(p), chunk.size_bytes);
    }
  }
  ~MemfdRegion() {
    for (auto chunk : chunks_) munmap(chunk.data(), chunk.size());
  }
  MemfdRegion(const MemfdRegion&) = delete;
  MemfdRegion& operator=(const MemfdRegion&) = delete;

  std::vector<int> fds() const {
    std::vector<int> out;
    for (const Fd& fd : fds_) out.push_back(fd.get());
    return out;
  }
  // Duplicates for run_prefill, which takes the descriptors it is given.
  std::vector<int> duplicate_fds() const {
    std::vector<int> out;
    for (const Fd& fd : fds_) out.push_back(fcntl(fd.get(), F_DUPFD_CLOEXEC, 3));
    return out;
  }
  std::vector<std::byte> bytes() const {
    std::vector<std::byte> out;
    for (auto chunk : chunks_) out.insert(out.end(), chunk.begin(), chunk.end());
    return out;
  }
  // How many descriptors of this process refer to this region's memfds (ours included).
  int open_references() const {
    int n = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      const auto target = std::filesystem::read_symlink(entry.path(), ec);
      if (!ec && target.string().rfind("/memfd:" + name_ + " ", 0) == 0) ++n;
    }
    return n;
  }
  const layout::ShareHeader& header() const { return header_; }

 private:
  layout::ShareHeader header_;
  std::string name_;
  std::vector<Fd> fds_;
  std::vector<std::span<std::byte>> chunks_;
};

ProviderRequest region_request(uint64_t region_id, const layout::ShareHeader& header) {
  ProviderRequest request;
  request.op = ProviderOp::region;
  request.region_id = region_id;
  request.share.type = handshake::MessageType::share;
  request.share.share_id = 100 + region_id;
  for (uint32_t c = 0; c < header.layout.chunks.size(); ++c)
    request.share.fds.push_back(
        {c, "memfd", 0, header.layout.chunks[c].size_bytes, header.layout.chunks[c].layout_hash});
  request.share.header_json = layout::to_json(header, false);
  return request;
}

ProviderRequest shared_prefill(uint64_t region_id, std::vector<int32_t> tokens, uint32_t n_cached = 0) {
  ProviderRequest request;
  request.op = ProviderOp::prefill;
  request.route = PrefillRoute::shared;
  request.region_id = region_id;
  request.share_id = 7;
  request.n_cached = n_cached;
  request.tokens = std::move(tokens);
  return request;
}

// kvshare-serve's end of the channel.
class ServeEnd {
 public:
  explicit ServeEnd(Fd socket) : socket_(std::move(socket)) {}
  int fd() const { return socket_.get(); }
  void close() { socket_.reset(); }

  Result<ProviderReply> receive() {
    auto frame = handshake::receive_frame(socket_.get(), kTimeoutMs, "the resident provider", -1, "provider reply",
                                          kMaxProviderMessageBytes);
    if (!frame) return fail(frame.error());
    EXPECT_TRUE(frame->fds.empty());
    return parse_provider_reply({reinterpret_cast<const char*>(frame->body.data()), frame->body.size()}, "reply");
  }
  Result<ProviderReply> call(const ProviderRequest& request, std::span<const int> fds = {}) {
    const auto frame = handshake::length_prefixed(encode_provider_request(request));
    if (auto sent = handshake::send_frame(socket_.get(), frame, fds, kTimeoutMs, "provider request"); !sent)
      return fail(sent.error());
    return receive();
  }

 private:
  Fd socket_;
};

class ResidentSession : public kvshare::testing::FdLeakCheck {
 protected:
  void SetUp() override {
    kvshare::testing::FdLeakCheck::SetUp();
    options_.residual_gain = 3.0f;  // later layers' K/V depend on the attention over earlier cells
    auto bytes = generate_model_bytes(options_);
    ASSERT_TRUE(bytes) << bytes.error().what();
    model_path_ = dir_ / "m.gguf";
    kvshare::testing::write_file_bytes(model_path_, *bytes);
    auto model = load_provider_model(model_path_.string());
    ASSERT_TRUE(model) << model.error().what();
    model_ = std::move(*model);
    header_ = header_of(model_, params_);
    write_text(dir_ / "layout.json", layout::to_json(header_));
    prompt_ = prompt_ids();
  }

  void TearDown() override {
    if (serve_) serve_->close();
    if (thread_.joinable()) thread_.join();
    kvshare::testing::FdLeakCheck::TearDown();
  }

  static layout::ShareHeader header_of(const ProviderModel& model, const layout::KvParams& params) {
    auto header = provider_share_header(model, params);
    EXPECT_TRUE(header) << header.error().what();
    return header ? *header : layout::ShareHeader{};
  }

  // A ChatML prompt less its last token, as serve hands it over.
  std::vector<int32_t> prompt_ids() const {
    const Model& model = *model_.model;
    auto text = model.apply_chat_template({{"user", "Hello, how is the system? Tell me about the weather."}}, true);
    auto ids = *model.tokenizer().tokenize(*text, true, true);
    ids.pop_back();
    return ids;
  }

  // Starts the session on a thread and takes its hello.
  void start() {
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    serve_.emplace(Fd(sv[0]));
    auto channel = ProviderChannel::from_fd(Fd(sv[1]));
    ASSERT_TRUE(channel) << channel.error().what();
    provider_ = std::make_unique<ResidentProvider>(model_, 1);
    thread_ = std::thread([this, channel = std::move(*channel)]() mutable { ended_ = provider_->serve(channel); });
    auto hello = serve_->receive();
    ASSERT_TRUE(hello) << hello.error().what();
    EXPECT_EQ(hello->op, ProviderOp::hello);
    EXPECT_EQ(hello->pid, static_cast<uint64_t>(getpid()));
    EXPECT_TRUE(hello->takes_shared && hello->takes_file && hello->takes_cached);
  }

  // Closes serve's end and returns how the session ended.
  Result<ChannelEnd> finish() {
    serve_->close();
    thread_.join();
    return ended_;
  }

  ProviderReply call(const ProviderRequest& request, std::span<const int> fds = {}) {
    auto reply = serve_->call(request, fds);
    EXPECT_TRUE(reply) << reply.error().what();
    return reply ? *reply : ProviderReply{};
  }

  void send_region(uint64_t region_id, const MemfdRegion& region) {
    const auto fds = region.fds();
    const ProviderReply reply = call(region_request(region_id, region.header()), fds);
    ASSERT_TRUE(reply.ok) << reply.error;
    EXPECT_EQ(reply.op, ProviderOp::region);
    EXPECT_EQ(reply.region_id, region_id);
    EXPECT_GE(reply.region_ms, 0.0);
  }

  // The per-request provider (run_prefill, as kvshare-prefill --layout --fds runs it).
  void per_request_shared(const MemfdRegion& region, std::span<const int32_t> ids, uint32_t n_cached = 0) {
    write_text(dir_ / "ids.txt", ids_lines(ids));
    PrefillRequest request;
    request.model_path = model_path_.string();
    request.tokens_path = (dir_ / "ids.txt").string();
    request.layout_path = (dir_ / "layout.json").string();
    request.fds = region.duplicate_fds();
    if (n_cached > 0) request.n_cached = n_cached;
    request.n_threads = 1;
    auto report = run_prefill(request);
    ASSERT_TRUE(report) << report.error().what();
  }

  TempDir dir_;
  GeneratorOptions options_;
  std::filesystem::path model_path_;
  ProviderModel model_;
  layout::KvParams params_ = testing::small_params(512, layout::GgmlType::Q8_0, layout::GgmlType::Q8_0, true);
  layout::ShareHeader header_;
  std::vector<int32_t> prompt_;
  std::optional<ServeEnd> serve_;
  std::unique_ptr<ResidentProvider> provider_;
  std::thread thread_;
  Result<ChannelEnd> ended_ = fail(EINPROGRESS, "the session has not ended");
};

// Stream `stream`'s bytes of every KV tensor of `region`, in layout order: a cache tensor
// is [width, kv_size, n_stream] (a transposed V too), so each stream is one contiguous
// slice of nbytes / n_stream.
std::vector<std::byte> stream_bytes(const MemfdRegion& region, uint32_t stream) {
  const layout::ShareHeader& header = region.header();
  const std::vector<std::byte> all = region.bytes();
  std::vector<uint64_t> chunk_base{0};
  for (const auto& chunk : header.layout.chunks) chunk_base.push_back(chunk_base.back() + chunk.size_bytes);
  std::vector<std::byte> out;
  for (const auto& t : header.layout.tensors) {
    const uint64_t n_stream = static_cast<uint64_t>(t.tensor.ne[2]);
    const uint64_t slice = t.tensor.nbytes / n_stream;
    const auto begin = all.begin() + static_cast<std::ptrdiff_t>(chunk_base[t.chunk] + t.offset + stream * slice);
    out.insert(out.end(), begin, begin + static_cast<std::ptrdiff_t>(slice));
  }
  return out;
}

// Issue #27: slot 2 of llama-server -np 3 (no --kv-unified) is stream 2 of every cache
// tensor. Both forms of the provider write exactly stream 0's bytes, moved to stream 2, and
// leave the other slots' streams as they were.
TEST_F(ResidentSession, WritesTheStreamOfThePrefillMessageAsThePerRequestStreamFlag) {
  layout::KvParams three = params_;
  three.n_ctx = 3 * params_.n_ctx;
  three.n_seq_max = 3;
  three.kv_unified = false;
  const layout::ShareHeader header3 = header_of(model_, three);
  ASSERT_EQ(header3.memory.kv_caches.front().n_stream, 3u);
  write_text(dir_ / "layout3.json", layout::to_json(header3));
  MemfdRegion resident(header3, "resident-s2"), per_request(header3, "per-request-s2"), slot0(header3, "slot0");
  auto run_per_request = [&](const MemfdRegion& region, uint32_t stream) {
    write_text(dir_ / "ids.txt", ids_lines(prompt_));
    PrefillRequest request;
    request.model_path = model_path_.string();
    request.tokens_path = (dir_ / "ids.txt").string();
    request.layout_path = (dir_ / "layout3.json").string();
    request.fds = region.duplicate_fds();
    request.stream = stream;
    request.n_threads = 1;
    return run_prefill(request);
  };
  start();
  send_region(1, resident);
  ProviderRequest prefill = shared_prefill(1, prompt_);
  prefill.stream = 2;
  const ProviderReply reply = call(prefill);
  ASSERT_TRUE(reply.ok) << reply.error;
  ASSERT_TRUE(run_per_request(per_request, 2));
  ASSERT_TRUE(run_per_request(slot0, 0));

  const std::vector<std::byte> moved = stream_bytes(slot0, 0);
  ASSERT_FALSE(all_zero(moved));
  EXPECT_EQ(first_difference(stream_bytes(resident, 2), moved), -1);
  EXPECT_EQ(first_difference(stream_bytes(per_request, 2), moved), -1);
  for (uint32_t other : {0u, 1u}) {
    EXPECT_TRUE(all_zero(stream_bytes(resident, other))) << "stream " << other;
    EXPECT_TRUE(all_zero(stream_bytes(per_request, other))) << "stream " << other;
  }
  EXPECT_EQ(first_difference(resident.bytes(), per_request.bytes()), -1);
}

// Cells first..first+n-1 of stream 0 of every KV tensor of `region`, in layout order
// (rows of nbytes / (kv_size * n_stream) bytes: V not transposed, flash attention on).
std::vector<std::byte> cell_bytes(const MemfdRegion& region, uint32_t first, uint32_t n) {
  const layout::ShareHeader& header = region.header();
  const std::vector<std::byte> all = region.bytes();
  std::vector<uint64_t> chunk_base{0};
  for (const auto& chunk : header.layout.chunks) chunk_base.push_back(chunk_base.back() + chunk.size_bytes);
  std::vector<std::byte> out;
  for (const auto& t : header.layout.tensors) {
    const uint64_t rows = static_cast<uint64_t>(t.tensor.ne[1]) * static_cast<uint64_t>(t.tensor.ne[2]);
    const uint64_t row = t.tensor.nbytes / rows;
    const auto begin = all.begin() + static_cast<std::ptrdiff_t>(chunk_base[t.chunk] + t.offset + first * row);
    out.insert(out.end(), begin, begin + static_cast<std::ptrdiff_t>(n * row));
  }
  return out;
}

// Issue #27, a unified cache (llama-server's -np auto, --kv-unified): every slot's cells in
// one stream, so a share names the run of cells the decoder reserved for the sequence.
// Both forms of the provider write position p at cell 100 + p: exactly the bytes a prefill
// without a range writes at cell p, and no other byte.
TEST_F(ResidentSession, WritesTheRunOfCellsOfThePrefillMessageAsTheFlags) {
  ASSERT_LE(prompt_.size(), 40u);
  const auto n = static_cast<uint32_t>(prompt_.size());
  start();
  uint64_t region_id = 0;
  for (layout::GgmlType type : {layout::GgmlType::Q8_0, layout::GgmlType::F16}) {
    SCOPED_TRACE(static_cast<int>(type));
    layout::KvParams unified = params_;
    unified.type_k = unified.type_v = type;
    unified.n_seq_max = 3;
    unified.kv_unified = true;
    const layout::ShareHeader header = header_of(model_, unified);
    ASSERT_EQ(header.memory.kv_caches.front().n_stream, 1u);
    ASSERT_EQ(header.memory.kv_caches.front().kv_size, 512u);
    write_text(dir_ / "layout-unified.json", layout::to_json(header));
    MemfdRegion resident(header, "resident-cells"), per_request(header, "per-request-cells"), plain(header, "plain");
    send_region(++region_id, resident);
    ProviderRequest prefill = shared_prefill(region_id, prompt_);
    prefill.first_cell = 100;
    prefill.n_cells = 40;
    const ProviderReply reply = call(prefill);
    ASSERT_TRUE(reply.ok) << reply.error;
    auto run_per_request = [&](const MemfdRegion& region, std::optional<uint32_t> first_cell,
                               std::optional<uint32_t> n_cells) {
      write_text(dir_ / "ids.txt", ids_lines(prompt_));
      PrefillRequest request;
      request.model_path = model_path_.string();
      request.tokens_path = (dir_ / "ids.txt").string();
      request.layout_path = (dir_ / "layout-unified.json").string();
      request.fds = region.duplicate_fds();
      request.first_cell = first_cell;
      request.n_cells = n_cells;
      request.n_threads = 1;
      return run_prefill(request);
    };
    auto ranged = run_per_request(per_request, 100, 40);
    ASSERT_TRUE(ranged) << ranged.error().what();
    ASSERT_TRUE(run_per_request(plain, std::nullopt, std::nullopt));

    const std::vector<std::byte> expected = cell_bytes(plain, 0, n);
    ASSERT_FALSE(all_zero(expected));
    EXPECT_EQ(first_difference(cell_bytes(resident, 100, n), expected), -1);
    EXPECT_EQ(first_difference(resident.bytes(), per_request.bytes()), -1);
    EXPECT_TRUE(all_zero(cell_bytes(resident, 0, 100)));
    EXPECT_TRUE(all_zero(cell_bytes(resident, 100 + n, 512 - 100 - n)));
  }
}

TEST_F(ResidentSession, RefusesARunOfCellsThatCannotTakeThePromptAndWritesNothing) {
  layout::KvParams unified = params_;
  unified.n_seq_max = 3;
  unified.kv_unified = true;
  const layout::ShareHeader header = header_of(model_, unified);
  write_text(dir_ / "layout-unified.json", layout::to_json(header));
  MemfdRegion resident(header, "resident-short"), per_request(header, "per-request-short");
  start();
  send_region(1, resident);
  ProviderRequest prefill = shared_prefill(1, prompt_);
  prefill.first_cell = 100;
  prefill.n_cells = 2;  // fewer cells than ids
  ProviderReply refused = call(prefill);
  ASSERT_FALSE(refused.ok);
  EXPECT_EQ(refused.error_errno, ERANGE);
  EXPECT_NE(refused.error.find("field \"n_cells\" 2"), std::string::npos) << refused.error;
  prefill.first_cell = 500;
  prefill.n_cells = 40;  // past kv_size 512
  refused = call(prefill);
  ASSERT_FALSE(refused.ok);
  EXPECT_EQ(refused.error_errno, EINVAL);
  EXPECT_NE(refused.error.find("kv_size 512"), std::string::npos) << refused.error;
  EXPECT_TRUE(all_zero(resident.bytes()));

  write_text(dir_ / "ids.txt", ids_lines(prompt_));
  PrefillRequest request;
  request.model_path = model_path_.string();
  request.tokens_path = (dir_ / "ids.txt").string();
  request.layout_path = (dir_ / "layout-unified.json").string();
  request.first_cell = 100;
  request.n_cells = 40;
  request.n_cached = 2;  // a unified share never has cached cells
  request.fds = per_request.duplicate_fds();
  auto cached = run_prefill(request);
  ASSERT_FALSE(cached);
  EXPECT_EQ(cached.error().errno_value(), ENOTSUP);
  EXPECT_NE(cached.error().message().find("--cached 2 with --first-cell 100"), std::string::npos)
      << cached.error().what();
  EXPECT_TRUE(all_zero(per_request.bytes()));

  PrefillRequest file_route;
  file_route.model_path = model_path_.string();
  file_route.tokens_path = (dir_ / "ids.txt").string();
  file_route.out_path = (dir_ / "out.state").string();
  file_route.first_cell = 100;
  auto usage = check_prefill_usage(file_route);
  ASSERT_FALSE(usage);
  EXPECT_NE(usage.error().message().find("--first-cell is for the shared route"), std::string::npos)
      << usage.error().what();
}

TEST_F(ResidentSession, RefusesAStreamPastNStreamAndWritesNothing) {
  layout::KvParams three = params_;
  three.n_ctx = 3 * params_.n_ctx;
  three.n_seq_max = 3;
  three.kv_unified = false;
  const layout::ShareHeader header3 = header_of(model_, three);
  write_text(dir_ / "layout3.json", layout::to_json(header3));
  MemfdRegion resident(header3, "resident-s3"), per_request(header3, "per-request-s3");
  start();
  send_region(1, resident);
  ProviderRequest prefill = shared_prefill(1, prompt_);
  prefill.stream = 3;
  const ProviderReply refused = call(prefill);
  ASSERT_FALSE(refused.ok);
  EXPECT_EQ(refused.error_errno, EINVAL);
  EXPECT_NE(refused.error.find("field \"stream\" 3: the decoder's KV cache has n_stream 3"), std::string::npos)
      << refused.error;
  EXPECT_TRUE(all_zero(resident.bytes()));
  EXPECT_TRUE(call(shared_prefill(1, prompt_)).ok);  // and it goes on serving

  write_text(dir_ / "ids.txt", ids_lines(prompt_));
  PrefillRequest request;
  request.model_path = model_path_.string();
  request.tokens_path = (dir_ / "ids.txt").string();
  request.layout_path = (dir_ / "layout3.json").string();
  request.fds = per_request.duplicate_fds();
  request.stream = 3;
  auto usage = check_prefill_usage(request);
  ASSERT_FALSE(usage);
  EXPECT_NE(usage.error().message().find("--stream 3: the decoder's KV cache has n_stream 3"), std::string::npos)
      << usage.error().what();
  auto report = run_prefill(request);
  ASSERT_FALSE(report);
  EXPECT_EQ(report.error().errno_value(), EINVAL);
  EXPECT_TRUE(all_zero(per_request.bytes()));
}

TEST_F(ResidentSession, WritesTheRegionAsThePerRequestProviderAndTakesASecondPrefillOnIt) {
  MemfdRegion resident(header_, "resident-a"), per_request(header_, "per-request-a");
  start();
  send_region(1, resident);
  const std::vector<int32_t> first(prompt_.begin(), prompt_.end());
  ProviderReply reply = call(shared_prefill(1, first));
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_EQ(reply.n_prefilled, first.size());
  per_request_shared(per_request, first);
  ASSERT_FALSE(all_zero(resident.bytes()));
  EXPECT_EQ(first_difference(resident.bytes(), per_request.bytes()), -1);

  // The next handoff on the same region: no region request in between.
  const std::vector<int32_t> second(prompt_.rbegin(), prompt_.rend());
  reply = call(shared_prefill(1, second));
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_EQ(reply.n_prefilled, second.size());
  per_request_shared(per_request, second);
  EXPECT_EQ(first_difference(resident.bytes(), per_request.bytes()), -1);
}

TEST_F(ResidentSession, ExtendsCachedCellsAsThePerRequestCachedPrefill) {
  MemfdRegion resident(header_, "resident-a"), per_request(header_, "per-request-a");
  const uint32_t p = static_cast<uint32_t>(prompt_.size()) / 2;
  const std::vector<int32_t> head(prompt_.begin(), prompt_.begin() + p);
  start();
  send_region(1, resident);
  ASSERT_TRUE(call(shared_prefill(1, head)).ok);
  const ProviderReply reply = call(shared_prefill(1, prompt_, p));
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_EQ(reply.n_prefilled, prompt_.size() - p);
  per_request_shared(per_request, head);
  per_request_shared(per_request, prompt_, p);
  EXPECT_EQ(first_difference(resident.bytes(), per_request.bytes()), -1);
}

// A chat's next turn in slot 1 of a decoder with one stream per slot: the cached cells are
// stream 1's, and the incremental prefill reads and writes that stream alone.
TEST_F(ResidentSession, ExtendsCachedCellsOfItsOwnStreamOnly) {
  layout::KvParams three = params_;
  three.n_ctx = 3 * params_.n_ctx;
  three.n_seq_max = 3;
  three.kv_unified = false;
  const layout::ShareHeader header3 = header_of(model_, three);
  MemfdRegion slot1(header3, "slot1"), slot0(header3, "slot0");
  const uint32_t p = static_cast<uint32_t>(prompt_.size()) / 2;
  const std::vector<int32_t> head(prompt_.begin(), prompt_.begin() + p);
  start();
  for (auto [region_id, stream] : {std::pair<uint64_t, uint32_t>{1, 1}, {2, 0}}) {
    send_region(region_id, region_id == 1 ? slot1 : slot0);  // the provider holds one region at a time
    ProviderRequest first = shared_prefill(region_id, head);
    first.stream = stream;
    ASSERT_TRUE(call(first).ok);
    ProviderRequest next = shared_prefill(region_id, prompt_, p);
    next.stream = stream;
    const ProviderReply reply = call(next);
    ASSERT_TRUE(reply.ok) << reply.error;
    EXPECT_EQ(reply.n_prefilled, prompt_.size() - p);
  }
  const std::vector<std::byte> moved = stream_bytes(slot0, 0);
  ASSERT_FALSE(all_zero(moved));
  EXPECT_EQ(first_difference(stream_bytes(slot1, 1), moved), -1);
  for (uint32_t other : {0u, 2u}) EXPECT_TRUE(all_zero(stream_bytes(slot1, other))) << "stream " << other;
}

// The provider keeps its own cache and Context from one prompt to the next: what a longer
// prompt left in them must not reach a shorter one's cells. The short prompt goes to a
// fresh region, so every byte of it can be set against a fresh provider's.
TEST_F(ResidentSession, WritesAShortPromptAfterALongOneAsAFreshProviderDoes) {
  std::vector<int32_t> long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt.push_back(static_cast<int32_t>((i * 37 + 11) % 120 + 3));
  MemfdRegion a(header_, "resident-a"), b(header_, "resident-b"), fresh(header_, "resident-fresh");
  start();
  send_region(1, a);
  ASSERT_TRUE(call(shared_prefill(1, long_prompt)).ok);
  send_region(2, b);
  const ProviderReply reply = call(shared_prefill(2, prompt_));
  ASSERT_TRUE(reply.ok) << reply.error;
  ASSERT_TRUE(finish());

  start();  // another provider, its first prompt
  send_region(1, fresh);
  ASSERT_TRUE(call(shared_prefill(1, prompt_)).ok);
  ASSERT_FALSE(all_zero(fresh.bytes()));
  EXPECT_EQ(first_difference(b.bytes(), fresh.bytes()), -1);
}

TEST_F(ResidentSession, WritesTheStateFileOfAShortPromptAfterALongOneAsAFreshProviderDoes) {
  std::vector<int32_t> long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt.push_back(static_cast<int32_t>((i * 37 + 11) % 120 + 3));
  const auto file_request = [&](const std::string& name, std::vector<int32_t> tokens) {
    ProviderRequest request;
    request.op = ProviderOp::prefill;
    request.route = PrefillRoute::file;
    request.state_file = (dir_ / name).string();
    request.kv = {512, "f16", "f16", false};  // a transposed V: cells of a channel lie kv_size apart
    request.tokens = std::move(tokens);
    return request;
  };
  start();
  ASSERT_TRUE(call(file_request("long.bin", long_prompt)).ok);
  ASSERT_TRUE(call(file_request("short.bin", prompt_)).ok);
  ASSERT_TRUE(finish());
  start();
  ASSERT_TRUE(call(file_request("fresh.bin", prompt_)).ok);
  const auto fresh_bytes = kvshare::testing::read_file_bytes(dir_ / "fresh.bin");
  ASSERT_FALSE(fresh_bytes.empty());
  EXPECT_EQ(first_difference(kvshare::testing::read_file_bytes(dir_ / "short.bin"), fresh_bytes), -1);
}

TEST_F(ResidentSession, RefusesAStaleRegionIdWithEstaleNamingBothIds) {
  MemfdRegion a(header_, "resident-a");
  start();
  ProviderReply reply = call(shared_prefill(2, prompt_));
  EXPECT_FALSE(reply.ok);
  EXPECT_EQ(reply.error_errno, ESTALE);
  EXPECT_NE(reply.error.find("no region is held"), std::string::npos) << reply.error;

  send_region(1, a);
  reply = call(shared_prefill(2, prompt_));
  EXPECT_FALSE(reply.ok);
  EXPECT_EQ(reply.error_errno, ESTALE);
  EXPECT_NE(reply.error.find("region 2 is not the one held (1)"), std::string::npos) << reply.error;
  EXPECT_TRUE(all_zero(a.bytes()));
}

TEST_F(ResidentSession, ReplacesTheHeldRegionWithANewOneAndUnmapsTheOld) {
  MemfdRegion a(header_, "resident-a"), b(header_, "resident-b");
  start();
  send_region(1, a);
  EXPECT_EQ(a.open_references(), 2);  // ours and the provider's
  send_region(2, b);
  EXPECT_EQ(a.open_references(), 1);  // the provider let go of region 1 (its fds closed)
  ProviderReply reply = call(shared_prefill(1, prompt_));
  EXPECT_EQ(reply.error_errno, ESTALE) << reply.error;
  EXPECT_NE(reply.error.find("region 1 is not the one held (2)"), std::string::npos) << reply.error;
  reply = call(shared_prefill(2, prompt_));
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_TRUE(all_zero(a.bytes()));
  EXPECT_FALSE(all_zero(b.bytes()));
}

TEST_F(ResidentSession, RefusesARegionOfAnotherModelNamingTheFieldAndKeepsServing) {
  GeneratorOptions other;
  other.n_layer = 3;
  auto other_model = testing::load_generated(other);
  ASSERT_TRUE(other_model);
  auto other_header = layout::make_share_header(
      layout::model_fingerprint(other_model->metadata(), other_model->tensor_infos()), other_model->shape(), params_);
  ASSERT_TRUE(other_header) << other_header.error().what();
  MemfdRegion foreign(*other_header, "foreign"), ours(header_, "resident-a");
  start();
  const auto fds = foreign.fds();
  ProviderReply reply = call(region_request(1, *other_header), fds);
  EXPECT_FALSE(reply.ok);
  EXPECT_EQ(reply.error_errno, EINVAL);
  EXPECT_NE(reply.error.find("region 1 from kvshare-serve"), std::string::npos) << reply.error;
  EXPECT_NE(reply.error.find("field \"model.n_layer\" is 3, this provider uses 2"), std::string::npos) << reply.error;
  EXPECT_EQ(foreign.open_references(), 1);  // the refused region's fds are closed
  reply = call(shared_prefill(1, prompt_));
  EXPECT_EQ(reply.error_errno, ESTALE) << reply.error;

  send_region(2, ours);
  reply = call(shared_prefill(2, prompt_));
  EXPECT_TRUE(reply.ok) << reply.error;
}

TEST_F(ResidentSession, RefusesAnIdOutsideTheVocabularyNamingTheFieldAndKeepsServing) {
  MemfdRegion region(header_, "resident-a");
  start();
  send_region(1, region);
  ProviderReply reply = call(shared_prefill(1, {5, 100000}));
  EXPECT_FALSE(reply.ok);
  EXPECT_EQ(reply.error_errno, EINVAL);
  EXPECT_NE(reply.error.find("field \"tokens\": id 100000 (entry 2) is outside the vocabulary"), std::string::npos)
      << reply.error;
  EXPECT_TRUE(all_zero(region.bytes()));
  reply = call(shared_prefill(1, prompt_));
  EXPECT_TRUE(reply.ok) << reply.error;
}

TEST_F(ResidentSession, WritesTheStateFileOfThePerRequestFileRoute) {
  ProviderRequest request;
  request.op = ProviderOp::prefill;
  request.route = PrefillRoute::file;
  request.state_file = (dir_ / "resident.bin").string();
  request.state_version = 2;
  request.kv = {512, "q8_0", "f16", false};  // a transposed V, a quantized K
  request.tokens = prompt_;
  start();
  const ProviderReply reply = call(request);
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_EQ(reply.n_prefilled, prompt_.size());

  write_text(dir_ / "ids.txt", ids_lines(prompt_));
  PrefillRequest per_request;
  per_request.model_path = model_path_.string();
  per_request.tokens_path = (dir_ / "ids.txt").string();
  per_request.out_path = (dir_ / "per-request.bin").string();
  per_request.params = testing::small_params(512, layout::GgmlType::Q8_0, layout::GgmlType::F16, false);
  per_request.state_version = 2;
  per_request.n_threads = 1;
  auto report = run_prefill(per_request);
  ASSERT_TRUE(report) << report.error().what();
  const auto resident_bytes = kvshare::testing::read_file_bytes(dir_ / "resident.bin");
  ASSERT_FALSE(resident_bytes.empty());
  EXPECT_EQ(first_difference(resident_bytes, kvshare::testing::read_file_bytes(dir_ / "per-request.bin")), -1);
}

TEST_F(ResidentSession, RefusesAFileRouteThatDoesNotFitTheContextAndLeavesNoFile) {
  ProviderRequest request;
  request.op = ProviderOp::prefill;
  request.route = PrefillRoute::file;
  request.state_file = (dir_ / "s.bin").string();
  request.kv = {256, "f16", "f16", true};
  request.tokens = std::vector<int32_t>(300, 7);
  start();
  ProviderReply reply = call(request);
  EXPECT_FALSE(reply.ok);
  EXPECT_EQ(reply.error_errno, ERANGE);
  EXPECT_NE(reply.error.find("field \"tokens\": 300 tokens do not fit the context of 256 cells (kv.n_ctx 256)"),
            std::string::npos)
      << reply.error;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "s.bin"));

  request.kv = {256, "q9_9", "f16", true};
  request.tokens = {1, 2, 3};
  reply = call(request);
  EXPECT_FALSE(reply.ok);
  EXPECT_NE(reply.error.find("field \"kv.type_k\""), std::string::npos) << reply.error;
  EXPECT_NE(reply.error.find("q9_9"), std::string::npos) << reply.error;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "s.bin"));
}

TEST_F(ResidentSession, EndsWhenServeClosesTheChannel) {
  MemfdRegion region(header_, "resident-a");
  start();
  send_region(1, region);
  auto ended = finish();
  ASSERT_TRUE(ended) << ended.error().what();
  EXPECT_EQ(*ended, ChannelEnd::closed);
  EXPECT_EQ(region.open_references(), 1);  // the provider dropped the region with the channel
}

TEST_F(ResidentSession, EndsWithAnErrorOnAFrameThatBreaksTheProtocol) {
  start();
  const auto frame = handshake::length_prefixed("{\"kvshare_provider\":1,\"op\":\"dance\"}");
  ASSERT_TRUE(handshake::send_frame(serve_->fd(), frame, {}, kTimeoutMs, "bad request"));
  thread_.join();
  ASSERT_FALSE(ended_);
  EXPECT_EQ(ended_.error().errno_value(), EINVAL);
  EXPECT_NE(ended_.error().message().find("\"op\" is \"dance\""), std::string::npos) << ended_.error().message();
}

// The tool: kvshare-prefill --serve-fd / --serve, as kvshare-serve starts or reaches it.
class ResidentTool : public kvshare::testing::FdLeakCheck {
 protected:
  void SetUp() override {
    kvshare::testing::FdLeakCheck::SetUp();
    auto bytes = generate_model_bytes({});
    ASSERT_TRUE(bytes);
    kvshare::testing::write_file_bytes(dir_ / "m.gguf", *bytes);
  }
  kvshare::testing::CommandResult run(const std::string& flags) {
    return kvshare::testing::run_command(
        fmt::format("{} --model {} {}", tool_path("kvshare-prefill").string(), (dir_ / "m.gguf").string(), flags));
  }
  TempDir dir_;
};

TEST_F(ResidentTool, ServesItsInheritedChannelAndExitsZeroWhenServeClosesIt) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  ServeEnd serve{Fd(sv[0])};
  Fd theirs(sv[1]);
  SpawnOptions spawn;
  spawn.inherit_fds = {{theirs.get(), 3}};
  spawn.capture_stderr = true;
  auto child = ChildProcess::spawn(
      {tool_path("kvshare-prefill").string(), "--serve-fd", "3", "--model", (dir_ / "m.gguf").string(), "-t", "1"},
      spawn);
  ASSERT_TRUE(child) << child.error().what();
  theirs.reset();
  auto hello = serve.receive();
  ASSERT_TRUE(hello) << hello.error().what();
  EXPECT_EQ(hello->pid, static_cast<uint64_t>(child->pid()));

  ProviderRequest request;
  request.op = ProviderOp::prefill;
  request.route = PrefillRoute::file;
  request.state_file = (dir_ / "s.bin").string();
  request.kv = {512, "f16", "f16", true};
  request.tokens = {1, 2, 3};
  auto reply = serve.call(request);
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_TRUE(reply->ok) << reply->error;
  EXPECT_TRUE(std::filesystem::exists(dir_ / "s.bin"));

  serve.close();
  auto finished = child->wait_for(kvshare::testing::kLoadedDeadline);
  ASSERT_TRUE(finished) << finished.error().what();
  EXPECT_TRUE(finished->status.ok()) << finished->status.describe() << "\n" << finished->err;
  EXPECT_NE(finished->err.find("kvshare-prefill: file route, 3 tokens (3 prefilled): forward"), std::string::npos)
      << finished->err;
  EXPECT_NE(finished->err.find("serve closed the channel"), std::string::npos) << finished->err;
}

TEST_F(ResidentTool, ListensServesOneServeAfterAnotherAndExitsZeroOnSigterm) {
  const auto socket_path = (dir_ / "provider.sock").string();
  SpawnOptions spawn;
  spawn.capture_stderr = true;
  auto child = ChildProcess::spawn(
      {tool_path("kvshare-prefill").string(), "--serve", socket_path, "--model", (dir_ / "m.gguf").string(), "-t", "1"},
      spawn);
  ASSERT_TRUE(child) << child.error().what();
  const auto connect = [&]() -> std::optional<ServeEnd> {
    std::optional<ServeEnd> serve;
    kvshare::testing::wait_until([&] {
      auto fd = handshake::connect_checked_listener(socket_path, kTimeoutMs);
      if (fd) serve.emplace(std::move(*fd));
      return serve.has_value() || !child->running();
    });
    return serve;
  };
  auto first = connect();
  ASSERT_TRUE(first) << "no listener at " << socket_path;
  auto hello = first->receive();
  ASSERT_TRUE(hello) << hello.error().what();
  EXPECT_EQ(hello->pid, static_cast<uint64_t>(child->pid()));
  first->close();

  // The next serve is accepted once the first has gone; SIGTERM finds it connected.
  auto second = connect();
  ASSERT_TRUE(second);
  hello = second->receive();
  ASSERT_TRUE(hello) << hello.error().what();
  const ExitStatus status = child->terminate(kvshare::testing::kLoadedDeadline);
  EXPECT_TRUE(status.ok()) << status.describe();
  EXPECT_FALSE(std::filesystem::exists(socket_path));
}

TEST_F(ResidentTool, RefusesPerRequestFlagsAndBadServeArgumentsAsBadUsage) {
  for (const std::string flags :
       {"--serve-fd 3 --tokens ids.txt", "--serve-fd 3 --out s.bin", "--serve-fd 3 --cached 1", "--serve-fd 3 -c 512",
        "--serve /tmp/x.sock --layout l.json", "--serve /tmp/x.sock --serve-fd 3", "--serve-fd 2",
        "--serve relative.sock", ""}) {
    const auto r = run(flags);
    EXPECT_EQ(r.exit_code, 2) << flags << ": " << r.err;
  }
  EXPECT_NE(run("").err.find("--tokens is required"), std::string::npos);
  EXPECT_NE(run("--serve relative.sock").err.find("expected an absolute socket path"), std::string::npos);
}

TEST_F(ResidentTool, RefusesAServeFdThatIsNotASocket) {
  const auto r = run("--serve-fd 5 5</dev/null");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("kvshare-prefill: --serve-fd 5: not a socket"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvshare::refmodel
