#include <fcntl.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "kvshare/sys.h"
#include "layout/half.h"
#include "layout/row_convert.h"
#include "layout/state_format.h"
#include "layout/state_test_shapes.h"
#include "support/test_support.h"

namespace kvshare::statefile {
namespace {

using layout::GgmlType;
using layout::MemoryShape;
using layout::StateSection;
using layout::TensorKind;
using testing::dense_shape;
using testing::hybrid_shape;
using testing::iswa_shape;
using testing::mamba_shape;

std::vector<int32_t> token_ids(uint32_t n) {
  std::vector<int32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(100 + i);
  return ids;
}

// f32 rows a provider might hand: every token of one layer's K, V, R or S.
struct ProviderRows {
  uint32_t n_rows = 0;
  uint32_t n_embd = 0;
  std::vector<float> values;  // [n_rows][n_embd]
};

ProviderRows make_rows(uint32_t n_rows, uint32_t n_embd, uint32_t seed) {
  ProviderRows rows{n_rows, n_embd, std::vector<float>(uint64_t{n_rows} * n_embd)};
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  for (float& v : rows.values) v = dist(rng);
  return rows;
}

// Everything one test file holds, per (kind, il): all-token f32 rows from the "provider".
using RowsByLayer = std::map<std::pair<TensorKind, uint32_t>, ProviderRows>;

RowsByLayer make_provider(const layout::StateLayout& layout, uint32_t n_tokens) {
  RowsByLayer out;
  uint32_t seed = 1;
  for (const auto& block : layout.blocks)
    for (const auto& stream : block.streams)
      for (const auto& section : stream.sections) {
        const uint32_t n = section.kind == TensorKind::r || section.kind == TensorKind::s ? 1 : n_tokens;
        out[{section.kind, section.il}] = make_rows(n, section.n_embd, seed++);
      }
  return out;
}

RowsView view_of(const ProviderRows& rows) { return RowsView{GgmlType::F32, rows.values.data(), rows.n_rows, 0}; }

// What the section must hold: the kept rows converted with row_convert, element-major when
// transposed. Computed independently of the writer's staging.
std::vector<std::byte> expected_section(const StateSection& section, const ProviderRows& rows, int rotation_group) {
  const uint64_t row_bytes = layout::ggml_row_size(section.type, section.n_embd);
  std::vector<std::byte> converted(row_bytes * section.n_rows);
  const uint32_t skip = rows.n_rows - section.n_rows;
  for (uint32_t i = 0; i < section.n_rows; ++i)
    layout::convert_row(GgmlType::F32, rows.values.data() + uint64_t{skip + i} * rows.n_embd, section.type,
                        converted.data() + i * row_bytes, section.n_embd, rotation_group);
  if (!section.is_transposed) return converted;
  const uint64_t el = row_bytes / section.n_embd;
  std::vector<std::byte> out(converted.size());
  for (uint64_t j = 0; j < section.n_embd; ++j)
    for (uint64_t c = 0; c < section.n_rows; ++c)
      std::memcpy(out.data() + (j * section.n_rows + c) * el, converted.data() + c * row_bytes + j * el, el);
  return out;
}

std::vector<std::byte> expected_file(const layout::StateLayout& layout, std::span<const int32_t> tokens,
                                     const RowsByLayer& provider, const StateFileWriterOptions& options) {
  std::map<const StateSection*, std::vector<std::byte>> storage;
  return layout::encode_state_file(layout, tokens, [&](const StateSection& section) {
    int group = 0;
    if (section.kind == TensorKind::k || section.kind == TensorKind::v)
      group = layout::kv_rotation_group(section.kind, section.type,
                                        section.kind == TensorKind::k ? options.n_embd_head_k : options.n_embd_head_v,
                                        options.rotation_disabled);
    storage[&section] = expected_section(section, provider.at({section.kind, section.il}), group);
    return std::span<const std::byte>(storage[&section]);
  });
}

// Hands every layer in ascending il, K/V together, as a layer-by-layer provider would.
Result<CommitInfo> write_all(StateFileWriter& writer, const RowsByLayer& provider) {
  std::map<uint32_t, std::map<TensorKind, const ProviderRows*>> by_layer;
  for (const auto& [key, rows] : provider) by_layer[key.second][key.first] = &rows;
  for (const auto& [il, kinds] : by_layer) {
    if (kinds.count(TensorKind::k)) {
      const RowsView v = kinds.count(TensorKind::v) ? view_of(*kinds.at(TensorKind::v)) : RowsView{};
      if (auto rc = writer.write_layer(il, view_of(*kinds.at(TensorKind::k)), v); !rc) return fail(rc.error());
    }
    if (kinds.count(TensorKind::r))
      if (auto rc =
              writer.write_recurrent_layer(il, view_of(*kinds.at(TensorKind::r)), view_of(*kinds.at(TensorKind::s)));
          !rc)
        return fail(rc.error());
  }
  return writer.commit();
}

struct Case {
  const char* name;
  MemoryShape shape;
  uint32_t n_tokens;
};

std::vector<Case> cases() {
  auto mrope = dense_shape();
  mrope.n_pos_per_embd = 4;
  auto q8 = dense_shape(GgmlType::Q8_0, GgmlType::Q8_0);
  return {
      {"dense f16 one token", dense_shape(), 1},
      {"dense f16", dense_shape(), 37},
      {"dense f32 v_trans", dense_shape(GgmlType::F32, GgmlType::F32, true), 29},
      {"dense bf16", dense_shape(GgmlType::BF16, GgmlType::BF16), 11},
      {"dense f16 v_trans", dense_shape(GgmlType::F16, GgmlType::F16, true, 3, 192), 45},
      {"dense q8_0", q8, 23},
      {"mrope", mrope, 6},
      {"iswa", iswa_shape(8), 19},
      {"mamba", mamba_shape(), 5},
      {"hybrid v_trans", hybrid_shape(true), 13},
  };
}

class StateFileWriterTest : public kvshare::testing::FdLeakCheck {
 protected:
  kvshare::testing::TempDir dir_;
};

struct IoMode {
  const char* name;
  bool allow_io_uring;
  bool allow_direct;
};

TEST_F(StateFileWriterTest, WritesTheBytesLlamaCppWouldForEveryKindThroughEveryIoPath) {
  StateFileWriterOptions options;
  options.chunk_bytes = 8192;  // small buffers: many region/edge boundaries inside sections
  options.n_embd_head_k = options.n_embd_head_v = 64;
  for (const IoMode mode : {IoMode{"io_uring direct", true, true}, IoMode{"pwrite buffered", false, false}}) {
    options.allow_io_uring = mode.allow_io_uring;
    options.allow_direct = mode.allow_direct;
    options.direct_min_bytes = 0;  // these files are small: take the O_DIRECT path anyway
    for (const auto& c : cases()) {
      SCOPED_TRACE(std::string(mode.name) + " / " + c.name);
      const auto tokens = token_ids(c.n_tokens);
      const auto path = dir_ / (std::string(c.name) + ".bin");
      auto writer = StateFileWriter::create(path, c.shape, tokens, static_cast<int32_t>(c.n_tokens), options);
      ASSERT_TRUE(writer) << writer.error().what();
      const auto provider = make_provider(writer->layout(), c.n_tokens);
      const auto expected = expected_file(writer->layout(), tokens, provider, options);
      auto info = write_all(*writer, provider);
      ASSERT_TRUE(info) << info.error().what();
      EXPECT_EQ(info->size_bytes, expected.size());
      EXPECT_EQ(kvshare::testing::read_file_bytes(path), expected);
    }
  }
}

TEST_F(StateFileWriterTest, WritesBufferedFilesWithPwriteAndODirectFilesWithIoUring) {
  // Small file, default threshold: page cache, written from this thread.
  auto buffered = StateFileWriter::create(dir_ / "a.bin", dense_shape(), token_ids(3), 3);
  ASSERT_TRUE(buffered);
  auto info = write_all(*buffered, make_provider(buffered->layout(), 3));
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_FALSE(info->is_direct);
  EXPECT_STREQ(info->io_backend, "pread/pwrite");

  StateFileWriterOptions options;
  options.direct_min_bytes = 0;
  auto direct = StateFileWriter::create(dir_ / "b.bin", dense_shape(), token_ids(3), 3, options);
  ASSERT_TRUE(direct);
  info = write_all(*direct, make_provider(direct->layout(), 3));
  ASSERT_TRUE(info) << info.error().what();
  if (!info->is_direct) GTEST_SKIP() << "this filesystem refuses O_DIRECT";
  // Skipped only when the host has no io_uring: a writer that fell back on a host that has
  // one fails here.
  if (const std::string missing = kvshare::testing::io_uring_unavailable_reason(); !missing.empty())
    GTEST_SKIP() << missing;
  EXPECT_STREQ(info->io_backend, "io_uring");
}

TEST_F(StateFileWriterTest, HonoursKvshareNoIoUring) {
  StateFileWriterOptions options;
  options.direct_min_bytes = 0;  // where io_uring would be used (O_DIRECT) without the variable
  ::setenv(kNoIoUringEnv, "1", 1);
  auto writer = StateFileWriter::create(dir_ / "a.bin", dense_shape(), token_ids(3), 3, options);
  ::unsetenv(kNoIoUringEnv);
  ASSERT_TRUE(writer);
  auto info = write_all(*writer, make_provider(writer->layout(), 3));
  ASSERT_TRUE(info);
  EXPECT_STREQ(info->io_backend, "pread/pwrite");
}

TEST_F(StateFileWriterTest, ShowsNoFileUnderTheFinalNameBeforeCommit) {
  const auto path = dir_ / "slot0.bin";
  auto writer = StateFileWriter::create(path, dense_shape(), token_ids(5), 5);
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 5);
  ASSERT_TRUE(
      writer->write_layer(0, view_of(provider.at({TensorKind::k, 0})), view_of(provider.at({TensorKind::v, 0}))));
  EXPECT_FALSE(std::filesystem::exists(path));
  size_t temporaries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path())) {
    EXPECT_EQ(entry.path().filename().string().rfind(".slot0.bin.", 0), 0u) << entry.path();
    ++temporaries;
  }
  EXPECT_EQ(temporaries, 1u);
}

