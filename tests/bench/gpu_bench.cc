// kvshare-bench gpu: the patched llama-server as a GPU decoder of the shared route (issue
// #42), its KV cache on a Vulkan device and placed in kvshare's region (imported by the
// device), beside the same decoder with its own device KV. Three serves run side by side on
// one generated model, each with its own decoder, all the same patched llama-server binary:
//
//   vulkan-own     --device cpu, the decoder at -ngl 99 on the Vulkan device: its KV cache
//                  in its own device memory (no ONEBIT_KV_SHARE)
//   vulkan-shared  --device hybrid, ONEBIT_KV_SHARE=1, the decoder at -ngl 99: its KV cache
//                  in the exported region, imported by the device; every prompt handed off
//   cpu-shared     the same at -ngl 0: the CPU decoder of the shared route
//
// The Vulkan device is the one GGML_VK_VISIBLE_DEVICES (default 0) names for the Vulkan
// serves; on a machine without a GPU that is lavapipe, Mesa's Vulkan device on the CPU, so
// every figure here is CPU-emulated and says nothing of an iGPU's speed: what it shows is
// that a decoder computing attention over the imported region loses nothing to one over its
// own buffer under the same driver, and what the handoff costs each decoder. The provider
// (llama-kvshare-prefill beside --backend, or --provider PATH) inherits each serve's
// environment: on the Vulkan device for vulkan-shared, on the CPU for cpu-shared.
//
// A round sends one fresh prompt of --tokens T (default 300) to each serve, the order
// rotating from round to round so a slow moment of the machine falls on every serve alike,
// and asks for --n-predict N tokens (default 64, ignore_eos, greedy). Per round: the
// decoder's own decode rate (timings.predicted_per_second), and for the hybrid serves the
// handoff (share + adopt, serve's `hybrid:` line). The report gives medians with p25..p75
// and the paired per-round ratios: vulkan-shared / vulkan-own decode tokens/s (the seed's
// figure for an iGPU is "within 3 %"), and vulkan-shared / cpu-shared handoff ms; then the
// first round's handoff beside the median (the first request's setup) and the import the
// vulkan-shared decoder logged at start (ranges, tensors, milliseconds).
//
// Group flags: --backend PATH (default $LLAMA_SERVER_KVSHARE), --provider PATH, --rounds N
// (default 7), --n-predict N (default 64), --layers N (default 8). Without a patched
// llama-server, or without a Vulkan device it lists, the group reports why and runs nothing.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "bench_files.h"
#include "bench_registry.h"
#include "bench_serve.h"
#include "bench_stats.h"
#include "route/decoder_client.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const char* const kServes[] = {"vulkan-own", "vulkan-shared", "cpu-shared"};

struct Settings {
  fs::path backend;
  fs::path provider;
  std::string visible = "0";  // GGML_VK_VISIBLE_DEVICES of the Vulkan serves
  int rounds = 7;
  int n_predict = 64;
  int layers = 8;
};

Settings& settings() {
  static Settings s;
  return s;
}

struct Setup {
  fs::path dir;
  std::map<std::string, std::unique_ptr<ServeUnderTest>> serves;
  std::string device;  // "Vulkan0: llvmpipe (...)"
  std::string why;
};

bool g_setup_started = false;

// The first Vulkan device `backend` lists with GGML_VK_VISIBLE_DEVICES set, "" with none.
std::string vulkan_device(const fs::path& backend) {
  const std::string command =
      fmt::format("GGML_VK_VISIBLE_DEVICES='{}' '{}' --list-devices 2>&1", settings().visible, backend.string());
  std::string listed;
  if (FILE* out = ::popen(command.c_str(), "r")) {
    char buffer[4096];
    for (size_t got; (got = std::fread(buffer, 1, sizeof buffer, out)) > 0;) listed.append(buffer, got);
    ::pclose(out);
  }
  std::smatch match;
  if (std::regex_search(listed, match, std::regex(R"((Vulkan\d+): ([^\n]+))")))
    return match[1].str() + ": " + match[2].str();
  return "";
}

