#!/usr/bin/env python3
"""memory_kinds: every memory kind llama.cpp has, through both routes, with the patched
llama-server (LLAMA_SERVER_KVSHARE=path; skipped, exit 77, without it) as the decoder and its
llama-kvshare-prefill as the provider (issue 26). One generated model per kind
(kvshare-mkmodel --arch):

  mamba2  recurrent (conv + SSM state, one cell per sequence)
  lfm2    hybrid: short-conv layers (recurrent state with no S part) and attention layers
  qwen35  hybrid: Gated DeltaNet layers and gated attention, M-RoPE
  gemma3  iSWA: a base cache and a sliding-window cache

For each, the greedy reply of --device hybrid equals --device cpu's on the same server,
streamed and not, and timings.prompt_n is 1 (the decoder evaluated the last token only):
- shared route (ONEBIT_KV_SHARE=1): the log line has share Y ms, no fallback, and the
  decoder's memory after the handoff equals its own prefill byte for byte (both sides run
  the same libllama over the same batches; the slot is saved and compared with
  kvshare-state diff at tolerance 0);
- file route (flag unset): the state file is restored and reused. For gemma3 that needs the
  file to carry n_swa + 1 SWA positions (llama-kvshare-prefill keeps them; llama.cpp's own
  save keeps n_swa and llama-server would re-process the whole prompt).

And on the deployment's own class (qwen35): a provider refusing a header whose recurrent
field was altered, and a provider that wrote the whole state and then died, are both
forwarded to the erased slot with the reply still --device cpu's; 32 concurrent requests
through the shared route are all right and leave nothing behind.

--vulkan (issue #42): the same into the patched llama-server as a GPU decoder, every layer
and its whole KV cache on a Vulkan device (-ngl 99 and GGML_VK_VISIBLE_DEVICES=0: lavapipe in
CI), against --device cpu of that same decoder. The decoder's log says its cache is on the
device and in the exported region. The provider runs on the CPU (the NPU case: another
engine computed the rows; the decoder's memory after the handoff equals its own prefill
within 0.01) and, for qwen3 and qwen35, on the same device (a Vulkan provider: byte for
byte; qwen35's Gated DeltaNet state, computed by the CPU backend and by lavapipe, differs
enough to move its attention K and V past 0.01). On
lavapipe every process that computes on the device first compiles its pipelines (about 4 s
here), so the per-request providers stay on the CPU where the device is not the point.
Partial offload (a 4-layer qwen3 at -ngl 3: two layers' KV on the device, two on the CPU)
takes both routes. A device that cannot import the region (LLAMA_KVSHARE_DEVICE_IMPORT=none) or whose
import fails (=misaligned) answers the share 501 with the reason, and the request takes
the file route, reply unchanged.

usage: memory_kinds.py BIN_DIR [--vulkan]
"""
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys

from hybrid_common import (DECODER_RE, SHARED_LINE, VULKAN_ENV, Serve, chat_reply_of, check, llama_kvshare_prefill,
                           run_tests, temp_dir, vulkan_device, wait_until, wrapped_provider)

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP memory_kinds: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
LLAMA_PREFILL = llama_kvshare_prefill(LLAMA)
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-mkmodel", "kvshare-state")}
missing = [name for name, path in TOOLS.items() if not os.access(path, os.X_OK)]
if not os.access(LLAMA_PREFILL, os.X_OK):
    missing.append(LLAMA_PREFILL)
if missing:
    print("SKIP memory_kinds: %s not built" % ", ".join(missing))
    sys.exit(77)

VULKAN = "--vulkan" in sys.argv[2:]
# "Vulkan0: llvmpipe (...)" with --vulkan (exits, skipped or failed, without such a device)
DEVICE = vulkan_device(LLAMA, "memory_kinds --vulkan") if VULKAN else None

WORK = temp_dir()
# --vulkan: the provider on the CPU, as an NPU engine is: it does not see the Vulkan device
CPU_PROVIDER = (wrapped_provider(WORK, "cpu-provider", "os.environ.pop('GGML_VK_VISIBLE_DEVICES', None)",
                                 LLAMA_PREFILL) if VULKAN else LLAMA_PREFILL)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