TEST_F(StateFileWriterTest, RemovesTheTemporaryFileWhenDroppedUncommitted) {
  {
    auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(5), 5);
    ASSERT_TRUE(writer);
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
}

TEST_F(StateFileWriterTest, RefusesLayersOutOfOrderNamingBoth) {
  auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(5), 5);
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 5);
  auto rc = writer->write_section(TensorKind::k, 1, view_of(provider.at({TensorKind::k, 1})));
  ASSERT_FALSE(rc);
  EXPECT_NE(rc.error().message().find("layer 1 K handed before layer 0 K"), std::string::npos) << rc.error().message();
}

TEST_F(StateFileWriterTest, RefusesToCommitWithALayerMissingAndLeavesNoFile) {
  auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(5), 5);
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 5);
  ASSERT_TRUE(
      writer->write_layer(0, view_of(provider.at({TensorKind::k, 0})), view_of(provider.at({TensorKind::v, 0}))));
  auto info = writer->commit();
  ASSERT_FALSE(info);
  EXPECT_NE(info.error().message().find("layer 1 K was never written"), std::string::npos) << info.error().message();
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
}

TEST_F(StateFileWriterTest, RefusesToQuantizeWithoutTheHeadSize) {
  auto writer = StateFileWriter::create(dir_ / "q.bin", dense_shape(GgmlType::Q8_0, GgmlType::Q8_0), token_ids(2), 2);
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 2);
  auto rc = writer->write_section(TensorKind::k, 0, view_of(provider.at({TensorKind::k, 0})));
  ASSERT_FALSE(rc);
  EXPECT_NE(rc.error().message().find("needs the head size (n_embd_head_k)"), std::string::npos)
      << rc.error().message();
}