Setup& setup() {
  g_setup_started = true;
  static Setup s = [] {
    Setup made;
    const Settings& set = settings();
    if (set.backend.empty()) {
      made.why = "no patched llama-server: give --backend PATH or set LLAMA_SERVER_KVSHARE";
      return made;
    }
    auto model = make_bench_model("kvshare-bench-gpu", {set.backend, set.provider}, made.why,
                                  {"--layers", std::to_string(set.layers)}, 4096);
    if (!model) return made;
    made.dir = model->dir;
    made.device = vulkan_device(set.backend);
    if (made.device.empty()) {
      made.why = fmt::format(
          "{} lists no Vulkan device with GGML_VK_VISIBLE_DEVICES={} (lavapipe: Debian's "
          "mesa-vulkan-drivers; a build without KVSHARE_LLAMA_VULKAN)",
          set.backend.string(), set.visible);
      return made;
    }
    for (const std::string name : kServes) {
      ServeLaunch launch;
      launch.name = name;
      launch.args = {"-m",        model->model.string(),
                     "--backend", set.backend.string(),
                     "-c",        "4096",
                     "-fa",       "on",
                     "-ctk",      "f16",
                     "-ctv",      "f16"};
      if (name == "vulkan-own") {
        launch.args.insert(launch.args.end(), {"--device", "cpu"});
      } else {
        launch.args.insert(launch.args.end(),
                           {"--device", "hybrid", "--prefill-provider", set.provider.string(), "--handoff", "always"});
        launch.kv_share = true;
      }
      const bool on_vulkan = name != "cpu-shared";
      // -lv 4: libllama's lines say where the cache went and what the import took
      launch.args.insert(launch.args.end(), {"--", "-ngl", on_vulkan ? "99" : "0", "-lv", "4"});
      if (on_vulkan) launch.env = {"GGML_VK_VISIBLE_DEVICES=" + set.visible};
      auto serve = start_serve(launch, made.dir, made.why);
      if (!serve) return made;
      made.serves[name] = std::move(serve);
    }
    return made;
  }();
  return s;
}

struct Sample {
  double decode_tps = 0;  // the decoder's timings.predicted_per_second
  double handoff_ms = 0;  // share + adopt, hybrid serves only
};

