#include "route/serve_config.h"
#include "route/resident_provider.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "support/test_support.h"

namespace kvshare::route {
namespace {

using kvshare::testing::TempDir;

ServeConfig config_with_model(const TempDir& dir) {
  ServeConfig config;
  config.model = dir / "model.gguf";
  std::ofstream(config.model) << "gguf";
  return config;
}

void make_executable(const std::filesystem::path& path) {
  std::ofstream(path) << "#!/bin/sh\n";
  ::chmod(path.c_str(), 0755);
}

TEST(ServeConfigValidate, AcceptsTheDefaultsWithAModel) {
  TempDir dir;
  EXPECT_TRUE(validate(config_with_model(dir)));
}

TEST(ServeConfigValidate, TakesAStreamWeightOfZeroOrMoreAndRefusesTheRestByName) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  EXPECT_EQ(config.handoff.stream_weight, kDefaultStreamWeight);
  for (double weight : {0.0, 0.25, 4.0}) {
    config.handoff.stream_weight = weight;
    EXPECT_TRUE(validate(config)) << weight;
  }
  for (double weight : {-1.0, std::nan(""), HUGE_VAL}) {
    config.handoff.stream_weight = weight;
    auto valid = validate(config);
    ASSERT_FALSE(valid) << weight;
    EXPECT_EQ(valid.error().errno_value(), EINVAL);
    EXPECT_NE(valid.error().message().find("--stream-weight"), std::string::npos) << valid.error().message();
  }
}

TEST(ServeConfigValidate, TakesSeveralSlotsAndRefusesCountsOutsideTheRange) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.parallel = 4;
  EXPECT_TRUE(validate(config));
  for (int parallel : {0, -1, kMaxSlots + 1}) {
    config.parallel = parallel;
    auto valid = validate(config);
    ASSERT_FALSE(valid) << parallel;
    EXPECT_EQ(valid.error().errno_value(), EINVAL);
    EXPECT_NE(valid.error().message().find(fmt::format("--parallel {}:", parallel)), std::string::npos)
        << valid.error().message();
  }
}

TEST(ServeConfigValidate, RefusesSlotsTooSmallForAPromptAndSeveralSlotsOnTheRemoteRoute) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.parallel = 4;
  config.ctx_size = 7;
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("each slot gets 1 cells"), std::string::npos) << valid.error().message();
  config.ctx_size = 4096;
  // The remote route grants each slot's own cells: several slots take it.
  config.prefill_remote = {"http://127.0.0.1:9000", "http://127.0.0.2:9000"};
  valid = validate(config);
  EXPECT_TRUE(valid) << valid.error().message();
}

TEST(ServeConfigValidate, SeveralSlotsNeedLlamaServerNotKvshareDecoder) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.parallel = 2;
  auto valid = validate_backend(config, Backend{BackendKind::kvshare_decoder, "/opt/kvshare-decoder"});
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("kvshare-decoder, which serves one slot"), std::string::npos)
      << valid.error().message();
  EXPECT_TRUE(validate_backend(config, Backend{BackendKind::llama_server, "/opt/llama-server"}));
  config.parallel = 1;
  EXPECT_TRUE(validate_backend(config, Backend{BackendKind::kvshare_decoder, "/opt/kvshare-decoder"}));
}

TEST(ServeConfigValidate, PassesTheSlotCountToTheDecoder) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.parallel = 3;
  const auto argv = backend_command(config, Backend{BackendKind::llama_server, "/opt/llama-server"}, "/slots", 8081);
  const auto np = std::find(argv.begin(), argv.end(), "-np");
  ASSERT_NE(np, argv.end());
  EXPECT_EQ(*(np + 1), "3");
}

TEST(ServeConfigValidate, RefusesEachFlagTheRouteCannotHonourWithItsReason) {
  TempDir dir;
  for (const std::string flag :
       {"--mtp", "--dflash", "--mmproj", "--moe-slots", "--embedding", "--reranking", "--pm"}) {
    ServeConfig config = config_with_model(dir);
    config.refused_flags = {flag};
    auto valid = validate(config);
    ASSERT_FALSE(valid) << flag;
    EXPECT_EQ(valid.error().message().rfind(flag + " refused: ", 0), 0u) << valid.error().message();
  }
}