TEST_F(StateFileWriterTest, RotatesQuantizedRowsAsLlamaCppDoes) {
  StateFileWriterOptions options;
  options.n_embd_head_k = options.n_embd_head_v = 64;
  auto writer =
      StateFileWriter::create(dir_ / "q.bin", dense_shape(GgmlType::Q8_0, GgmlType::Q8_0), token_ids(4), 4, options);
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 4);
  ASSERT_TRUE(write_all(*writer, provider));
  auto file = read_state_file(dir_ / "q.bin", nullptr);
  ASSERT_TRUE(file) << file.error().what();
  const StateSection* k0 = file->find_section(TensorKind::k, 0);
  ASSERT_NE(k0, nullptr);
  // Undoing the rotation gives the provider's values back within q8_0 precision; leaving it
  // in gives something else entirely.
  auto unrotated = file->rows_f32(*k0, 64);
  auto rotated = file->rows_f32(*k0, 0);
  ASSERT_TRUE(unrotated && rotated);
  const auto& want = provider.at({TensorKind::k, 0}).values;
  double max_err_unrotated = 0, max_err_rotated = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_err_unrotated = std::max(max_err_unrotated, double(std::fabs((*unrotated)[i] - want[i])));
    max_err_rotated = std::max(max_err_rotated, double(std::fabs((*rotated)[i] - want[i])));
  }
  EXPECT_LT(max_err_unrotated, 0.08);
  EXPECT_GT(max_err_rotated, 0.5);
}

