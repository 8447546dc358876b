// Where kvshare-provider-server takes the deployment's key from (resolve_provider_keys):
// every source given adds its keys, none is bad usage naming the three ways, and no
// refusal shows a key.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "apps/provider/provider_server.h"
#include "support/test_support.h"

namespace kvshare::refmodel {
namespace {

using ::kvshare::testing::TempDir;

TEST(ProviderKeys, TakesEachSourceGiven) {
  TempDir dir;
  std::ofstream(dir / "keys") << "# comment\nfrom-file\n";
  ProviderKeySources sources;
  sources.api_key = "flag-a,flag-b";
  sources.api_key_file = (dir / "keys").string();
  sources.env_key = "from-env,with-comma";
  auto keys = resolve_provider_keys(sources);
  ASSERT_TRUE(keys) << keys.error().what();
  EXPECT_EQ(*keys, (std::vector<std::string>{"flag-a", "flag-b", "from-file", "from-env,with-comma"}))
      << "the environment's value is one key, whole";
}

TEST(ProviderKeys, RefusesNoKeyNamingTheThreeWaysToGiveOne) {
  auto keys = resolve_provider_keys({});
  ASSERT_FALSE(keys);
  EXPECT_EQ(keys.error().errno_value(), EINVAL);
  for (const char* words : {"--api-key-file FILE", "KVSHARE_REMOTE_KEY", "--api-key KEY", "--no-api-key"})
    EXPECT_NE(keys.error().message().find(words), std::string::npos) << words << " in " << keys.error().message();
}

TEST(ProviderKeys, ServesWithoutKeysOnlyWhenToldExplicitly) {
  ProviderKeySources sources;
  sources.no_api_key = true;
  auto keys = resolve_provider_keys(sources);
  ASSERT_TRUE(keys) << keys.error().what();
  EXPECT_TRUE(keys->empty());
}

TEST(ProviderKeys, RefusesNoApiKeyTogetherWithAKeyWithoutShowingIt) {
  ProviderKeySources sources;
  sources.no_api_key = true;
  sources.env_key = "s3cret-value";
  auto keys = resolve_provider_keys(sources);
  ASSERT_FALSE(keys);
  EXPECT_NE(keys.error().message().find("--no-api-key, yet a key is given"), std::string::npos);
  EXPECT_EQ(keys.error().message().find("s3cret-value"), std::string::npos);
}

TEST(ProviderKeys, RefusesAnEmptyEnvironmentKey) {
  ProviderKeySources sources;
  sources.env_key = "";
  auto keys = resolve_provider_keys(sources);
  ASSERT_FALSE(keys);
  EXPECT_NE(keys.error().message().find("KVSHARE_REMOTE_KEY is set but empty"), std::string::npos);
}

TEST(ProviderKeys, RefusesAKeyFileWithoutAKey) {
  TempDir dir;
  std::ofstream(dir / "keys") << "# only a comment\n";
  ProviderKeySources sources;
  sources.api_key_file = (dir / "keys").string();
  auto keys = resolve_provider_keys(sources);
  ASSERT_FALSE(keys);
  EXPECT_NE(keys.error().message().find("no key in it"), std::string::npos) << keys.error().message();
}

TEST(ProviderKeys, NamesAKeyFileThatCannotBeOpened) {
  TempDir dir;
  ProviderKeySources sources;
  sources.api_key_file = (dir / "missing").string();
  auto keys = resolve_provider_keys(sources);
  ASSERT_FALSE(keys);
  EXPECT_EQ(keys.error().errno_value(), ENOENT);
  EXPECT_NE(keys.error().message().find("missing: cannot open"), std::string::npos) << keys.error().message();
}

}  // namespace
}  // namespace kvshare::refmodel