TEST(ServeConfigValidate, RefusesRefusedFlagsHiddenInTheBackendFlags) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.backend_extra = {"--threads", "2", "-np", "4"};
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("\"-np 4\" refused"), std::string::npos) << valid.error().message();
  config.backend_extra = {"-np", "1"};  // the same count serve passes: harmless
  EXPECT_TRUE(validate(config));
  config.backend_extra = {"--mmproj=x.gguf"};
  valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("--mmproj refused"), std::string::npos) << valid.error().message();
}

TEST(ServeConfigValidate, RefusesBackendFlagsServeOwns) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.backend_extra = {"--slot-save-path", "/elsewhere"};
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("kvshare-serve sets it"), std::string::npos);
}

TEST(ServeConfigValidate, RefusesAnApiKeyMeantOnlyForTheDecoder) {
  // serve could not call the decoder's slot actions, and the key would sit on a command line.
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.backend_extra = {"--api-key", "k"};
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("give --api-key to kvshare-serve"), std::string::npos);
}

TEST(ServeConfigValidate, NamesAMissingModelFile) {
  TempDir dir;
  ServeConfig config;
  config.model = dir / "absent.gguf";
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_EQ(valid.error().errno_value(), ENOENT);
  EXPECT_NE(valid.error().message().find("absent.gguf"), std::string::npos);
}

// serve refused llama-server's own default, -fa auto, and checked no cache type.
TEST(ServeConfigValidate, RefusesAFlashAttentionValueLlamaServerRefuses) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.flash_attn = "of";
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_EQ(valid.error().errno_value(), EINVAL);
  EXPECT_NE(valid.error().message().find("unknown value for --flash-attn: 'of'"), std::string::npos)
      << valid.error().message();
}

TEST(ServeConfigValidate, RefusesACacheTypeLlamaServerRefusesNamingTheFlag) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  config.cache_type_k = "q4_K";
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("-ctk: cache type \"q4_K\""), std::string::npos) << valid.error().message();
}

TEST(ServeConfigValidate, TakesLlamaServersAutoAndPassesItToTheDecoderAsGiven) {
  TempDir dir;
  ServeConfig config = config_with_model(dir);
  EXPECT_EQ(config.flash_attn, "auto");
  ASSERT_TRUE(validate(config));
  const auto argv = backend_command(config, Backend{BackendKind::llama_server, "/bin/llama-server"}, "/slots", 1);
  EXPECT_NE(join_command(argv).find(" -fa auto "), std::string::npos) << join_command(argv);
}

TEST(ApplyEnv, TakesTheProviderFromTheEnvironmentUnlessAFlagNamedOne) {
  ServeConfig config;
  ServeEnv env;
  env.hybrid_prefill = "/env/provider";
  env.hybrid_elfs = "/env/elfs";
  env.kv_share = true;
  apply_env(config, env);
  EXPECT_EQ(config.prefill_provider, "/env/provider");
  EXPECT_EQ(config.elfs_dir, "/env/elfs");
  EXPECT_TRUE(config.kv_share);
  ServeConfig flagged;
  flagged.prefill_provider = "/flag/provider";
  apply_env(flagged, env);
  EXPECT_EQ(flagged.prefill_provider, "/flag/provider");
}

TEST(ResolveBackend, PrefersTheNamedBackend) {
  TempDir dir;
  make_executable(dir / "my-llama-server");
  ServeConfig config;
  config.backend = (dir / "my-llama-server").string();
  auto backend = resolve_backend(config, "", dir.path());
  ASSERT_TRUE(backend) << backend.error().what();
  EXPECT_EQ(backend->kind, BackendKind::llama_server);
  EXPECT_EQ(backend->program, dir / "my-llama-server");
}

