#!/usr/bin/env python3
"""hybrid_e2e: a generated model through the whole hybrid route with the reference pair
(kvshare-prefill as the provider, kvshare-decoder as the decoder), on both routes:

- the greedy reply through --device hybrid equals the plain --device cpu reply, streamed
  and not, and the decoder's timings.prompt_n is 1 (it evaluated the last token only);
- the file route (a state file and ?action=restore) and the shared route
  (ONEBIT_KV_SHARE=1: share -> fds -> kvshare-prefill writes the decoder's cache -> adopt);
- 32 requests at once through the shared route: every reply right, and nothing left
  behind (serve's fds, the slot directory, sockets and their directories);
- a client that keeps its connection (as OpenAI's SDKs do) gets every reply from serve and
  from kvshare-decoder without waiting for its own delayed ACK (both set TCP_NODELAY);
- serve relays the decoder's GET endpoints, and a SIGTERM at any moment of its startup
  ends it;
- with LLAMA_SERVER=path, the file route against a real llama-server as the decoder
  (skipped with a message otherwise).

usage: hybrid_e2e.py BIN_DIR      (exit 77 = skipped: a tool of the reference pair is missing)
"""
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from hybrid_common import Serve, chat_reply_of, check, run_tests, temp_dir, wait_until

BIN = os.path.abspath(sys.argv[1])
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-decoder", "kvshare-prefill",
                                                    "kvshare-mkmodel")}
missing = [name for name, path in TOOLS.items() if not os.access(path, os.X_OK)]
if missing:
    print("SKIP hybrid_e2e: %s not built" % ", ".join(missing))
    sys.exit(77)

WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7"], check=True, timeout=120, capture_output=True)
# Sockets and their private directories go under here, so the test can see none is left.
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
KV_FLAGS = ["-c", "1024", "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
# Matched anywhere in a stderr line: with LLAMA_SERVER as the decoder its log shares serve's
# stderr and can put its timestamp before serve's line.
SHARED_LINE = re.compile(r"hybrid: (\d+) prompt tokens(?:, \d+ cached)?: prefill \d+\.\d{3} ms(?: of \d+ tokens)?, share \d+\.\d{3} ms, "
                         r"first byte \d+\.\d{3} ms$")
FILE_LINE = re.compile(r"hybrid: (\d+) prompt tokens: prefill \d+\.\d{3} ms, restore \d+\.\d{3} ms, "
                       r"first byte \d+\.\d{3} ms$")
PROMPTS = ["Tell me about the sea.", "Write one line of code.",
           "A longer prompt, so that the handoff carries a few dozen tokens of KV: " + "words " * 20]


def request(text, stream=False):
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            "max_tokens": 8, "temperature": 0, "stream": stream}


def start(device, backend, kv_share=False, extra_env=None, expect_listen=True):
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", backend] + KV_FLAGS
    env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": ""}
    if device == "hybrid":
        # Every prompt here is short: the test is of the handoff, which auto would skip.
        args += ["--prefill-provider", TOOLS["kvshare-prefill"], "--handoff", "always"]
    # "set and non-empty" turns the shared route on: unset is the only off.
    env["ONEBIT_KV_SHARE"] = "1" if kv_share else None
    env.update(extra_env or {})
    return Serve(TOOLS["kvshare-serve"], args, env, expect_listen=expect_listen, timeout=120)


def replies(serve, prompts, stream=False):
    out = []
    for text in prompts:
        status, data = serve.post("/v1/chat/completions", request(text, stream), timeout=120)
        out.append(chat_reply_of(status, data, stream))
    return out


CPU_REPLIES = {}


def cpu_reply(prompt):
    return CPU_REPLIES[prompt]


DECODER_RE = re.compile(r"decoder \S+ on 127\.0\.0\.1:(\d+)")


def save_slot(serve, name):
    """Saves the decoder's slot 0 (through the decoder's own API, not serve's) and copies
    the state file out of serve's private slot directory."""
    import http.client
    port = int(DECODER_RE.search(serve.wait_line(DECODER_RE)).group(1))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/slots/0?action=save", body=json.dumps({"filename": name}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    check(response.status == 200, "save: %s" % response.read())
    response.read()
    slot_dirs = [d for d in os.listdir(SERVE_TMP) if d.startswith("kvshare-serve-slots")]
    check(len(slot_dirs) == 1, "slot dirs %s" % slot_dirs)
    out = os.path.join(WORK, name)
    shutil.move(os.path.join(SERVE_TMP, slot_dirs[0], name), out)
    return out