TEST_F(StateFileWriterTest, TakesRowsAlreadyInTheCacheTypeUnchanged) {
  auto writer = StateFileWriter::create(dir_ / "f16.bin", dense_shape(), token_ids(3), 3);
  ASSERT_TRUE(writer);
  std::vector<uint16_t> rows(3 * 128);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint16_t>(i * 7);
  const RowsView view{GgmlType::F16, rows.data(), 3, 0};
  for (uint32_t il = 0; il < 2; ++il) ASSERT_TRUE(writer->write_layer(il, view, view));
  ASSERT_TRUE(writer->commit());
  auto file = read_state_file(dir_ / "f16.bin", nullptr);
  ASSERT_TRUE(file);
  const auto stored = file->section_bytes(*file->find_section(TensorKind::v, 1));
  EXPECT_EQ(std::memcmp(stored.data(), rows.data(), stored.size()), 0);
}

TEST_F(StateFileWriterTest, ReadsRowsWithAStride) {
  auto writer = StateFileWriter::create(dir_ / "s.bin", dense_shape(), token_ids(3), 3);
  ASSERT_TRUE(writer);
  std::vector<float> wide(3 * 200, 0.0f);
  for (uint32_t t = 0; t < 3; ++t)
    for (uint32_t j = 0; j < 128; ++j) wide[t * 200 + j] = float(t) + float(j) / 256.0f;
  const RowsView view{GgmlType::F32, wide.data(), 3, 200 * sizeof(float)};
  for (uint32_t il = 0; il < 2; ++il) ASSERT_TRUE(writer->write_layer(il, view, view));
  ASSERT_TRUE(writer->commit());
  auto file = read_state_file(dir_ / "s.bin", nullptr);
  ASSERT_TRUE(file);
  auto k = file->rows_f32(*file->find_section(TensorKind::k, 1));
  ASSERT_TRUE(k);
  EXPECT_FLOAT_EQ((*k)[2 * 128 + 64], 2.25f);
}

// ---- failure injection through kvshare/sys.h ----------------------------------------------

struct Injection {
  static inline int calls = 0;
  static inline int fail_at = 0;
  static inline int error = 0;
  static inline bool halve = false;
  static ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset) {
    const int call = ++calls;
    if (call == fail_at) {
      if (halve) return sys::real_ops().pwrite(fd, buf, count / 2, offset);
      errno = error;
      return -1;
    }
    return sys::real_ops().pwrite(fd, buf, count, offset);
  }
};

StateFileWriterOptions pwrite_only() {
  StateFileWriterOptions options;
  options.allow_io_uring = false;
  options.chunk_bytes = 4096;
  options.direct_min_bytes = 0;  // O_DIRECT whatever the size: the edge cases live there
  return options;
}