TEST(ResolveBackend, FindsLlamaServerOnPath) {
  TempDir dir;
  std::filesystem::create_directory(dir / "bin");
  make_executable(dir / "bin" / "llama-server");
  auto backend = resolve_backend(ServeConfig{}, "/nonexistent:" + (dir / "bin").string(), dir / "serve");
  ASSERT_TRUE(backend) << backend.error().what();
  EXPECT_EQ(backend->kind, BackendKind::llama_server);
  EXPECT_EQ(backend->program, dir / "bin" / "llama-server");
}

// The decoder of record is llama-server: the reference decoder beside serve is never a
// silent substitute for a missing one (issue #25), only named in the refusal.
TEST(ResolveBackend, NeverFallsBackToTheReferenceDecoderUnasked) {
  TempDir dir;
  std::filesystem::create_directory(dir / "serve");
  make_executable(dir / "serve" / "kvshare-decoder");
  auto backend = resolve_backend(ServeConfig{}, "/nonexistent", dir / "serve");
  ASSERT_FALSE(backend) << "chose " << backend->program;
  EXPECT_EQ(backend.error().errno_value(), ENOENT);
  const std::string message = backend.error().message();
  EXPECT_NE(message.find("no llama-server on PATH"), std::string::npos) << message;
  EXPECT_NE(message.find("scripts/build-llama-server.sh --with-kvshare"), std::string::npos) << message;
  EXPECT_NE(message.find("--backend " + (dir / "serve" / "kvshare-decoder").string()), std::string::npos) << message;
  ServeConfig named;
  named.backend = (dir / "serve" / "kvshare-decoder").string();
  backend = resolve_backend(named, "/nonexistent", dir / "serve");
  ASSERT_TRUE(backend) << backend.error().what();
  EXPECT_EQ(backend->kind, BackendKind::kvshare_decoder);
}

TEST(BackendCommand, RunsOneSlotWithTheSlotDirectoryOnLoopbackAndTheKvFlags) {
  ServeConfig config;
  config.model = "m.gguf";
  config.ctx_size = 2048;
  config.flash_attn = "off";
  config.cache_type_k = "q8_0";
  config.backend_extra = {"--threads", "2"};
  const auto argv = backend_command(config, Backend{BackendKind::llama_server, "/bin/llama-server"}, "/slots", 4242);
  EXPECT_EQ(join_command(argv),
            "/bin/llama-server -m m.gguf -np 1 --slot-save-path /slots -c 2048 -fa off -ctk q8_0 -ctv f16 "
            "--host 127.0.0.1 --port 4242 --threads 2");
}

TEST(ProviderCommand, FollowsTheFileContractAndAddsElfsWhenSet) {
  ServeConfig config;
  config.model = "m.gguf";
  config.prefill_provider = "/p";
  EXPECT_EQ(join_command(file_provider_command(config, "ids", "out")), "/p --tokens ids --out out --model m.gguf");
  config.elfs_dir = "/elfs";
  config.kv_flags_given = true;
  EXPECT_EQ(
      join_command(file_provider_command(config, "ids", "out")),
      "/p --tokens ids --out out --model m.gguf --elfs /elfs --ctx-size 4096 --flash-attn auto --cache-type-k f16 "
      "--cache-type-v f16");
  EXPECT_EQ(join_command(shared_provider_command(config, "ids")), "/p --tokens ids --model m.gguf --elfs /elfs");
}

TEST(ProviderCommand, TellsTheFileRouteProviderTheDecodersSlots) {
  ServeConfig config;
  config.model = "m.gguf";
  config.prefill_provider = "/p";
  config.parallel = 4;
  EXPECT_EQ(join_command(file_provider_command(config, "ids", "out")),
            "/p --tokens ids --out out --model m.gguf --parallel 4");
  config.backend_extra = {"-kvu"};
  EXPECT_TRUE(decoder_kv_unified(config));
  EXPECT_EQ(join_command(file_provider_command(config, "ids", "out")),
            "/p --tokens ids --out out --model m.gguf --parallel 4 --kv-unified");
  config.parallel = 1;
  config.backend_extra = {};
  EXPECT_TRUE(decoder_kv_unified(config));
  EXPECT_EQ(join_command(file_provider_command(config, "ids", "out")), "/p --tokens ids --out out --model m.gguf");
}