KV_FLAGS = ["-c", "1024", "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
FILE_LINE = re.compile(r"hybrid: (\d+) prompt tokens: prefill \d+\.\d{3} ms, restore \d+\.\d{3} ms, "
                       r"first byte \d+\.\d{3} ms$")
# Longer than gemma3's window (kvshare-mkmodel's default 32) plus two: the shortest prompt an
# iSWA handoff can be reused for (docs/hybrid.md). Two prompts, so no request repeats the
# slot's cached prompt (serve forwards a prompt it holds).
PROMPTS = ["Tell me about the sea, the ships on it and the people who sail them: " + "waves " * 30,
           "Write one line of code that prints the sum of a list, then explain it: " + "numbers " * 30]
if VULKAN:
    # Shorter, still past gemma3's window plus two: lavapipe prefills qwen35's Gated DeltaNet
    # at about 9 tokens/s on this VM, and every baseline prefills each prompt twice.
    PROMPTS = ["Tell me about the sea, the ships on it and the people who sail them: " + "waves " * 6,
               "Write one line of code that prints the sum of a list, then explain it: " + "numbers " * 6]


def make_model(arch, layers=None):
    path = os.path.join(WORK, arch + ("-%d" % layers if layers else "") + ".gguf")
    if not os.path.exists(path):
        subprocess.run([TOOLS["kvshare-mkmodel"], path, "--arch", arch, "--seed", "5"] +
                       (["--layers", str(layers)] if layers else []), check=True, timeout=120, capture_output=True)
    return path


def request(text, stream=False):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0, "stream": stream}


def start(model, device, kv_share=False, provider=LLAMA_PREFILL, decoder_args=None, ngl="99", env=None):
    """serve in front of the patched llama-server; `decoder_args` go to llama-server. With
    --vulkan the decoder (and a provider that inherits the environment) sees the Vulkan
    device and puts `ngl` layers on it; -lv 4 shows libllama's lines about where its cache is."""
    args = ["-m", model, "--device", device, "--port", "0", "--backend", LLAMA] + KV_FLAGS
    if device == "hybrid":
        # The prompts are short: the test is of the handoff, which auto would skip.
        args += ["--prefill-provider", provider, "--handoff", "always"]
    decoder_args = (["-ngl", ngl, "-lv", "4"] if VULKAN else []) + (decoder_args or [])
    if decoder_args:
        args += ["--"] + decoder_args
    env = dict({"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": "1" if kv_share else None},
               **(VULKAN_ENV if VULKAN else {}), **(env or {}))
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=300)


def replies(serve, stream=False):
    return [chat_reply_of(*serve.post("/v1/chat/completions", request(p, stream), timeout=180), stream)
            for p in PROMPTS]


def decoder_post(serve, path, body):
    """POSTs to serve's llama-server child directly (serve's own API has no slot actions)."""
    import http.client
    port = int(DECODER_RE.search(serve.wait_line(DECODER_RE, timeout=60)).group(1))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    check(response.status == 200, "%s: %s %s" % (path, response.status, data[:300]))
    return json.loads(data)


def save_slot(serve, name):
    """The decoder's slot 0, saved by llama-server itself, moved into WORK."""
    decoder_post(serve, "/slots/0?action=save", {"filename": name})
    slot_dirs = [d for d in os.listdir(SERVE_TMP) if d.startswith("kvshare-serve-slots")]
    check(len(slot_dirs) == 1, "slot dirs %s" % slot_dirs)
    out = os.path.join(WORK, name)
    shutil.move(os.path.join(SERVE_TMP, slot_dirs[0], name), out)
    return out