TEST_F(StateFileWriterTest, ReportsEnospcWithTheOffsetAndRemovesTheTemporaryFile) {
  sys::Ops ops = sys::real_ops();
  ops.pwrite = Injection::pwrite;
  Injection::calls = 0;
  Injection::fail_at = 2;
  Injection::error = ENOSPC;
  Injection::halve = false;
  sys::ScopedOverride scoped(ops);
  auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(37), 37, pwrite_only());
  ASSERT_TRUE(writer);
  auto info = write_all(*writer, make_provider(writer->layout(), 37));
  ASSERT_FALSE(info);
  EXPECT_EQ(info.error().errno_value(), ENOSPC);
  EXPECT_NE(info.error().message().find("write of 4096 bytes at offset 4096"), std::string::npos)
      << info.error().message();
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
}

TEST_F(StateFileWriterTest, ResumesAShortWriteFromTheByteReached) {
  sys::Ops ops = sys::real_ops();
  ops.pwrite = Injection::pwrite;
  Injection::calls = 0;
  Injection::fail_at = 3;
  Injection::halve = true;
  sys::ScopedOverride scoped(ops);
  auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(37), 37, pwrite_only());
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 37);
  const auto expected = expected_file(writer->layout(), token_ids(37), provider, pwrite_only());
  auto info = write_all(*writer, provider);
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_EQ(writer->io_stats().resumed_short_transfers, 1u);
  EXPECT_EQ(kvshare::testing::read_file_bytes(dir_ / "slot0.bin"), expected);
}

TEST_F(StateFileWriterTest, RetriesAWriteInterruptedByASignal) {
  sys::Ops ops = sys::real_ops();
  ops.pwrite = Injection::pwrite;
  Injection::calls = 0;
  Injection::fail_at = 1;
  Injection::error = EINTR;
  Injection::halve = false;
  sys::ScopedOverride scoped(ops);
  auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(9), 9, pwrite_only());
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 9);
  const auto expected = expected_file(writer->layout(), token_ids(9), provider, pwrite_only());
  ASSERT_TRUE(write_all(*writer, provider));
  EXPECT_EQ(writer->io_stats().eintr_retries, 1u);
  EXPECT_EQ(kvshare::testing::read_file_bytes(dir_ / "slot0.bin"), expected);
}

struct DirectRefusal {
  static int open(const char* path, int flags, mode_t mode) {
    if (flags & O_DIRECT) {
      errno = EINVAL;
      return -1;
    }
    return sys::real_ops().open(path, flags, mode);
  }
};

TEST_F(StateFileWriterTest, FallsBackToBufferedWhenTheFilesystemRefusesODirect) {
  sys::Ops ops = sys::real_ops();
  ops.open = DirectRefusal::open;
  sys::ScopedOverride scoped(ops);
  StateFileWriterOptions options;
  options.direct_min_bytes = 0;
  auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(9), 9, options);
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 9);
  auto info = write_all(*writer, provider);
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_FALSE(info->is_direct);
  auto file = read_state_file(dir_ / "slot0.bin", nullptr);
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->layout().content_bytes, info->size_bytes);
}

struct DirectOpenCounter {
  static inline int direct_opens = 0;
  static int open(const char* path, int flags, mode_t mode) {
    if (flags & O_DIRECT) ++direct_opens;
    return sys::real_ops().open(path, flags, mode);
  }
};