TEST(PrefillRemoteUrl, TakesHttpHostAndPortWithAnOptionalTrailingSlash) {
  auto url = parse_prefill_remote_url("http://10.88.0.2:8090/");
  ASSERT_TRUE(url) << url.error().what();
  EXPECT_EQ(url->host, "10.88.0.2");
  EXPECT_EQ(url->port, 8090);
}

TEST(PrefillRemoteUrl, RefusesAnotherSchemeAPathOrABadPortByName) {
  EXPECT_NE(parse_prefill_remote_url("https://h:1").error().message().find("expected http://HOST:PORT"),
            std::string::npos);
  EXPECT_NE(parse_prefill_remote_url("http://h:1/prefill").error().message().find("no path"), std::string::npos);
  EXPECT_NE(parse_prefill_remote_url("http://h:99999").error().message().find("not 1..65535"), std::string::npos);
  EXPECT_NE(parse_prefill_remote_url("http://h:8x").error().message().find("not a number"), std::string::npos);
  EXPECT_FALSE(parse_prefill_remote_url("http://h"));
}

TEST(Validate, RefusesAMalformedPrefillRemoteUrl) {
  ServeConfig config;
  config.model = KVSHARE_TEST_DATA_DIR "/gguf-tiny.gguf";
  config.prefill_remote = {"http://h:1", "ftp://x:1"};
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("--prefill-remote ftp://x:1"), std::string::npos);
  config.prefill_remote = {"http://h:1", "http://h:1"};
  valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("given twice"), std::string::npos) << valid.error().message();
}

TEST(Validate, RefusesAResidentProviderWithoutAProgramOrWithASocketToo) {
  ServeConfig config;
  config.model = KVSHARE_TEST_DATA_DIR "/gguf-tiny.gguf";
  config.provider_resident = true;
  auto no_program = validate(config);
  ASSERT_FALSE(no_program);
  EXPECT_NE(no_program.error().message().find("--provider-resident needs the provider program"), std::string::npos);
  config.prefill_provider = "kvshare-prefill";
  EXPECT_TRUE(validate(config));
  config.prefill_provider_socket = "/run/provider.sock";
  auto both = validate(config);
  ASSERT_FALSE(both);
  EXPECT_NE(both.error().message().find("exclude each other"), std::string::npos);
  config.provider_resident = false;
  config.prefill_provider_socket = "provider.sock";
  auto relative = validate(config);
  ASSERT_FALSE(relative);
  EXPECT_NE(relative.error().message().find("--prefill-provider-socket provider.sock: expected an absolute path"),
            std::string::npos);
}

TEST(ResidentProviderCommand, PassesTheModelTheElfsAndTheChannelAtFd3) {
  EXPECT_EQ(resident_provider_command("kvshare-prefill", "m.gguf", ""),
            (std::vector<std::string>{"kvshare-prefill", "--model", "m.gguf", "--serve-fd", "3"}));
  EXPECT_EQ(resident_provider_command("npu-prefill", "m.gguf", "/opt/elfs"),
            (std::vector<std::string>{"npu-prefill", "--model", "m.gguf", "--elfs", "/opt/elfs", "--serve-fd", "3"}));
}

TEST(ProviderName, SaysHowTheProviderRuns) {
  ServeConfig config;
  config.prefill_provider = "kvshare-prefill";
  EXPECT_EQ(provider_name(config), "kvshare-prefill");
  config.provider_resident = true;
  EXPECT_EQ(provider_name(config), "kvshare-prefill (resident)");
  config.provider_resident = false;
  config.prefill_provider_socket = "/run/p.sock";
  EXPECT_EQ(provider_name(config), "the resident provider at /run/p.sock");
  EXPECT_TRUE(provider_is_resident(config));
  EXPECT_TRUE(has_local_provider(config));
}

TEST(JoinCommand, QuotesArgumentsAShellWouldSplit) {
  EXPECT_EQ(join_command({"a", "b c", "it's", ""}), "a 'b c' 'it'\\''s' ''");
}

}  // namespace
}  // namespace kvshare::route
