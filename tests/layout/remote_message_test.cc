#include "layout/remote_message.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace kvshare::layout {
namespace {

TEST(RemoteMessage, RoundTripsAWriteHeaderFieldByField) {
  const RemoteWrite w{0x1122334455667788ull, 3, 4096 * 5, 1536};
  const auto bytes = encode(w);
  EXPECT_EQ(bytes[0], std::byte{'K'});
  EXPECT_EQ(bytes[3], std::byte{'W'});
  auto back = decode_remote_write(bytes);
  ASSERT_TRUE(back) << back.error().what();
  EXPECT_EQ(back->share_id, w.share_id);
  EXPECT_EQ(back->chunk, 3u);
  EXPECT_EQ(back->offset, w.offset);
  EXPECT_EQ(back->size_bytes, w.size_bytes);
}

TEST(RemoteMessage, RoundTripsACompletion) {
  const RemoteDone d{42, 306, 1u << 20, 0xdeadbeefcafef00dull};
  auto back = decode_remote_done(encode(d));
  ASSERT_TRUE(back);
  EXPECT_EQ(back->n_tokens, 306u);
  EXPECT_EQ(back->bytes, d.bytes);
  EXPECT_EQ(back->layout_hash, d.layout_hash);
}

TEST(RemoteMessage, RefusesACompletionDecodedAsAWrite) {
  auto refused = decode_remote_write(encode(RemoteDone{1, 1, 1, 1}));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EPROTO);
  EXPECT_NE(refused.error().message().find("kind 2 at offset 6"), std::string::npos);
}

TEST(RemoteMessage, NamesTheFieldOfEachKindOfGarbage) {
  auto bytes = encode(RemoteWrite{1, 0, 0, 1});
  EXPECT_NE(decode_remote_write(std::span(bytes).first(39)).error().message().find("39 bytes"), std::string::npos);
  auto bad_magic = bytes;
  bad_magic[0] = std::byte{0};
  EXPECT_NE(decode_remote_write(bad_magic).error().message().find("magic"), std::string::npos);
  auto bad_version = bytes;
  bad_version[4] = std::byte{9};
  EXPECT_NE(decode_remote_write(bad_version).error().message().find("version 9"), std::string::npos);
  auto reserved = bytes;
  reserved[21] = std::byte{1};
  EXPECT_NE(decode_remote_write(reserved).error().message().find("reserved"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::layout

namespace kvshare::layout {
namespace {

std::vector<std::byte> read_vector(const char* name) {
  std::ifstream in(std::string(KVSHARE_TEST_DATA_DIR) + "/" + name, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

TEST(RemoteMessageVector, DecodesTheWorkedWriteExampleAndEncodesItBackToTheSameBytes) {
  const auto bytes = read_vector("remote-write-v1.bin");
  auto w = decode_remote_write(bytes);
  ASSERT_TRUE(w) << w.error().what();
  EXPECT_EQ(w->share_id, 0x1122334455667788ull);
  EXPECT_EQ(w->chunk, 2u);
  EXPECT_EQ(w->offset, 0x3000u);
  EXPECT_EQ(w->size_bytes, 0x4c00u);
  const auto again = encode(*w);
  EXPECT_TRUE(std::equal(again.begin(), again.end(), bytes.begin(), bytes.end()));
}

TEST(RemoteMessageVector, DecodesTheWorkedCompletionExampleAndEncodesItBackToTheSameBytes) {
  const auto bytes = read_vector("remote-done-v1.bin");
  auto d = decode_remote_done(bytes);
  ASSERT_TRUE(d) << d.error().what();
  EXPECT_EQ(d->share_id, 0x1122334455667788ull);
  EXPECT_EQ(d->n_tokens, 306u);
  EXPECT_EQ(d->bytes, 0x9900u);
  EXPECT_EQ(d->layout_hash, 0x0123456789abcdefull);
  const auto again = encode(*d);
  EXPECT_TRUE(std::equal(again.begin(), again.end(), bytes.begin(), bytes.end()));
}

}  // namespace
}  // namespace kvshare::layout