def baseline(backend=None):
    serve = start("cpu", backend or TOOLS["kvshare-decoder"])
    try:
        out = {p: replies(serve, [p])[0][0] for p in PROMPTS + concurrency_prompts()}
        if backend is None:
            replies(serve, PROMPTS[:1])
            save_slot(serve, "cpu-own-prefill.state")
        return out
    finally:
        serve.stop()


def check_kv_equals_own_prefill(serve, route):
    """The strong check: after the handoff and the reply, the decoder's cache equals (within
    f16 rounding) the cache it holds after prefilling the same prompt itself."""
    replies(serve, PROMPTS[:1])
    handed = save_slot(serve, "%s-handoff.state" % route)
    result = subprocess.run([os.path.join(BIN, "kvshare-state"), "diff", handed,
                             os.path.join(WORK, "cpu-own-prefill.state"), "--tolerance", "0.01"],
                            capture_output=True, text=True, timeout=60)
    check(result.returncode == 0, "%s route: the handed-over KV differs from the decoder's own prefill:\n%s%s" %
          (route, result.stdout, result.stderr))


def concurrency_prompts():
    return ["request number %d: %s" % (i, "go " * (i % 7)) for i in range(32)]


def check_route(kv_share, line_re):
    serve = start("hybrid", TOOLS["kvshare-decoder"], kv_share=kv_share)
    try:
        for stream in (False, True):
            for prompt, (text, prompt_n) in zip(PROMPTS, replies(serve, PROMPTS, stream)):
                check(text == cpu_reply(prompt), "%s reply %r differs from --device cpu %r (stream=%s)" %
                      (("shared" if kv_share else "file"), text, cpu_reply(prompt), stream))
                check(prompt_n == 1, "prompt_n %s, expected 1 (stream=%s)" % (prompt_n, stream))
        if os.access(os.path.join(BIN, "kvshare-state"), os.X_OK):
            check_kv_equals_own_prefill(serve, "shared" if kv_share else "file")
        lines = serve.wait_count(line_re, 2 * len(PROMPTS) + 1)
        check(len(lines) == 2 * len(PROMPTS) + 1, "handoff lines:\n%s" % "\n".join(serve.lines))
        check(not [line for line in serve.lines if "hybrid: fallback" in line], "fallbacks:\n%s" % "\n".join(serve.lines))
    finally:
        code = serve.stop()
    check(code == 0, "serve exit code %d" % code)
    check(os.listdir(SERVE_TMP) == [], "left behind in TMPDIR: %s" % os.listdir(SERVE_TMP))


def test_file_route_matches_cpu():
    check_route(False, FILE_LINE)


def test_shared_route_matches_cpu():
    check_route(True, SHARED_LINE)


def test_32_concurrent_requests_through_the_shared_route():
    prompts = concurrency_prompts()
    serve = start("hybrid", TOOLS["kvshare-decoder"], kv_share=True)
    try:
        pid = serve.proc.pid
        fds_before = sorted(os.listdir("/proc/%d/fd" % pid))

        def one(i):
            status, data = serve.post("/v1/chat/completions", request(prompts[i], i % 2 == 1), timeout=300)
            return chat_reply_of(status, data, i % 2 == 1)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        for i, (text, prompt_n) in enumerate(results):
            check(text == cpu_reply(prompts[i]), "request %d: %r, --device cpu said %r" % (i, text,
                                                                                          cpu_reply(prompts[i])))
        lines = serve.wait_count(SHARED_LINE, 32)
        check(len(lines) == 32, "%d shared handoffs for 32 requests:\n%s" % (len(lines), "\n".join(serve.lines)))
        wait_until(lambda: len(os.listdir("/proc/%d/fd" % pid)) <= len(fds_before), 10,
                   "serve holds more fds than before the requests")
        check([e for e in os.listdir(SERVE_TMP) if not e.startswith("kvshare-serve-slots")] == [],
              "sockets or their directories left: %s" % os.listdir(SERVE_TMP))
        slot_dirs = [e for e in os.listdir(SERVE_TMP) if e.startswith("kvshare-serve-slots")]
        check(all(os.listdir(os.path.join(SERVE_TMP, d)) == [] for d in slot_dirs), "files left in the slot dir")
    finally:
        serve.stop()
    check(os.listdir(SERVE_TMP) == [], "left behind after stop: %s" % os.listdir(SERVE_TMP))


