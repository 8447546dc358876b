#!/usr/bin/env python3
"""serve_slots: kvshare-serve --device hybrid -np 4 (issue 27), the patched llama-server as
the decoder (LLAMA_SERVER_KVSHARE=path; skipped, exit 77, without it), kvshare-prefill as
the provider (per request, and resident), and llama-kvshare-prefill resident.

- 16 concurrent clients, half streamed, on both routes (ONEBIT_KV_SHARE=1: each slot's own KV
  stream is shared and adopted; unset: a state file restored into the slot): every greedy
  reply equals --device cpu's for the same prompt, every handoff's timings.prompt_n is 1,
  serve's line names the slot, more than one slot served at once, and nothing is left
  behind (files in the slot directory, serve's descriptors, child processes);
- a provider that fails every third request: those requests fall back (the decoder prefills
  them in their slot) and every reply, theirs and the other slots', is still --device cpu's;
- each slot's KV after four concurrent shared-route handoffs equals, within the provider's
  rounding, the KV the decoder computes itself for the same prompt in the same slot (every
  slot saved with ?action=save and compared with kvshare-state diff): no provider wrote
  another slot's cells;
- SIGTERM with 8 requests in flight: serve exits 0, its decoder and providers end with it,
  nothing is left in the slot directory;
- (that a provider cannot write another slot's stream: tests/kvshare/share and the C API
  tests; that llama-server adopts per slot: llama_server_slots_share.py.)

--vulkan (issue #42): the shared route's cases into the same decoder on a Vulkan device
(-ngl 99, GGML_VK_VISIBLE_DEVICES=0: lavapipe in CI; skipped without one, failed under
CI=true), against --device cpu of that decoder: kvshare-prefill per request (another engine
wrote the rows), llama-kvshare-prefill resident (on the same device), and a unified cache.

usage: serve_slots.py BIN_DIR [--vulkan]
"""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading

from hybrid_common import (DECODER_RE, VULKAN_ENV, Serve, chat_reply_of, check, descendants, llama_kvshare_prefill,
                           pid_alive, run_tests, temp_dir, vulkan_device, wait_until, wrapped_provider)

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP serve_slots: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
LLAMA_PREFILL = llama_kvshare_prefill(LLAMA)
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-prefill", "kvshare-mkmodel",
                                                    "kvshare-state")}

VULKAN = "--vulkan" in sys.argv[2:]
if VULKAN:
    vulkan_device(LLAMA, "serve_slots --vulkan")  # exits without a Vulkan device

WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7", "--residual-gain", "3"], check=True, timeout=120,
               capture_output=True)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
N_SLOTS = 4
# 512 cells per slot: -c is the whole cache, llama-server splits it between the slots.
KV_FLAGS = ["-c", "2048", "-fa", "on", "-ctk", "f16", "-ctv", "f16", "-np", str(N_SLOTS)]
PROMPTS = ["Client %d asks: tell me about %s, %s." % (i, topic, "and more " * (i % 5))
           for i, topic in enumerate(["the sea", "rivers", "code", "mountains", "birds", "stars", "rain", "trains",
                                      "bread", "salt", "glass", "paper", "iron", "wind", "snow", "fire"])]
HANDOFF_LINE = re.compile(r"hybrid: (\d+) prompt tokens(?:, \d+ cached)?, slot (\d+): prefill \d+\.\d{3} ms"
                          r"(?: of \d+ tokens)?, (share|restore) \d+\.\d{3} ms, first byte \d+\.\d{3} ms$")
RESIDENT_RE = re.compile(r"kvshare-serve: resident provider running \(pid (\d+)")
CPU_REPLIES = {}


def request(text, stream=False):
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            "max_tokens": 8, "temperature": 0, "stream": stream}


def start(device, kv_share=False, provider=None, extra=None):
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", LLAMA] + KV_FLAGS
    env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": "1" if kv_share else None}
    if device == "hybrid":
        args += ["--prefill-provider", provider, "--handoff", "always"] + (extra or [])
    if VULKAN:
        # every layer on the device; a provider that inherits the environment sees it too
        args += ([] if "--" in args else ["--"]) + ["-ngl", "99"]
        env.update(VULKAN_ENV)
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=300)


