#include "kvshare/env.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace kvshare {
namespace {

// Sets or unsets a variable for one test and restores it afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value != nullptr)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(KvShareEnv, IsOffWhenUnset) {
  ScopedEnv env(kKvShareEnv, nullptr);
  EXPECT_FALSE(kv_share_enabled());
}

TEST(KvShareEnv, IsOffWhenSetButEmpty) {
  ScopedEnv env(kKvShareEnv, "");
  EXPECT_FALSE(kv_share_enabled());
}

TEST(KvShareEnv, IsOnWhenSetToZeroBecauseOnlyUnsetTurnsItOff) {
  ScopedEnv env(kKvShareEnv, "0");
  EXPECT_TRUE(kv_share_enabled());
}

TEST(KvShareEnv, IsOnWhenSetToOne) {
  ScopedEnv env(kKvShareEnv, "1");
  EXPECT_TRUE(kv_share_enabled());
}

TEST(ExportBackendEnv, ChoosesAutomaticallyWhenUnset) {
  ScopedEnv env(kExportBackendEnv, nullptr);
  auto backend = export_backend_override();
  ASSERT_TRUE(backend) << backend.error().what();
  EXPECT_FALSE(backend->has_value());
}

TEST(ExportBackendEnv, ForcesTheNamedBackend) {
  for (auto [word, expected] : {std::pair{"memfd", RegionBackend::memfd}, std::pair{"udmabuf", RegionBackend::udmabuf},
                                std::pair{"dmaheap", RegionBackend::dma_heap}}) {
    ScopedEnv env(kExportBackendEnv, word);
    auto backend = export_backend_override();
    ASSERT_TRUE(backend && backend->has_value()) << word;
    EXPECT_EQ(**backend, expected) << word;
  }
}

TEST(ExportBackendEnv, RefusesAnUnknownBackendNamingTheVariableAndTheChoices) {
  ScopedEnv env(kExportBackendEnv, "shm");
  auto backend = export_backend_override();
  ASSERT_FALSE(backend);
  EXPECT_EQ(backend.error().errno_value(), EINVAL);
  EXPECT_NE(backend.error().message().find("KVSHARE_EXPORT"), std::string::npos);
  EXPECT_NE(backend.error().message().find("\"shm\""), std::string::npos);
  EXPECT_NE(backend.error().message().find("memfd, udmabuf, dmaheap"), std::string::npos);
}

}  // namespace
}  // namespace kvshare