// The `share Y ms` of serve's latest hybrid: line, once there is a line past `before`.
Result<double> handoff_ms(const ServeUnderTest& serve, size_t before) {
  const std::regex line_re(R"(hybrid: \d+ prompt tokens[^\n]*?, share (\d+\.\d+) ms)");
  for (int i = 0; i < 1000; ++i) {
    const std::string log = read_all(serve.stderr_path);
    std::vector<double> found;
    for (std::sregex_iterator it(log.begin(), log.end(), line_re), end; it != end; ++it)
      found.push_back(std::stod((*it)[1]));
    if (found.size() > before) return found.back();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return fail(EPROTO, "no shared handoff line in {} (a fallback?)", serve.stderr_path.string());
}

Result<Sample> one_request(const ServeUnderTest& serve, const std::string& name, const std::string& prompt,
                           size_t handoffs_before) {
  const route::DecoderClient client("127.0.0.1", serve.port, std::chrono::seconds(600));
  auto reply = client.post_json("/v1/completions", Json{{"prompt", prompt},
                                                        {"max_tokens", settings().n_predict},
                                                        {"ignore_eos", true},
                                                        {"temperature", 0},
                                                        {"stream", false}});
  if (!reply) return tl::unexpected(reply.error());
  const Json body = reply->json();
  if (reply->status != 200 || !body.contains("timings") || !body["timings"].contains("predicted_per_second"))
    return fail(EPROTO, "serve {}: status {}, no timings in {:.300}", name, reply->status, reply->body);
  Sample sample;
  sample.decode_tps = body["timings"]["predicted_per_second"].get<double>();
  if (name != "vulkan-own") {
    auto ms = handoff_ms(serve, handoffs_before);
    if (!ms) return tl::unexpected(ms.error());
    sample.handoff_ms = *ms;
  }
  return sample;
}

std::map<std::string, std::vector<Sample>> g_samples;

void bm_gpu(benchmark::State& state) {
  Setup& s = setup();
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  const route::DecoderClient decoder("127.0.0.1", s.serves["vulkan-own"]->decoder_port, std::chrono::seconds(120));
  const int tokens = static_cast<int>(state.range(0));
  g_samples.clear();
  size_t rotation = 0;
  for (auto _ : state) {
    const std::string prompt = prompt_of(decoder, tokens, static_cast<int>(rotation) + 1);
    double round_ms = 0;
    for (size_t k = 0; k < std::size(kServes); ++k) {
      const std::string name = kServes[(rotation + k) % std::size(kServes)];
      auto sample = one_request(*s.serves[name], name, prompt, g_samples[name].size());
      if (!sample) return state.SkipWithError(sample.error().what().c_str());
      g_samples[name].push_back(*sample);
      round_ms += 1e3 * settings().n_predict / sample->decode_tps;
    }
    ++rotation;
    state.SetIterationTime(round_ms / 1e3);
  }
  state.counters["rounds"] = static_cast<double>(state.iterations());
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  if (const char* env = std::getenv("LLAMA_SERVER_KVSHARE")) s.backend = env;
  if (const char* env = std::getenv("GGML_VK_VISIBLE_DEVICES")) s.visible = env;
  bool provider_given = false;
  for (size_t i = 0; i + 1 < args.rest.size(); ++i) {
    if (args.rest[i] == "--backend")
      s.backend = args.rest[++i];
    else if (args.rest[i] == "--provider")
      s.provider = args.rest[++i], provider_given = true;
    else if (args.rest[i] == "--rounds")
      s.rounds = std::max(1, std::atoi(args.rest[++i].c_str()));
    else if (args.rest[i] == "--n-predict")
      s.n_predict = std::max(1, std::atoi(args.rest[++i].c_str()));
    else if (args.rest[i] == "--layers")
      s.layers = std::max(1, std::atoi(args.rest[++i].c_str()));
  }
  if (!provider_given && !s.backend.empty()) s.provider = s.backend.parent_path() / "llama-kvshare-prefill";
  if (args.smoke) s.rounds = 1, s.n_predict = 4, s.layers = 2;
  for (int tokens : args.tokens)
    benchmark::RegisterBenchmark(fmt::format("gpu/{}", tokens).c_str(), bm_gpu)
        ->Arg(tokens)
        ->Iterations(s.rounds)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
}

// The import line the vulkan-shared decoder wrote at start (issue #42's glue), "" if none.
std::string import_line(const Setup& s) {
  if (!s.serves.count("vulkan-shared")) return "";
  const std::string log = read_all(s.serves.at("vulkan-shared")->stderr_path);
  std::smatch match;
  if (std::regex_search(
          log, match,
          std::regex(
              R"(kvshare: KV cache on device [^\n]*?: (\d+) tensors in (\d+) range\(s\) imported in ([\d.]+) ms)")))
    return fmt::format("{} tensors in {} range(s), imported in {} ms", match[1].str(), match[2].str(), match[3].str());
  return "";
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  const Settings& set = settings();
  const bool measured = !runs_with_prefix(runs, "gpu/").empty() && g_samples.size() == std::size(kServes) &&
                        !g_samples["vulkan-own"].empty();
  if (measured) {
    Setup& s = setup();
    std::map<std::string, std::vector<double>> tps, handoff;
    std::vector<double> decode_ratio, handoff_ratio;
    for (const std::string name : kServes)
      for (const Sample& sample : g_samples[name])
        tps[name].push_back(sample.decode_tps), handoff[name].push_back(sample.handoff_ms);
    for (size_t r = 0; r < g_samples["vulkan-own"].size(); ++r) {
      decode_ratio.push_back(g_samples["vulkan-shared"][r].decode_tps / g_samples["vulkan-own"][r].decode_tps);
      handoff_ratio.push_back(g_samples["vulkan-shared"][r].handoff_ms / g_samples["cpu-shared"][r].handoff_ms);
    }
    const Spread own = spread_of(tps["vulkan-own"]), shared = spread_of(tps["vulkan-shared"]),
                 cpu = spread_of(tps["cpu-shared"]), dr = spread_of(decode_ratio);
    const Spread hv = spread_of(handoff["vulkan-shared"]), hc = spread_of(handoff["cpu-shared"]),
                 hr = spread_of(handoff_ratio);
    const std::string imported = import_line(s);
    if (args.json) {
      fmt::print(
          "{{\"bench\":\"gpu\",\"device\":{},\"rounds\":{},\"n_predict\":{},\"decode_tps_own\":{:.2f},"
          "\"decode_tps_shared\":{:.2f},\"decode_tps_cpu\":{:.2f},\"decode_ratio\":{:.4f},\"decode_ratio_p25\":{:.4f},"
          "\"decode_ratio_p75\":{:.4f},\"handoff_ms_vulkan\":{:.3f},\"handoff_ms_cpu\":{:.3f},\"handoff_ratio\":{:.3f},"
          "\"first_handoff_ms_vulkan\":{:.3f},\"first_handoff_ms_cpu\":{:.3f},\"import\":{}}}\n",
          Json(s.device).dump(), decode_ratio.size(), set.n_predict, own.median, shared.median, cpu.median, dr.median,
          dr.p25, dr.p75, hv.median, hc.median, hr.median, handoff["vulkan-shared"].front(),
          handoff["cpu-shared"].front(), Json(imported).dump());
    } else {
      fmt::print(
          "\ngpu (decoder {} on {}; CPU-emulated when that is lavapipe; generated qwen3 of {} layers, -c 4096 -fa on "
          "f16; {} tokens decoded per request; {} rounds, the serves' order rotating)\n",
          set.backend.filename().string(), s.device, set.layers, set.n_predict, decode_ratio.size());
      auto cell = [](const Spread& x) { return fmt::format("{:.2f} [{:.2f}..{:.2f}]", x.median, x.p25, x.p75); };
      fmt::print("  decode tokens/s: vulkan own KV {}, vulkan shared KV {}, cpu shared KV {}\n", cell(own),
                 cell(shared), cell(cpu));
      fmt::print(
          "  vulkan shared / own decode tokens/s, paired per round: {:.3f} [{:.3f}..{:.3f}] (seed: within 3 %)\n",
          dr.median, dr.p25, dr.p75);
      fmt::print("  handoff ms (share + adopt): vulkan {}, cpu {}; vulkan / cpu paired {:.2f} [{:.2f}..{:.2f}]\n",
                 cell(hv), cell(hc), hr.median, hr.p25, hr.p75);
      fmt::print("  first request's handoff ms: vulkan {:.3f}, cpu {:.3f} (median of all rounds above)\n",
                 handoff["vulkan-shared"].front(), handoff["cpu-shared"].front());
      fmt::print("  the vulkan decoder's import at start: {}\n", imported.empty() ? "not in its log" : imported);
    }
  }
  if (g_setup_started) {
    Setup& made = setup();
    if (!made.why.empty() && !args.json) fmt::print("gpu: not run: {}\n", made.why);
    made.serves.clear();
    std::error_code ec;
    if (!made.dir.empty()) fs::remove_all(made.dir, ec);
  }
  return 0;
}

const bool registered = add_group({
    "gpu",
    "the patched llama-server as a GPU (Vulkan) decoder of the shared route: decode tokens/s on the imported KV "
    "against its own, the handoff on the Vulkan decoder against the CPU one, the import at start; paired rounds",
    register_all,
    report,
    {
        {"--backend", "PATH", "the patched llama-server (default $LLAMA_SERVER_KVSHARE)"},
        {"--provider", "PATH", "the provider (default llama-kvshare-prefill beside --backend)"},
        {"--rounds", "N", "rounds per run (default 7)"},
        {"--n-predict", "N", "tokens decoded per request (default 64)"},
        {"--layers", "N", "layers of the generated model (default 8)"},
    },
    {300},
    {16},
});

}  // namespace
}  // namespace kvshare::bench