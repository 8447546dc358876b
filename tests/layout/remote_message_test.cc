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

RemoteSecret counting_secret(uint8_t first) {
  RemoteSecret s;
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<std::byte>(first + i);
  return s;
}

TEST(RemoteMessage, RoundTripsAWriteHeaderFieldByField) {
  const RemoteWrite w{0x1122334455667788ull, counting_secret(0x70), 3, 4096 * 5, 1536};
  const auto bytes = encode(w);
  EXPECT_EQ(bytes.size(), 56u);
  EXPECT_EQ(bytes[0], std::byte{'K'});
  EXPECT_EQ(bytes[3], std::byte{'W'});
  EXPECT_EQ(bytes[4], std::byte{2}) << "version 2";
  EXPECT_EQ(bytes[40], std::byte{0x70}) << "the secret starts at offset 40";
  EXPECT_EQ(bytes[55], std::byte{0x7f});
  auto back = decode_remote_write(bytes);
  ASSERT_TRUE(back) << back.error().what();
  EXPECT_EQ(back->share_id, w.share_id);
  EXPECT_EQ(back->secret, w.secret);
  EXPECT_EQ(back->chunk, 3u);
  EXPECT_EQ(back->offset, w.offset);
  EXPECT_EQ(back->size_bytes, w.size_bytes);
}

TEST(RemoteMessage, RoundTripsACompletion) {
  const RemoteDone d{42, counting_secret(1), 306, 1u << 20, 0xdeadbeefcafef00dull};
  auto back = decode_remote_done(encode(d));
  ASSERT_TRUE(back);
  EXPECT_EQ(back->secret, d.secret);
  EXPECT_EQ(back->n_tokens, 306u);
  EXPECT_EQ(back->bytes, d.bytes);
  EXPECT_EQ(back->layout_hash, d.layout_hash);
}

TEST(RemoteMessage, RefusesACompletionDecodedAsAWrite) {
  auto refused = decode_remote_write(encode(RemoteDone{1, {}, 1, 1, 1}));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EPROTO);
  EXPECT_NE(refused.error().message().find("kind 2 at offset 6"), std::string::npos);
}

TEST(RemoteMessage, NamesTheFieldOfEachKindOfGarbage) {
  auto bytes = encode(RemoteWrite{1, {}, 0, 0, 1});
  EXPECT_NE(decode_remote_write(std::span(bytes).first(55)).error().message().find("55 bytes, expected 56"),
            std::string::npos);
  EXPECT_NE(decode_remote_write(std::span(bytes).first(7)).error().message().find("7 bytes, expected 56"),
            std::string::npos);
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

TEST(RemoteMessage, RefusesAHeaderOneByteLongerThanVersion2) {
  std::vector<std::byte> longer(57, std::byte{0});
  const auto bytes = encode(RemoteWrite{1, {}, 0, 0, 1});
  std::copy(bytes.begin(), bytes.end(), longer.begin());
  auto refused = decode_remote_done(longer);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("remote completion header: 57 bytes, expected 56"), std::string::npos)
      << refused.error().message();
}

TEST(RemoteSecretCompare, TellsEqualFromEachSingleDifferingByte) {
  const RemoteSecret a = counting_secret(0x10);
  EXPECT_TRUE(same_secret(a, a));
  for (size_t i = 0; i < a.size(); ++i) {
    RemoteSecret b = a;
    b[i] ^= std::byte{0x80};
    EXPECT_FALSE(same_secret(a, b)) << "byte " << i;
  }
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

// The worked example's secret: 00 11 22 ... ff (docs/remote.md, "Messages").
RemoteSecret example_secret() {
  RemoteSecret s;
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<std::byte>(0x11 * i);
  return s;
}

TEST(RemoteMessageVector, DecodesTheWorkedWriteExampleAndEncodesItBackToTheSameBytes) {
  const auto bytes = read_vector("remote-write-v2.bin");
  ASSERT_EQ(bytes.size(), 56u);
  auto w = decode_remote_write(bytes);
  ASSERT_TRUE(w) << w.error().what();
  EXPECT_EQ(w->share_id, 0x1122334455667788ull);
  EXPECT_EQ(w->secret, example_secret());
  EXPECT_EQ(w->chunk, 2u);
  EXPECT_EQ(w->offset, 0x3000u);
  EXPECT_EQ(w->size_bytes, 0x4c00u);
  const auto again = encode(*w);
  EXPECT_TRUE(std::equal(again.begin(), again.end(), bytes.begin(), bytes.end()));
}

TEST(RemoteMessageVector, DecodesTheWorkedCompletionExampleAndEncodesItBackToTheSameBytes) {
  const auto bytes = read_vector("remote-done-v2.bin");
  ASSERT_EQ(bytes.size(), 56u);
  auto d = decode_remote_done(bytes);
  ASSERT_TRUE(d) << d.error().what();
  EXPECT_EQ(d->share_id, 0x1122334455667788ull);
  EXPECT_EQ(d->secret, example_secret());
  EXPECT_EQ(d->n_tokens, 306u);
  EXPECT_EQ(d->bytes, 0x9900u);
  EXPECT_EQ(d->layout_hash, 0x0123456789abcdefull);
  const auto again = encode(*d);
  EXPECT_TRUE(std::equal(again.begin(), again.end(), bytes.begin(), bytes.end()));
}

TEST(RemoteMessageVector, RefusesTheVersion1WriteNamingTheVersionAndTheSecret) {
  const auto bytes = read_vector("remote-write-v1.bin");
  ASSERT_EQ(bytes.size(), 40u);
  auto refused = decode_remote_write(bytes);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EPROTO);
  EXPECT_NE(refused.error().message().find("remote write header: version 1 at offset 4, this decoder speaks version "
                                           "2 (version 2 carries the share secret"),
            std::string::npos)
      << refused.error().message();
}

TEST(RemoteMessageVector, RefusesTheVersion1CompletionNamingTheVersionAndTheSecret) {
  auto refused = decode_remote_done(read_vector("remote-done-v1.bin"));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EPROTO);
  EXPECT_NE(refused.error().message().find("remote completion header: version 1 at offset 4"), std::string::npos)
      << refused.error().message();
  EXPECT_NE(refused.error().message().find("carries the share secret"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::layout
