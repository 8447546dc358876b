#!/usr/bin/env python3
"""remote_state: the remote route's state variant end to end, kvshare-serve --prefill-remote
with a kvshare-provider-server on loopback and a STOCK llama-server (LLAMA_SERVER; exit 77
without it) as the decoder: no patch, no UCX, no shared region.

- serve finds that the decoder does not speak ?action=share and says "route remote-state";
- the greedy replies equal --device cpu's, streamed and not, with timings.prompt_n 1 and the
  line "restore Y ms remote-state", counted in /metrics; also with -fa off (V transposed) and
  with the provider server's --provider-command (kvshare-prefill);
- a provider server of another model is refused before it computes (400 naming the model),
  the request falls back (remote_state_refused) and the reply is still right;
- serve with a wrong key gets 401: a fallback, and the reply is still right.
Every case runs beside two busy loops (the 2-core CI machine, busy). The measurement (bytes
and ms of one prompt, docs/remote.md) is printed as "measured:".

usage: remote_state.py BIN_DIR
"""
import os
import re
import secrets
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybrid_common import Failure, Serve, chat_reply_of, check, run_tests, temp_dir  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-provider-server", "kvshare-mkmodel",
                                                    "kvshare-prefill")}
missing = [p for p in TOOLS.values() if not os.access(p, os.X_OK)]
if missing:
    print("SKIP remote_state: %s not built" % ", ".join(missing))
    sys.exit(77)
LLAMA_SERVER = os.environ.get("LLAMA_SERVER", "")
if not LLAMA_SERVER or not os.access(LLAMA_SERVER, os.X_OK):
    print("SKIP remote_state: set LLAMA_SERVER=path of a stock llama-server (scripts/test.sh builds one)")
    sys.exit(77)
REMOTE_KEY = secrets.token_hex(16)

WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
OTHER_MODEL = os.path.join(WORK, "other.gguf")
# Residual gain 3: replies depend on the whole prompt, so a wrong KV shows in the text.
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7", "--residual-gain", "3"], check=True, timeout=120,
               capture_output=True)
subprocess.run([TOOLS["kvshare-mkmodel"], OTHER_MODEL, "--seed", "8", "--layers", "3"], check=True, timeout=120,
               capture_output=True)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