TEST_F(StateFileWriterTest, UsesODirectOnlyForFilesOfAtLeastDirectMinBytes) {
  sys::Ops ops = sys::real_ops();
  ops.open = DirectOpenCounter::open;
  sys::ScopedOverride scoped(ops);
  DirectOpenCounter::direct_opens = 0;
  StateFileWriterOptions options;  // default threshold (1 GiB): this small file stays buffered
  auto small = StateFileWriter::create(dir_ / "small.bin", dense_shape(), token_ids(9), 9, options);
  ASSERT_TRUE(small);
  auto info = write_all(*small, make_provider(small->layout(), 9));
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_EQ(DirectOpenCounter::direct_opens, 0);
  EXPECT_FALSE(info->is_direct);
  ASSERT_TRUE(read_state_file(dir_ / "small.bin", nullptr));
  EXPECT_EQ(DirectOpenCounter::direct_opens, 0);

  options.direct_min_bytes = info->size_bytes;  // exactly its size: O_DIRECT is tried
  auto large = StateFileWriter::create(dir_ / "large.bin", dense_shape(), token_ids(9), 9, options);
  ASSERT_TRUE(large);
  EXPECT_EQ(DirectOpenCounter::direct_opens, 1);
  ASSERT_TRUE(write_all(*large, make_provider(large->layout(), 9)));
  StateFileReadOptions read_options;
  read_options.direct_min_bytes = info->size_bytes;
  ASSERT_TRUE(read_state_file(dir_ / "large.bin", nullptr, read_options));
  EXPECT_EQ(DirectOpenCounter::direct_opens, 2);
}

struct TransferRefusal {
  static inline int refusals = 0;
  static ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset) {
    if (sys::real_ops().fcntl_int(fd, F_GETFL, 0) & O_DIRECT) {
      ++refusals;
      errno = EINVAL;
      return -1;
    }
    return sys::real_ops().pwrite(fd, buf, count, offset);
  }
};

TEST_F(StateFileWriterTest, TurnsODirectOffWhenAWriteIsRefusedWithEinval) {
  sys::Ops ops = sys::real_ops();
  ops.pwrite = TransferRefusal::pwrite;
  TransferRefusal::refusals = 0;
  sys::ScopedOverride scoped(ops);
  auto writer = StateFileWriter::create(dir_ / "slot0.bin", dense_shape(), token_ids(9), 9, pwrite_only());
  ASSERT_TRUE(writer);
  const auto provider = make_provider(writer->layout(), 9);
  const auto expected = expected_file(writer->layout(), token_ids(9), provider, pwrite_only());
  auto info = write_all(*writer, provider);
  ASSERT_TRUE(info) << info.error().what();
  if (TransferRefusal::refusals == 0) GTEST_SKIP() << "this filesystem refused O_DIRECT at open already";
  EXPECT_TRUE(writer->io_stats().fell_back_to_buffered);
  EXPECT_EQ(kvshare::testing::read_file_bytes(dir_ / "slot0.bin"), expected);
}

// ---- reader ----------------------------------------------------------------------------

class StateFileReaderTest : public StateFileWriterTest {};

TEST_F(StateFileReaderTest, HandsBackTheRowsTheWriterTook) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    StateFileWriterOptions options;
    options.n_embd_head_k = options.n_embd_head_v = 64;
    const auto path = dir_ / "r.bin";
    auto writer =
        StateFileWriter::create(path, c.shape, token_ids(c.n_tokens), static_cast<int32_t>(c.n_tokens), options);
    ASSERT_TRUE(writer);
    const auto provider = make_provider(writer->layout(), c.n_tokens);
    ASSERT_TRUE(write_all(*writer, provider));
    for (const MemoryShape* expect : {&c.shape, static_cast<const MemoryShape*>(nullptr)}) {
      auto file = read_state_file(path, expect);
      ASSERT_TRUE(file) << file.error().what();
      EXPECT_EQ(file->tokens(), token_ids(c.n_tokens));
      for (const StateSection* section : file->sections()) {
        if (!expect) continue;  // inspect mode numbers layers by ordinal
        const auto& rows = provider.at({section->kind, section->il});
        const int group = layout::is_quantized(section->type) ? 64 : 0;
        auto values = file->rows_f32(*section, group);
        ASSERT_TRUE(values);
        const uint32_t skip = rows.n_rows - section->n_rows;
        double max_err = 0;
        for (uint64_t i = 0; i < values->size(); ++i)
          max_err = std::max(max_err, double(std::fabs((*values)[i] - rows.values[skip * rows.n_embd + i])));
        EXPECT_LT(max_err, layout::is_quantized(section->type) ? 0.08 : 0.02) << "layer " << section->il;
      }
    }
  }
}