def test_real_llama_server_on_the_file_route():
    llama = os.environ.get("LLAMA_SERVER")
    if not llama or not os.access(llama, os.X_OK):
        print("SKIP test_real_llama_server_on_the_file_route: set LLAMA_SERVER=path of a llama-server build")
        return
    own = baseline(llama)
    serve = start("hybrid", llama, kv_share=False)
    try:
        for prompt, (text, prompt_n) in zip(PROMPTS, replies(serve, PROMPTS)):
            check(text == own[prompt], "llama-server after restore said %r, on its own %r" % (text, own[prompt]))
            check(prompt_n == 1, "llama-server evaluated %s prompt tokens after the restore" % prompt_n)
        check(len(serve.wait_count(FILE_LINE, len(PROMPTS))) == len(PROMPTS),
              "\n".join(serve.lines))
    finally:
        serve.stop()


def first_byte_ms_on_one_connection(port, count, stream):
    """Sends `count` completions over one kept connection; the time to each reply's first
    body byte, in ms."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"prompt": "Tell me about the sea.", "max_tokens": 4, "temperature": 0, "stream": stream})
    times = []
    try:
        for _ in range(count):
            start = time.monotonic()
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            check(response.status == 200, "status %d" % response.status)
            check(response.read(1) != b"", "an empty reply")
            times.append((time.monotonic() - start) * 1000)
            response.read()
            check(not response.will_close, "the server closed the kept connection")
    finally:
        conn.close()
    return times


def test_a_kept_connection_gets_each_reply_without_waiting_for_a_delayed_ack():
    # Regression: a reply is its head and then its body, two writes. With Nagle's algorithm
    # on (httplib's default), the body waited for the client's ACK of the head, which a
    # kept connection delays: every reply after the first came 40 ms late (the kernel's
    # minimum delayed-ACK time), through serve and from the decoder directly.
    serve = start("cpu", TOOLS["kvshare-decoder"])
    try:
        listening = serve.wait_line("kvshare-serve: listening on")
        found = re.search(r"decoder \S+ on 127\.0\.0\.1:(\d+)", listening)
        check(found, "no decoder port in %r" % listening)
        decoder_port = int(found.group(1))
        for name, port in (("kvshare-serve", serve.port), ("kvshare-decoder", decoder_port)):
            for stream in (False, True):
                times = first_byte_ms_on_one_connection(port, 6, stream)
                check(min(times[1:]) < 35, "%s (stream %s): every reply on a kept connection took >= 35 ms to its "
                      "first byte: %s" % (name, stream, ["%.1f" % t for t in times]))
    finally:
        serve.stop()


def test_serve_relays_the_decoders_get_endpoints():
    serve = start("hybrid", TOOLS["kvshare-decoder"])
    try:
        for path in ("/health", "/v1/models", "/props"):
            status, _, data = serve.request("GET", path)
            check(status == 200 and json.loads(data), "%s: %s %s" % (path, status, data))
    finally:
        serve.stop()


def test_sigterm_at_any_moment_of_startup_stops_serve():
    # A SIGTERM that lands while serve starts (before its signal mask, around its
    # "listening" line, before the HTTP loop runs) must still end it: killed by the signal
    # itself (-15) before the mask is set, exit 0 after. It used to be lost right before
    # the HTTP loop started, and serve ran on. A serve killed before its mask leaves its
    # slot directory: each run gets a TMPDIR of its own, not the one the routes check.
    def started(name):
        tmp = os.path.join(WORK, name)
        os.makedirs(tmp)
        return start("hybrid", TOOLS["kvshare-decoder"], extra_env={"TMPDIR": tmp}, expect_listen=False)

    for delay in (0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.4):
        serve = started("sigterm_%d" % int(delay * 1000))
        try:
            time.sleep(delay)
            code = serve.stop(signal.SIGTERM, timeout=15)
            check(code in (0, -signal.SIGTERM), "exit code %s after SIGTERM at +%ss" % (code, delay))
        finally:
            serve.kill()
    # The narrowest window: right after the "listening" line, before the HTTP loop runs.
    for attempt in range(5):
        serve = started("sigterm_listening_%d" % attempt)
        try:
            serve.wait_line(r"kvshare-serve: listening on", timeout=60)
            code = serve.stop(signal.SIGTERM, timeout=15)
            check(code == 0, "exit code %s after SIGTERM at the listening line" % code)
        finally:
            serve.kill()


def main():
    CPU_REPLIES.update(baseline())
    run_tests(globals(), WORK)


if __name__ == "__main__":
    main()