KV_FLAGS = ["-c", "1024", "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
# Anywhere in a stderr line: the decoder writes to the same pipe.
STATE_LINE = re.compile(r"hybrid: (\d+) prompt tokens(?:, \d+ cached)?(?:, slot \d+)?: prefill \d+\.\d{3} ms(?: of \d+ tokens)?, "
                        r"restore (\d+\.\d{3}) ms remote-state, first byte (\d+\.\d{3}) ms")
PROVIDER_LINE = re.compile(r"prefill-state: (\d+) tokens, prefill (\d+\.\d{3}) ms, (\d+) bytes")
PROMPTS = ["Tell me about the sea.", "Write one line of code.",
           "A longer prompt, so that the handoff carries a few dozen tokens of KV: " + "words " * 20]
LISTEN_RE = re.compile(r"listening on http://[\d.]+:(\d+)")


def request(text, stream=False, max_tokens=8):
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


class BusyLoops:
    """Two CPU burners beside the test: bounded, always ended."""

    def __enter__(self):
        self.procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait(10)


class Provider:
    """kvshare-provider-server on a free loopback port, keyed with REMOTE_KEY; stderr collected."""

    def __init__(self, model=MODEL, extra=()):
        self.proc = subprocess.Popen([TOOLS["kvshare-provider-server"], "-m", model, "--host", "127.0.0.1", "--port",
                                      "0", "-t", "2"] + list(extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, env=dict(os.environ, KVSHARE_REMOTE_KEY=REMOTE_KEY))
        line = self.proc.stderr.readline().decode()
        match = LISTEN_RE.search(line)
        if not match:
            self.stop()
            raise Failure("the provider server did not start: %r" % line)
        self.url = "http://127.0.0.1:%s" % match.group(1)
        self.rest = ""

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        if self.proc.stderr is not None:
            self.rest = self.proc.stderr.read().decode("utf-8", "replace")
            self.proc.stderr.close()
            self.proc.stderr = None
        bad = [l for l in self.rest.splitlines() if "Sanitizer" in l or "runtime error:" in l]
        check(not bad, "kvshare-provider-server reported:\n%s" % "\n".join(bad[:20]))
        return self.rest


def start_serve(device, url=None, kv_flags=KV_FLAGS, key=REMOTE_KEY, extra=()):
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", LLAMA_SERVER] + kv_flags + list(extra)
    env = dict(TMPDIR=SERVE_TMP, ONEBIT_HYBRID_PREFILL="", ONEBIT_KV_SHARE=None, KVSHARE_REMOTE_KEY=key)
    if url:
        for one in (url if isinstance(url, (list, tuple)) else [url]):
            args += ["--prefill-remote", one]
        # Every prompt here is short: the test is of the handoff, which auto would skip.
        args += ["--handoff", "always"]
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=180)


def stop_checked(serve):
    serve.stop()
    bad = [l for l in serve.lines if "Sanitizer" in l or "runtime error:" in l]
    check(not bad, "kvshare-serve or its decoder reported:\n%s" % "\n".join(bad[:20]))


def reply(serve, text, stream=False):
    status, data = serve.post("/v1/chat/completions", request(text, stream), timeout=300)
    return chat_reply_of(status, data, stream)


CPU = {}


def cpu_replies(kv_flags=KV_FLAGS):
    key = " ".join(kv_flags)
    if key not in CPU:
        serve = start_serve("cpu", kv_flags=kv_flags)
        try:
            CPU[key] = {prompt: reply(serve, prompt)[0] for prompt in PROMPTS}
        finally:
            stop_checked(serve)
    return CPU[key]


def metrics(serve):
    status, _, data = serve.request("GET", "/metrics")
    check(status == 200, "GET /metrics answered %d" % status)
    return data.decode()


def handed_off_equal_to_cpu(provider, kv_flags=KV_FLAGS, streams=(False, True)):
    expected = cpu_replies(kv_flags)
    serve = start_serve("hybrid", provider.url, kv_flags=kv_flags)
    try:
        check(serve.wait_line(r"route remote-state\)", 10), "serve does not say route remote-state")
        n = 0
        for stream in streams:
            for prompt in PROMPTS:
                text, prompt_n = reply(serve, prompt, stream)
                n += 1
                check(text == expected[prompt], "remote-state reply %r differs from --device cpu %r (stream=%s)" %
                      (text, expected[prompt], stream))
                check(prompt_n == 1, "prompt_n %s, expected 1 (stream=%s)" % (prompt_n, stream))
        lines = serve.wait_count(STATE_LINE, n, timeout=60)
        check(len(lines) == n, "remote-state lines (%d of %d):\n%s" % (len(lines), n, "\n".join(serve.lines)))
        text = metrics(serve)
        check('kvshare_handoffs_total{route="remote_state",outcome="ok"} %d' % n in text, "metrics:\n%s" % text)
        return lines
    finally:
        stop_checked(serve)


def test_replies_equal_cpu_streamed_and_not_through_a_stock_llama_server():
    provider = Provider()
    try:
        with BusyLoops():
            lines = handed_off_equal_to_cpu(provider)
    finally:
        rest = provider.stop()
    served = PROVIDER_LINE.findall(rest)
    check(len(served) >= len(lines), "provider lines:\n%s" % rest)
    # The measurement docs/remote.md quotes: the longest prompt's payload and times.
    n_tokens, prefill_ms, n_bytes = max(served, key=lambda m: int(m[0]))
    restore = [STATE_LINE.search(l) for l in lines if STATE_LINE.search(l).group(1) == str(int(n_tokens) + 1)]
    print("measured: %s tokens handed over, %s bytes payload, provider prefill %s ms, restore %s ms, first byte %s ms"
          % (n_tokens, n_bytes, prefill_ms, restore[0].group(2) if restore else "?",
             restore[0].group(3) if restore else "?"), flush=True)


def test_a_transposed_v_cache_and_a_provider_command():
    # -fa off: the state holds V element-major (v_trans); the binding says so and the
    # provider server writes it so. And kvshare-prefill in the NPU engine's place.
    flags = ["-c", "1024", "-fa", "off", "-ctk", "f16", "-ctv", "f16"]
    for extra, kv_flags in (([], flags), (["--provider-command", TOOLS["kvshare-prefill"]], KV_FLAGS)):
        provider = Provider(extra=extra)
        try:
            with BusyLoops():
                handed_off_equal_to_cpu(provider, kv_flags, streams=(False,))
        finally:
            provider.stop()


def expect_fallback(provider, reason, why_pattern, key=REMOTE_KEY):
    expected = cpu_replies()
    serve = start_serve("hybrid", provider.url, key=key)
    try:
        with BusyLoops():
            text, _ = reply(serve, PROMPTS[0])
        check(text == expected[PROMPTS[0]], "fallback reply %r differs from --device cpu %r" %
              (text, expected[PROMPTS[0]]))
        line = serve.wait_line(r"hybrid: fallback \(%s\)" % reason, 60)
        check(re.search(why_pattern, line), "fallback line %r does not say %r" % (line, why_pattern))
        check('kvshare_handoffs_total{route="remote_state",outcome="forwarded"} 1' in metrics(serve),
              "metrics:\n%s" % metrics(serve))
        check(not any(REMOTE_KEY in l for l in serve.lines), "the key shows on serve's stderr")
        return line
    finally:
        stop_checked(serve)


def test_a_provider_of_another_model_is_refused_naming_the_model():
    provider = Provider(OTHER_MODEL)
    try:
        expect_fallback(provider, "remote_state_refused",
                        r'field "model": the remote state is for model 0x[0-9a-f]{16}, this decoder '
                        r'runs 0x[0-9a-f]{16}: give the provider server the decoder\'s model')
    finally:
        rest = provider.stop()
    check("prefill-state refused (400)" in rest, "the provider server did not refuse:\n%s" % rest)
    check(not PROVIDER_LINE.search(rest), "the provider server computed for another model:\n%s" % rest)


def test_a_wrong_key_is_refused_with_401_and_the_reply_is_right():
    provider = Provider()
    try:
        expect_fallback(provider, "remote_provider_failed", r"answered 401", key="not-" + REMOTE_KEY)
    finally:
        rest = provider.stop()
    check("unauthorized" in rest, "the provider server did not say 401:\n%s" % rest)
    check(not PROVIDER_LINE.search(rest), "the provider server prefilled without the key:\n%s" % rest)


def test_a_host_of_another_model_is_passed_over_and_four_slots_take_the_state_files():
    import concurrent.futures
    slots = ["-np", "4"]
    cpu = start_serve("cpu", extra=slots)
    try:
        expected = {p: reply(cpu, p)[0] for p in PROMPTS}
    finally:
        stop_checked(cpu)
    other, provider = Provider(OTHER_MODEL), Provider()
    serve = start_serve("hybrid", [other.url, provider.url], extra=slots)
    try:
        with BusyLoops():
            prompts = [p for p in PROMPTS for _ in range(3)]
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(lambda p: (p, reply(serve, p)), prompts))
        for prompt, (text, prompt_n) in results:
            check(text == expected[prompt], "reply %r to %r differs from --device cpu %r" % (text, prompt,
                                                                                         expected[prompt]))
        line = serve.wait_line(r"hybrid: prefill host %s failed \(remote_state_refused\): .*; trying %s" %
                               (re.escape(other.url), re.escape(provider.url)), 30)
        check(line, "no line passing over the host of another model")
        fallbacks = [l for l in serve.lines if "hybrid: fallback" in l]
        check(not fallbacks, "a request fell back:\n%s" % "\n".join(fallbacks))
        check(len(serve.wait_count(STATE_LINE, 1)) >= 1, "no request went by state file")
        text = metrics(serve)
        check(re.search(r'kvshare_remote_prefills_total\{host="%s",result="ok"\} [1-9]' % re.escape(provider.url),
                        text), "metrics:\n%s" % text)
    finally:
        stop_checked(serve)
        other.stop()
        provider.stop()


run_tests(globals(), WORK)