TEST_F(StateFileReaderTest, NamesThePathFieldAndOffsetOfAMismatch) {
  const auto path = dir_ / "slot0.bin";
  auto writer = StateFileWriter::create(path, dense_shape(), token_ids(5), 5);
  ASSERT_TRUE(writer);
  ASSERT_TRUE(write_all(*writer, make_provider(writer->layout(), 5)));
  const auto other = dense_shape(GgmlType::F16, GgmlType::F16, false, 2, 64);
  auto file = read_state_file(path, &other);
  ASSERT_FALSE(file);
  EXPECT_EQ(file.error().message(),
            "state file " + path.string() + ": kv layer 0 K row size is 256 bytes, layout says 128 (offset 112)");
}

TEST_F(StateFileReaderTest, ReportsAMissingFileWithItsErrno) {
  auto file = read_state_file(dir_ / "absent.bin", nullptr);
  ASSERT_FALSE(file);
  EXPECT_EQ(file.error().errno_value(), ENOENT);
  EXPECT_NE(file.error().message().find("absent.bin: open for reading"), std::string::npos);
}

TEST_F(StateFileReaderTest, ReadsThroughPreadWhenIoUringIsOff) {
  const auto path = dir_ / "slot0.bin";
  auto writer = StateFileWriter::create(path, dense_shape(), token_ids(50), 50);
  ASSERT_TRUE(writer);
  ASSERT_TRUE(write_all(*writer, make_provider(writer->layout(), 50)));
  StateFileReadOptions options;
  options.allow_io_uring = false;
  options.chunk_bytes = 4096;
  auto file = read_state_file(path, nullptr, options);
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->bytes().size(), std::filesystem::file_size(path));
  EXPECT_EQ(std::vector<std::byte>(file->bytes().begin(), file->bytes().end()),
            kvshare::testing::read_file_bytes(path));
}

TEST_F(StateFileReaderTest, ReusesTheLastFilesBufferForTheNextReadAndKeepsBytesApart) {
  const auto big = dir_ / "big.bin";
  const auto small = dir_ / "small.bin";
  for (const auto& [path, n] : {std::pair{big, 60}, std::pair{small, 20}}) {
    auto writer = StateFileWriter::create(path, dense_shape(), token_ids(n), n);
    ASSERT_TRUE(writer);
    ASSERT_TRUE(write_all(*writer, make_provider(writer->layout(), n)));
  }
  const std::byte* first_data = nullptr;
  {
    auto first = read_state_file(big, nullptr);
    ASSERT_TRUE(first) << first.error().what();
    first_data = first->bytes().data();
  }
  // The big file's buffer went back when its StateFile died; the smaller file fits it.
  auto second = read_state_file(small, nullptr);
  ASSERT_TRUE(second) << second.error().what();
  EXPECT_EQ(second->bytes().data(), first_data);
  EXPECT_EQ(std::vector<std::byte>(second->bytes().begin(), second->bytes().end()),
            kvshare::testing::read_file_bytes(small));
  // While `second` lives, its buffer is its own: another read gets different memory.
  auto third = read_state_file(big, nullptr);
  ASSERT_TRUE(third) << third.error().what();
  EXPECT_NE(third->bytes().data(), second->bytes().data());
  EXPECT_EQ(std::vector<std::byte>(third->bytes().begin(), third->bytes().end()),
            kvshare::testing::read_file_bytes(big));
  EXPECT_EQ(second->tokens(), token_ids(20));
}

TEST_F(StateFileReaderTest, RefusesATruncatedFileNamingTheOffset) {
  const auto path = dir_ / "slot0.bin";
  auto writer = StateFileWriter::create(path, dense_shape(), token_ids(5), 5);
  ASSERT_TRUE(writer);
  ASSERT_TRUE(write_all(*writer, make_provider(writer->layout(), 5)));
  std::filesystem::resize_file(path, 3000);
  const auto shape = dense_shape();
  auto file = read_state_file(path, &shape);
  ASSERT_FALSE(file);
  EXPECT_NE(file.error().message().find("file ends at byte 3000 inside kv layer 0 V rows"), std::string::npos)
      << file.error().message();
}

}  // namespace
}  // namespace kvshare::statefile
