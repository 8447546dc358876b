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

usage: memory_kinds.py BIN_DIR
"""
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys

from hybrid_common import (DECODER_RE, SHARED_LINE, Serve, chat_reply_of, check, llama_kvshare_prefill, run_tests,
                           temp_dir, wait_until, wrapped_provider)

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

WORK = temp_dir()
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


def make_model(arch):
    path = os.path.join(WORK, arch + ".gguf")
    if not os.path.exists(path):
        subprocess.run([TOOLS["kvshare-mkmodel"], path, "--arch", arch, "--seed", "5"], check=True, timeout=120,
                       capture_output=True)
    return path


def request(text, stream=False):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0, "stream": stream}


def start(model, device, kv_share=False, provider=LLAMA_PREFILL, decoder_args=None):
    args = ["-m", model, "--device", device, "--port", "0", "--backend", LLAMA] + KV_FLAGS
    if device == "hybrid":
        # The prompts are short: the test is of the handoff, which auto would skip.
        args += ["--prefill-provider", provider, "--handoff", "always"]
    env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": "1" if kv_share else None}
    return Serve(TOOLS["kvshare-serve"], args + (decoder_args or []), env, timeout=180)


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


def baseline(arch):
    """--device cpu's replies to PROMPTS, and the slot after the decoder alone computed the
    last prompt as a handoff splits it: its ids but the last in one batch, then the chat
    request (the last id and the reply). Recurrent state and the attention over a batch are
    not bit-identical across batch splits, so the split is the same on both sides; what
    differs is only who computed the first batch (llama-kvshare-prefill or the decoder)."""
    # Without context checkpoints: llama-server otherwise ends a prompt's batch 4 tokens
    # early to checkpoint there (PR #20288), a split the provider does not make.
    serve = start(make_model(arch), "cpu", decoder_args=["--", "--ctx-checkpoints", "0"])
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


def check_route(arch, kv_share):
    expected, own = baseline(arch)
    route = "shared" if kv_share else "file"
    serve = start(make_model(arch), "hybrid", kv_share)
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
        if kv_share:
            # The strong check: the memory after the handoff of the last prompt is the memory
            # the server holds after prefilling that prompt itself.
            handed = save_slot(serve, arch + "-handoff.state")
            result = subprocess.run([TOOLS["kvshare-state"], "diff", handed, own], capture_output=True, text=True,
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
    check_route("qwen35", True)


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


run_tests(globals(), WORK)