def reply(serve, text, stream=False):
    return chat_reply_of(*serve.post("/v1/chat/completions", request(text, stream), timeout=300), stream)


def concurrently(serve, prompts):
    """One client thread per prompt, all started together, every other one streamed:
    {prompt: (text, prompt_n)}; a client's exception is re-raised."""
    results, errors = {}, []
    barrier = threading.Barrier(len(prompts))

    def client(i, prompt):
        try:
            barrier.wait()
            results[prompt] = reply(serve, prompt, stream=i % 2 == 1)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append("%r: %s" % (prompt, error))

    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    check(not errors, "clients failed: %s\n%s" % (errors, "\n".join(serve.lines[-40:])))
    return results


def cpu_reply(text):
    """--device cpu -np 4, the decoder alone, one request at a time."""
    if not CPU_REPLIES:
        serve = start("cpu")
        try:
            for prompt in PROMPTS:
                CPU_REPLIES[prompt] = reply(serve, prompt)[0]
        finally:
            serve.stop()
    return CPU_REPLIES[text]


def slot_files():
    out = []
    for d in os.listdir(SERVE_TMP):
        if d.startswith("kvshare-serve-slots"):
            out += os.listdir(os.path.join(SERVE_TMP, d))
    return out


def fd_count(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def check_replies(serve, results):
    for prompt, (text, prompt_n) in results.items():
        check(text == cpu_reply(prompt), "slot reply %r for %r differs from --device cpu's %r\n%s" %
              (text, prompt, cpu_reply(prompt), "\n".join(serve.lines[-40:])))


def sixteen_clients(kv_share, provider, extra=None):
    serve = start("hybrid", kv_share, provider, extra)
    try:
        # One request first: the provider's and decoder's first-use costs, and the baseline
        # of serve's descriptors with its connections to both made once.
        warm = reply(serve, "Warm up the slots.")
        check(warm[1] == 1, "warm-up prompt_n %s:\n%s" % (warm[1], "\n".join(serve.lines)))
        baseline_fds = fd_count(serve.proc.pid)
        results = concurrently(serve, PROMPTS)
        check_replies(serve, results)
        lines = serve.wait_count(HANDOFF_LINE, len(PROMPTS) + 1, timeout=10)
        route = "share" if kv_share else "restore"
        check(len(lines) == len(PROMPTS) + 1 and all(HANDOFF_LINE.search(l).group(3) == route for l in lines),
              "not every request was handed off by %s:\n%s" % (route, "\n".join(serve.lines)))
        check(not [l for l in serve.lines if "fallback" in l or "not taken" in l], "\n".join(serve.lines))
        for prompt, (_, prompt_n) in results.items():
            check(prompt_n == 1, "prompt_n %s for %r after its handoff, expected 1" % (prompt_n, prompt))
        slots = {int(HANDOFF_LINE.search(l).group(2)) for l in lines}
        check(len(slots) > 1 and slots <= set(range(N_SLOTS)),
              "the handoffs went to slots %s: 16 clients at once must use several of the 4" % sorted(slots))
        wait_until(lambda: fd_count(serve.proc.pid) <= baseline_fds, 15,
                   "serve holds %d descriptors after the clients, %d before" %
                   (fd_count(serve.proc.pid), baseline_fds))
        return serve
    except Exception:
        serve.stop()
        raise


def finish(serve):
    children = descendants(serve.proc.pid)
    code = serve.stop()
    check(code == 0, "serve exited %s" % code)
    wait_until(lambda: not [pid for pid in children if pid_alive(pid)], 15,
               "outlived serve: %s" % [pid for pid in children if pid_alive(pid)])
    check(not slot_files(), "left in the slot directory: %s" % slot_files())


def test_file_route_sixteen_clients():
    finish(sixteen_clients(False, TOOLS["kvshare-prefill"]))


def test_file_route_llama_provider():
    """llama-kvshare-prefill told --parallel 4: its state file carries the decoder's 4 streams."""
    finish(sixteen_clients(False, LLAMA_PREFILL))


def test_file_route_resident_llama_provider():
    finish(sixteen_clients(False, LLAMA_PREFILL, ["--provider-resident"]))


def test_shared_route_sixteen_clients():
    finish(sixteen_clients(True, TOOLS["kvshare-prefill"]))


def test_shared_route_resident_provider():
    finish(sixteen_clients(True, TOOLS["kvshare-prefill"], ["--provider-resident"]))


def test_shared_route_resident_llama_provider():
    finish(sixteen_clients(True, LLAMA_PREFILL, ["--provider-resident"]))


# A unified cache (llama-server's -kvu, its -np auto): every slot's cells in one stream. The
# shared route's share reserves a run of free cells for the slot and names it; the provider
# writes only those cells (--first-cell, --cells); the file route's provider is told
# --kv-unified, so its state file has the decoder's one stream.
UNIFIED = ["--", "-kvu"]


def unified_sixteen_clients(kv_share, provider, extra):
    serve = sixteen_clients(kv_share, provider, extra + UNIFIED)
    check([l for l in serve.lines if "kv_unified = 'true'" in l], "the decoder's cache is not unified:\n%s" %
          "\n".join(serve.lines[:20]))
    finish(serve)


def test_unified_cache_shared_route():
    unified_sixteen_clients(True, TOOLS["kvshare-prefill"], [])


def test_unified_cache_shared_route_resident_llama_provider():
    unified_sixteen_clients(True, LLAMA_PREFILL, ["--provider-resident"])


def test_unified_cache_file_route():
    unified_sixteen_clients(False, TOOLS["kvshare-prefill"], [])


def test_a_provider_failing_for_one_slot_leaves_the_others_right():
    counter = os.path.join(WORK, "provider-calls")
    flaky = wrapped_provider(WORK, "flaky-provider", (
        "import fcntl\n"
        "with open(%r, 'a+') as f:\n"
        "    fcntl.flock(f, fcntl.LOCK_EX)\n"
        "    f.write('x')\n"
        "    f.flush()\n"
        "    f.seek(0)\n"
        "    n = len(f.read())\n"
        "if n %% 3 == 0:\n"
        "    sys.stderr.write('flaky provider: call %%d fails on purpose\\n' %% n)\n"
        "    sys.exit(3)\n") % counter, TOOLS["kvshare-prefill"])
    serve = start("hybrid", True, flaky)
    try:
        results = concurrently(serve, PROMPTS)
        check_replies(serve, results)
        failed = serve.wait_count(r"hybrid: fallback \(provider_failed\)", len(PROMPTS) // 3, timeout=10)
        check(len(failed) == len(PROMPTS) // 3, "fallbacks: %d, expected %d\n%s" %
              (len(failed), len(PROMPTS) // 3, "\n".join(serve.lines)))
        handed = serve.wait_count(HANDOFF_LINE, len(PROMPTS) - len(failed), timeout=10)
        check(len(handed) == len(PROMPTS) - len(failed), "handoffs:\n%s" % "\n".join(serve.lines))
        finish(serve)
    except Exception:
        serve.stop()
        raise


def save_slot(serve, slot, name):
    """The decoder's slot `slot` saved as `name` in serve's slot directory; its path."""
    port = int(DECODER_RE.search(serve.wait_line(DECODER_RE)).group(1))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/slots/%d?action=save" % slot, body=json.dumps({"filename": name}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    check(response.status == 200, "save of slot %d: %d %s" % (slot, response.status, data[:300]))
    found = [os.path.join(SERVE_TMP, d, name) for d in os.listdir(SERVE_TMP)
             if d.startswith("kvshare-serve-slots") and os.path.exists(os.path.join(SERVE_TMP, d, name))]
    check(len(found) == 1, "saved file %s: %s" % (name, found))
    return found[0]


def test_each_slot_holds_its_own_prompts_kv():
    # Four prompts of distinct lengths at once: serve's line ("N prompt tokens, slot S")
    # then says which slot each went to.
    prompts = ["Slot test %s." % ("word " * (3 * i)) for i in range(N_SLOTS)]
    hybrid = start("hybrid", True, TOOLS["kvshare-prefill"])
    try:
        results = concurrently(hybrid, prompts)
        lines = hybrid.wait_count(HANDOFF_LINE, N_SLOTS, timeout=10)
        check(len(lines) == N_SLOTS, "handoffs:\n%s" % "\n".join(hybrid.lines))
        slot_of_length = {int(HANDOFF_LINE.search(l).group(1)): int(HANDOFF_LINE.search(l).group(2)) for l in lines}
        check(len(set(slot_of_length.values())) == N_SLOTS, "four prompts, slots %s" % slot_of_length)
        lengths = {}
        for prompt in prompts:
            status, data = hybrid.post("/v1/chat/completions", dict(request(prompt), max_tokens=1), timeout=120)
            check(status == 200, "length probe %d" % status)
            lengths[prompt] = json.loads(data)["usage"]["prompt_tokens"]
        # The probes above went through serve too: they are in the log, and each one's slot
        # now holds its prompt (they were forwarded by decision or handed off again).
        saved = {}
        for prompt in prompts:
            slot = slot_of_length[lengths[prompt]]
            saved[prompt] = (slot, save_slot(hybrid, slot, "hybrid-slot-%d.state" % slot))
    except Exception:
        hybrid.stop()
        raise
    cpu = start("cpu")
    try:
        for prompt in prompts:
            slot, hybrid_file = saved[prompt]
            status, data = cpu.post("/v1/chat/completions", dict(request(prompt), max_tokens=1, id_slot=slot),
                                    timeout=120)
            check(status == 200, "cpu %d" % status)
            own = save_slot(cpu, slot, "cpu-slot-%d.state" % slot)
            diff = subprocess.run([TOOLS["kvshare-state"], "diff", hybrid_file, own, "--tolerance", "0.05"],
                                  capture_output=True, text=True, timeout=60)
            check(diff.returncode == 0, "slot %d (%r): its KV differs from the decoder's own prefill:\n%s%s" %
                  (slot, prompt, diff.stdout, diff.stderr))
    finally:
        cpu.stop()
        hybrid.stop()
    for prompt, (text, prompt_n) in results.items():
        check(prompt_n == 1, "prompt_n %s for %r" % (prompt_n, prompt))


def test_sigterm_with_eight_requests_in_flight():
    serve = start("hybrid", True, TOOLS["kvshare-prefill"])
    outcomes = []

    def client(prompt):
        try:
            outcomes.append(reply(serve, prompt, stream=True))
        except Exception as error:  # noqa: BLE001 - a cut reply is an expected outcome here
            outcomes.append(error)

    try:
        children = descendants(serve.proc.pid)
        threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS[:8]]
        for thread in threads:
            thread.start()
        # Some handed off, the others waiting for a slot or mid-handoff.
        serve.wait_line(HANDOFF_LINE, timeout=120)
        check(serve.stop() == 0, "serve's exit after SIGTERM:\n%s" % "\n".join(serve.lines[-30:]))
        for thread in threads:
            thread.join(120)
        check(len(outcomes) == 8, "%d of 8 clients returned" % len(outcomes))
        for outcome in outcomes:
            if isinstance(outcome, tuple):
                check(outcome[0] in (cpu_reply(p) for p in PROMPTS[:8]), "a finished reply is wrong: %r" % (outcome,))
        wait_until(lambda: not [pid for pid in children if pid_alive(pid)], 15,
                   "outlived serve: %s" % [pid for pid in children if pid_alive(pid)])
        check(not slot_files(), "left in the slot directory: %s" % slot_files())
    finally:
        serve.kill()


if VULKAN:
    for name in [n for n in globals() if n.startswith("test_") and n not in (
            "test_shared_route_sixteen_clients", "test_shared_route_resident_llama_provider",
            "test_unified_cache_shared_route")]:
        del globals()[name]

run_tests(globals(), WORK)