def baseline(arch, model=None, ngl="99"):
    """--device cpu's replies to PROMPTS, and the slot after the decoder alone computed the
    last prompt as a handoff splits it: its ids but the last in one batch, then the chat
    request (the last id and the reply). Recurrent state and the attention over a batch are
    not bit-identical across batch splits, so the split is the same on both sides; what
    differs is only who computed the first batch (llama-kvshare-prefill or the decoder)."""
    # Without context checkpoints: llama-server otherwise ends a prompt's batch 4 tokens
    # early to checkpoint there (PR #20288), a split the provider does not make.
    serve = start(model or make_model(arch), "cpu", decoder_args=["--ctx-checkpoints", "0"], ngl=ngl)
    try:
        out = [text for text, _ in replies(serve)]
        decoder_post(serve, "/slots/0?action=erase", {})
        messages = request(PROMPTS[-1])["messages"]
        prompt = decoder_post(serve, "/apply-template", {"messages": messages})["prompt"]
        ids = decoder_post(serve, "/tokenize",
                           {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
        decoder_post(serve, "/completion", {"prompt": ids[:-1], "n_predict": 0, "id_slot": 0, "cache_prompt": True})
        text, prompt_n = chat_reply_of(*serve.post("/v1/chat/completions", request(PROMPTS[-1]), timeout=180), False)
        check(text == out[-1] and prompt_n == 1, "%s: the split prefill said %r (prompt_n %s), the whole one %r" %
              (arch, text, prompt_n, out[-1]))
        own = save_slot(serve, arch + "-own-prefill.state")
    finally:
        serve.stop()
    return out, own


def check_route(arch, kv_share, model=None, ngl="99", provider=CPU_PROVIDER, tolerance=None, on="Vulkan0"):
    """`tolerance`: kvshare-state diff's, None for byte for byte (with --vulkan, 0.01 unless
    the provider computes on the decoder's device). `on` (--vulkan): the devices the
    decoder's log says its placed cache is on."""
    if VULKAN and tolerance is None and provider == CPU_PROVIDER:
        tolerance = "0.01"
    expected, own = baseline(arch, model, ngl)
    route = "shared" if kv_share else "file"
    serve = start(model or make_model(arch), "hybrid", kv_share, provider=provider, ngl=ngl)
    try:
        for stream in (False, True):
            for prompt, want, (text, prompt_n) in zip(PROMPTS, expected, replies(serve, stream)):
                check(text == want, "%s %s route: reply %r differs from --device cpu %r (stream=%s)" %
                      (arch, route, text, want, stream))
                check(prompt_n == 1, "%s %s route: prompt_n %s, expected 1 (stream=%s)" %
                      (arch, route, prompt_n, stream))
        line = SHARED_LINE if kv_share else FILE_LINE
        lines = serve.wait_count(line, 2 * len(PROMPTS))
        check(len(lines) == 2 * len(PROMPTS), "%s %s route: handoff lines:\n%s" % (arch, route, "\n".join(serve.lines)))
        check(not [l for l in serve.lines if "hybrid: fallback" in l or "shared route not taken" in l],
              "%s: fallbacks:\n%s" % (arch, "\n".join(serve.lines)))
        for l in lines[:2]:
            print("  %s %s: %s" % (arch, route, l[l.index("hybrid: "):]))
        if VULKAN and kv_share:
            check_placed_on_device(serve, arch, on)
        if kv_share:
            # The strong check: the memory after the handoff of the last prompt is the memory
            # the server holds after prefilling that prompt itself.
            handed = save_slot(serve, arch + "-handoff.state")
            result = subprocess.run([TOOLS["kvshare-state"], "diff", handed, own] +
                                    (["--tolerance", tolerance] if tolerance else []), capture_output=True, text=True,
                                    timeout=60)
            check(result.returncode == 0, "%s: the handed-over memory differs from llama-server's own prefill:\n%s%s" %
                  (arch, result.stdout, result.stderr))
    finally:
        code = serve.stop()
    check(code == 0, "serve exit code %d" % code)
    check(os.listdir(SERVE_TMP) == [], "left behind in TMPDIR: %s" % os.listdir(SERVE_TMP))


def test_mamba2_recurrent_shared_route():
    check_route("mamba2", True)


def test_mamba2_recurrent_file_route():
    check_route("mamba2", False)


def test_lfm2_hybrid_shared_route():
    check_route("lfm2", True)


def test_lfm2_hybrid_file_route():
    check_route("lfm2", False)


def test_qwen35_gated_deltanet_shared_route():
    # --vulkan: the provider on the decoder's device. A CPU provider's rows reach the same
    # replies, but lavapipe and the CPU backend compute the Gated DeltaNet state apart (up to
    # 4e-4 in S), which carries into the attention layer's K and V past 0.01 (0.029 seen).
    check_route("qwen35", True, provider=LLAMA_PREFILL if VULKAN else CPU_PROVIDER,
                tolerance="0" if VULKAN else None)


def test_qwen35_gated_deltanet_file_route():
    check_route("qwen35", False)


def test_gemma3_iswa_shared_route():
    check_route("gemma3", True)


def test_gemma3_iswa_file_route_is_reused():
    check_route("gemma3", False)


# The decoder's header with one recurrent field altered: the provider must refuse it by name.
ALTER_RECURRENT_FIELD = """
layout = args[args.index("--layout") + 1]
header = json.load(open(layout))
header["memory"]["recurrent"]["layers"][0]["n_embd_s"] += 4
altered = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "altered-%d.json" % os.getpid())
json.dump(header, open(altered, "w"))
args[args.index("--layout") + 1] = altered
"""

# The real provider writes the whole state into the decoder's region, then this one fails.
WRITE_THEN_DIE = """
fds = [int(fd) for fd in args[args.index("--fds") + 1].split(",")] if "--fds" in args else []
done = subprocess.run([REAL] + args, pass_fds=fds)
sys.stderr.write("provider-writes-then-dies: the prefill exited %d, now failing\\n" % done.returncode)
sys.exit(3)
"""


def check_forwarded(arch, provider, said):
    """A shared handoff whose provider failed: forwarded to the erased slot, the decoder
    prefills, the reply is --device cpu's, and serve says why."""
    expected, _ = baseline(arch)
    serve = start(make_model(arch), "hybrid", kv_share=True, provider=provider)
    try:
        for want, (text, prompt_n) in zip(expected, replies(serve)):
            check(text == want, "%s after a failed provider: %r, --device cpu said %r" % (arch, text, want))
            check(prompt_n > 1, "%s after a failed provider the decoder evaluated %s token(s): it used the "
                  "provider's state" % (arch, prompt_n))
        lines = serve.wait_count(r"hybrid: fallback \(provider_failed\)", len(PROMPTS))
        check(len(lines) == len(PROMPTS), "fallback lines:\n%s" % "\n".join(serve.lines))
        check(any(said in line for line in serve.lines), "serve's stderr does not say %r:\n%s" %
              (said, "\n".join(serve.lines)))
        check(not [line for line in serve.lines if SHARED_LINE.search(line)], "a shared handoff was reported")
    finally:
        serve.stop()


def test_qwen35_a_header_with_an_altered_recurrent_field_is_refused_and_forwarded():
    check_forwarded("qwen35", wrapped_provider(WORK, "altered-recurrent-field", ALTER_RECURRENT_FIELD, LLAMA_PREFILL),
                    "n_embd_s")


def test_qwen35_a_provider_that_wrote_the_state_and_died_corrupts_no_reply():
    check_forwarded("qwen35", wrapped_provider(WORK, "writes-then-dies", WRITE_THEN_DIE, LLAMA_PREFILL),
                    "provider-writes-then-dies")


def test_qwen35_32_concurrent_requests_through_the_shared_route():
    prompts = ["request number %d about the sea: %s" % (i, "waves " * (30 + i % 7)) for i in range(32)]
    model = make_model("qwen35")
    serve = start(model, "cpu")
    try:
        expected = [chat_reply_of(*serve.post("/v1/chat/completions", request(p), timeout=180), False)[0]
                    for p in prompts]
    finally:
        serve.stop()
    serve = start(model, "hybrid", kv_share=True)
    try:
        pid = serve.proc.pid
        fds_before = len(os.listdir("/proc/%d/fd" % pid))

        def one(i):
            stream = i % 2 == 1
            return chat_reply_of(*serve.post("/v1/chat/completions", request(prompts[i], stream), timeout=600), stream)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        for i, (text, prompt_n) in enumerate(results):
            check(text == expected[i], "request %d: %r, --device cpu said %r" % (i, text, expected[i]))
            check(prompt_n == 1, "request %d: prompt_n %s" % (i, prompt_n))
        check(len(serve.wait_count(SHARED_LINE, 32)) == 32, "\n".join(serve.lines))
        wait_until(lambda: len(os.listdir("/proc/%d/fd" % pid)) <= fds_before, 10,
                   "serve holds more fds than before the requests")
        check([e for e in os.listdir(SERVE_TMP) if not e.startswith("kvshare-serve-slots")] == [],
              "sockets or their directories left: %s" % os.listdir(SERVE_TMP))
    finally:
        serve.stop()
    check(os.listdir(SERVE_TMP) == [], "left behind after stop: %s" % os.listdir(SERVE_TMP))


PLACED_LINE = re.compile(r"kvshare: KV cache in exported region, \d+ bytes in \d+ chunk\(s\), backend \S+, on (.+)$")


def check_placed_on_device(serve, arch, on):
    """The decoder's log (llama-server writes it to serve's stderr) says once which device
    imported the region, and that the whole cache is in it, on `on`."""
    device_name = DEVICE.split(":")[0]
    said = [l for l in serve.lines if "kvshare: KV cache on device %s" % device_name in l or
            "kvshare: recurrent state on device %s" % device_name in l]
    check(said and "through host-pointer import" in said[0],
          "%s: the decoder's log does not say its cache is on %s:\n%s" % (arch, device_name, "\n".join(serve.lines[-60:])))
    placed = [PLACED_LINE.search(l).group(1) for l in serve.lines if PLACED_LINE.search(l)]
    check(placed == [on.replace("Vulkan0", device_name)],
          "%s: the placement lines say %s, expected one on %s" % (arch, placed, on))
    print("  %s: %s" % (arch, said[0][said[0].index("kvshare: "):]))


if VULKAN:
    # The CPU-only cases (provider faults, 32 clients, file routes of every kind) are the CPU
    # run's; the device run keeps what the device changes.
    for name in [n for n in globals() if n.startswith("test_") and n not in (
            "test_mamba2_recurrent_shared_route", "test_lfm2_hybrid_shared_route",
            "test_qwen35_gated_deltanet_shared_route", "test_gemma3_iswa_shared_route")]:
        del globals()[name]

    def test_qwen3_plain_shared_route():
        check_route("qwen3", True)

    def test_qwen3_vulkan_provider_into_the_vulkan_decoder():
        # prefill in one device process, decode in another, one KV cache: the same libllama
        # on the same driver over the same batches, so byte for byte
        check_route("qwen3", True, provider=LLAMA_PREFILL, tolerance="0")

    def test_qwen3_partial_offload_shared_route():
        check_route("qwen3", True, model=make_model("qwen3", layers=4), ngl="3", on="CPU and Vulkan0")

    def test_qwen3_partial_offload_file_route():
        check_route("qwen3", False, model=make_model("qwen3", layers=4), ngl="3")

    def check_refused(knob, said):
        """A device that does not take the region: share answers 501 with the reason, the
        request takes the file route, the reply is the decoder's own."""
        expected, _ = baseline("qwen3")
        serve = start(make_model("qwen3"), "hybrid", True, provider=CPU_PROVIDER,
                      env={"LLAMA_KVSHARE_DEVICE_IMPORT": knob})
        try:
            for want, (text, prompt_n) in zip(expected, replies(serve)):
                check(text == want and prompt_n == 1, "import %s: %r (prompt_n %s), --device cpu said %r" %
                      (knob, text, prompt_n, want))
            lines = serve.wait_count(r"hybrid: shared route not taken", len(PROMPTS))
            check(len(lines) == len(PROMPTS) and all(said in l for l in lines),
                  "import %s: serve's lines do not say %r:\n%s" % (knob, said, "\n".join(lines or serve.lines[-40:])))
            # the file route after a shared attempt: its line has "share 0.000 ms, restore Y ms"
            restored = serve.wait_count(r"hybrid: \d+ prompt tokens: prefill [\d.]+ ms, share 0\.000 ms, restore "
                                        r"[\d.]+ ms, first byte", len(PROMPTS))
            check(len(restored) == len(PROMPTS), "import %s: not the file route:\n%s" % (knob, "\n".join(serve.lines[-30:])))
            print("  import %s: %s" % (knob, lines[0][lines[0].index("hybrid: "):][:300]))
        finally:
            code = serve.stop()
        check(code == 0, "serve exit code %d" % code)

    def test_a_device_without_host_pointer_import_takes_the_file_route():
        check_refused("none", "LLAMA_KVSHARE_DEVICE_IMPORT=none forbids importing")

    def test_a_failed_import_takes_the_file_route():
        check_refused("misaligned", "refused to import")
else:
    def test_qwen3_plain_shared_route():
        check_route("qwen3", True)


run_tests(globals(), WORK)
