#include "layout/remote_message.h"

#include <gtest/gtest.h>

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
