#!/usr/bin/env python3
"""remote_route: the remote route end to end, kvshare-serve --prefill-remote with a
kvshare-provider-server, the KV moved over UCX (UCX_TLS=tcp) into serve's resident
kvshare-remote-receiver, which took the decoder's region by the share handshake. The
decoder is kvshare-decoder, or with REMOTE_ROUTE_DECODER=llama-server the patched
llama-server (LLAMA_SERVER_KVSHARE; exit 77 without it):

- the greedy reply equals --device cpu's, prompt_n is 1, the log line says "share Y ms
  remote", and the decoder's KV after the handoff equals its own prefill's (kvshare-state diff);
- a hostile provider (it hands its offer to kvshare-remote-attack-peer, which writes outside
  the grant) is refused, the handoff falls back and the reply is unharmed;
- every failure falls back and the reply is still right: no provider listening, a provider
  of another model (refused before any byte moves), a provider killed mid-prefill (10 times
  in a row beside two busy loops), a provider that claims success without writing, the
  receiver killed with SIGKILL or SIGSEGV mid-transfer (then serve starts another and later
  requests take the route again); the decoder and serve never go down.

usage: remote_route.py BIN_DIR TESTS_DIR [--netns]
  --netns: as root, the decoder side runs in one network namespace and the provider in
  another, joined by a veth pair (the provider "host" has its own address); not root:
  exit 77 (skipped, with a message). Exit 77 also when a tool is not built.
"""
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybrid_common import Failure, Serve, chat_reply_of, check, run_tests, temp_dir, wait_until  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
TESTS = os.path.abspath(sys.argv[2])
MODE = sys.argv[3] if len(sys.argv) > 3 else "--loopback"
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-decoder", "kvshare-provider-server",
                                                    "kvshare-mkmodel", "kvshare-state", "kvshare-prefill")}
ATTACK_PEER = os.path.join(TESTS, "kvshare-remote-attack-peer")
TOOLS["kvshare-remote-receiver"] = os.path.join(BIN, "kvshare-remote-receiver")
missing = [p for p in list(TOOLS.values()) + [ATTACK_PEER] if not os.access(p, os.X_OK)]
if missing:
    print("SKIP remote_route: %s not built" % ", ".join(missing))
    sys.exit(77)
DECODER_NAME = os.environ.get("REMOTE_ROUTE_DECODER", "kvshare-decoder")
if DECODER_NAME == "llama-server":
    DECODER = os.environ.get("LLAMA_SERVER_KVSHARE", "")
    if not DECODER or not os.access(DECODER, os.X_OK):
        print("SKIP remote_route (llama-server): set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
              "integrations/llama.cpp (scripts/build-llama-server.sh --with-kvshare; scripts/test.sh does)")
        sys.exit(77)
else:
    DECODER = TOOLS["kvshare-decoder"]
# The deployment's key for the serve -> provider-server hop, fresh per run.
REMOTE_KEY = secrets.token_hex(16)

NETNS_PREFIX = "kvsr%d" % os.getpid()


def setup_netns():
    """Two namespaces A (decoder side) and B (provider side), veth 10.88.0.1 <-> 10.88.0.2."""
    a, b = NETNS_PREFIX + "a", NETNS_PREFIX + "b"
    va, vb = NETNS_PREFIX + "va", NETNS_PREFIX + "vb"
    for cmd in (["ip", "netns", "add", a], ["ip", "netns", "add", b],
                ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
                ["ip", "link", "set", va, "netns", a], ["ip", "link", "set", vb, "netns", b],
                ["ip", "-n", a, "addr", "add", "10.88.0.1/24", "dev", va],
                ["ip", "-n", b, "addr", "add", "10.88.0.2/24", "dev", vb],
                ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"],
                ["ip", "-n", a, "link", "set", va, "up"], ["ip", "-n", b, "link", "set", vb, "up"]):
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    return a, b, va, vb


def teardown_netns():
    for ns in (NETNS_PREFIX + "a", NETNS_PREFIX + "b"):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


if MODE == "--netns":
    if os.geteuid() != 0:
        print("SKIP remote_route --netns: needs root to create network namespaces (CI runs it as root)")
        sys.exit(77)
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        print("SKIP remote_route --netns: `ip netns` does not work here (iproute2 missing or no CAP_NET_ADMIN)")
        sys.exit(77)
    try:
        ns_a, ns_b, veth_a, veth_b = setup_netns()
    except subprocess.CalledProcessError as error:
        teardown_netns()
        print("SKIP remote_route --netns: cannot create namespaces/veth here: %s" % error.stderr.decode().strip())
        sys.exit(77)
    try:
        # The driver itself runs in A (it talks HTTP to serve on A's loopback).
        code = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, os.path.abspath(__file__), BIN, TESTS,
                               "--inside", ns_b, veth_a, veth_b], timeout=900).returncode
    finally:
        teardown_netns()
    sys.exit(code)

if MODE == "--inside":
    NS_B, VETH_A, VETH_B = sys.argv[4:7]
    DECODER_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": VETH_A}
    PROVIDER_HOST = "10.88.0.2"
    PROVIDER_PREFIX = ["ip", "netns", "exec", NS_B, "env", "UCX_TLS=tcp", "UCX_NET_DEVICES=" + VETH_B]
else:
    DECODER_ENV = {"UCX_TLS": "tcp"}
    PROVIDER_HOST = "127.0.0.1"
    PROVIDER_PREFIX = ["env", "UCX_TLS=tcp"]

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
# Anywhere in a stderr line: the decoder writes to the same pipe, and under load a piece of
# its log can land in front of serve's line ("0.02.437.119 hybrid: 43 prompt tokens: ...").
REMOTE_LINE = re.compile(r"hybrid: (\d+) prompt tokens(?:, (\d+) cached)?(?:, slot \d+)?: prefill \d+\.\d{3} ms(?: of \d+ tokens)?, "
                         r"share \d+\.\d{3} ms remote(?: from (\S+) \((\d+) bytes\))?, first byte \d+\.\d{3} ms")
PROMPTS = ["Tell me about the sea.", "Write one line of code.",
           "A longer prompt, so that the handoff carries a few dozen tokens of KV: " + "words " * 20]
LONG_PROMPT = "a long prompt for the provider to be killed in: " + "many words " * 80
# A prompt the decoder's slot holds already is forwarded, never handed off (docs/hybrid.md,
# "When serve hands off"): a test that repeats a request alternates between two.
LONG_PROMPTS = [LONG_PROMPT, "another long prompt for the provider to be killed in: " + "more words " * 80]
LISTEN_RE = re.compile(r"listening on http://[\d.]+:(\d+)")


def request(text, stream=False, max_tokens=8):
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


class Provider:
    """kvshare-provider-server (in namespace B with --netns), on a free port, keyed with REMOTE_KEY."""

    def __init__(self, model=MODEL, extra=(), port=0):
        # A given port was a killed provider's: it is free again once the kernel lets go of
        # it, so a start that cannot bind it is tried again (bounded).
        deadline = time.monotonic() + 60
        while True:
            self.proc = subprocess.Popen(PROVIDER_PREFIX + [TOOLS["kvshare-provider-server"], "-m", model, "--host",
                                                            PROVIDER_HOST, "--port", str(port), "-t", "2"] + list(extra),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                         env=dict(os.environ, KVSHARE_REMOTE_KEY=REMOTE_KEY))
            line = self.proc.stderr.readline().decode()
            match = LISTEN_RE.search(line)
            if match:
                break
            self.stop()
            if port == 0 or time.monotonic() > deadline:
                raise Failure("the provider server did not start: %r" % line)
            time.sleep(0.05)  # polling for the port to be free, not a delay a test depends on
        self.port = int(match.group(1))
        self.url = "http://%s:%s" % (PROVIDER_HOST, match.group(1))

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        if sig != signal.SIGKILL and self.proc.stderr is not None:
            rest = self.proc.stderr.read().decode("utf-8", "replace")
            self.proc.stderr.close()
            self.proc.stderr = None
            check_no_sanitizer_report(rest.splitlines(), "kvshare-provider-server")


def check_no_sanitizer_report(lines, who, segv_pid=None):
    """Under the ASan+UBSan build a child's report would only show on its stderr. `segv_pid`:
    a process the test sent SIGSEGV itself, whose ASan SEGV report is expected."""
    def expected(line):
        return segv_pid is not None and ("==%d==" % segv_pid in line or line in (
            "AddressSanitizer:DEADLYSIGNAL", "AddressSanitizer can not provide additional info.")
            or line.startswith("SUMMARY: AddressSanitizer: SEGV "))
    bad = [line for line in lines if ("Sanitizer" in line or "runtime error:" in line) and not expected(line)]
    check(not bad, "%s reported:\n%s" % (who, "\n".join(bad[:20])))


def stop_checked(serve, segv_pid=None):
    serve.stop()
    check_no_sanitizer_report(serve.lines, "kvshare-serve or its decoder", segv_pid)


def start_serve(device, url=None, kv_flags=KV_FLAGS, key=REMOTE_KEY, extra=()):
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", DECODER] + kv_flags + list(extra)
    env = dict(DECODER_ENV, TMPDIR=SERVE_TMP, ONEBIT_HYBRID_PREFILL="", ONEBIT_KV_SHARE=None,
               KVSHARE_REMOTE_KEY=key)
    if url:
        # Every prompt here is short: the test is of the handoff, which auto would skip.
        for one in (url if isinstance(url, (list, tuple)) else [url]):
            args += ["--prefill-remote", one]
        args += ["--handoff", "always"]
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=120)


def reply(serve, text, stream=False):
    status, data = serve.post("/v1/chat/completions", request(text, stream), timeout=120)
    return chat_reply_of(status, data, stream)


CPU = {}


def cpu_reply(text):
    if text not in CPU:
        serve = start_serve("cpu")
        try:
            for prompt in PROMPTS + LONG_PROMPTS:
                CPU[prompt] = reply(serve, prompt)[0]
        finally:
            stop_checked(serve)
    return CPU[text]


def expect_fallback(url, reason, why_pattern, prompts=PROMPTS[:1], key=REMOTE_KEY):
    serve = start_serve("hybrid", url, key=key)
    try:
        for prompt in prompts:
            text, _ = reply(serve, prompt)
            check(text == cpu_reply(prompt), "fallback reply %r differs from --device cpu %r" % (text, cpu_reply(prompt)))
        line = serve.wait_line(r"hybrid: fallback \(%s\)" % reason, 30)
        check(re.search(why_pattern, line), "fallback line %r does not say %r" % (line, why_pattern))
        return serve.lines
    finally:
        stop_checked(serve)


def test_reply_equals_cpu_and_kv_equals_own_prefill():
    provider = Provider()
    serve = start_serve("hybrid", provider.url)
    try:
        check(serve.wait_line("route remote"), "serve does not say route remote")
        for stream in (False, True):
            for prompt in PROMPTS:
                text, prompt_n = reply(serve, prompt, stream)
                check(text == cpu_reply(prompt), "remote reply %r differs from --device cpu %r" % (text, cpu_reply(prompt)))
                check(prompt_n == 1, "prompt_n %s, expected 1 (stream=%s)" % (prompt_n, stream))
        lines = serve.wait_count(REMOTE_LINE, 2 * len(PROMPTS))
        check(len(lines) == 2 * len(PROMPTS), "remote lines:\n%s" % "\n".join(serve.lines))
        # The strong check: the decoder's cache after the handoff equals its own prefill's.
        port = decoder_port(serve)
        handed = save_slot(port, "remote-handoff.state")
        own = own_prefill_state(PROMPTS[0])
        result = subprocess.run([TOOLS["kvshare-state"], "diff", handed, own, "--tolerance", "0.01"],
                                capture_output=True, text=True, timeout=60)
        check(result.returncode == 0, "the KV moved over UCX differs from the decoder's own prefill:\n%s%s" %
              (result.stdout, result.stderr))
    finally:
        stop_checked(serve)
        provider.stop()


DECODER_RE = re.compile(r"decoder \S+ on 127\.0\.0\.1:(\d+)")


def decoder_port(serve):
    return int(DECODER_RE.search(serve.wait_line(DECODER_RE)).group(1))


def test_a_provider_command_prefills_and_its_rows_go_over_ucx():
    # The NPU engine's place, played by kvshare-prefill on the file route's contract.
    provider = Provider(extra=["--provider-command", TOOLS["kvshare-prefill"]])
    serve = start_serve("hybrid", provider.url)
    try:
        for prompt in PROMPTS:
            text, prompt_n = reply(serve, prompt)
            check(text == cpu_reply(prompt), "reply %r differs from --device cpu %r" % (text, cpu_reply(prompt)))
            check(prompt_n == 1, "prompt_n %s, expected 1" % prompt_n)
        lines = serve.wait_count(REMOTE_LINE, len(PROMPTS))
        check(len(lines) == len(PROMPTS), "remote lines:\n%s" % "\n".join(serve.lines))
    finally:
        stop_checked(serve)
        provider.stop()


def test_a_transposed_v_cache_goes_over_in_element_rows():
    # -fa off: V is element-major (v_trans), so each layer's V goes as one write per
    # element row, each checked against the grant on its own.
    flags = ["-c", "1024", "-fa", "off", "-ctk", "f16", "-ctv", "f16"]
    cpu = start_serve("cpu", kv_flags=flags)
    try:
        expected = [reply(cpu, prompt)[0] for prompt in PROMPTS]
    finally:
        stop_checked(cpu)
    provider = Provider()
    serve = start_serve("hybrid", provider.url, kv_flags=flags)
    try:
        for prompt, want in zip(PROMPTS, expected):
            text, prompt_n = reply(serve, prompt)
            check(text == want, "-fa off reply %r differs from --device cpu %r" % (text, want))
            check(prompt_n == 1, "prompt_n %s, expected 1" % prompt_n)
        check(len(serve.wait_count(REMOTE_LINE, len(PROMPTS))) == len(PROMPTS), "\n".join(serve.lines))
    finally:
        stop_checked(serve)
        provider.stop()


def decoder_post(port, path, body):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


def save_slot(port, name):
    """After a reply to PROMPTS[0] (the last request): the slot saved and moved out."""
    decoder_post(port, "/v1/chat/completions", request(PROMPTS[0]))
    status, data = decoder_post(port, "/slots/0?action=save", {"filename": name})
    check(status == 200, "save: %s" % data)
    slot_dirs = [d for d in os.listdir(SERVE_TMP) if d.startswith("kvshare-serve-slots")]
    path = [os.path.join(SERVE_TMP, d, name) for d in slot_dirs if os.path.exists(os.path.join(SERVE_TMP, d, name))]
    check(len(path) == 1, "saved %s not found in %s" % (name, slot_dirs))
    out = os.path.join(WORK, name)
    os.rename(path[0], out)
    return out


def own_prefill_state(prompt):
    serve = start_serve("cpu")
    try:
        port = decoder_port(serve)
        return save_slot(port, "own-prefill.state")
    finally:
        stop_checked(serve)


def test_serve_without_the_key_or_with_a_wrong_one_is_refused_and_nothing_lands():
    provider = Provider()
    try:
        for key in (None, "not-" + REMOTE_KEY):
            lines = expect_fallback(provider.url, "remote_provider_failed", "answered 401: Invalid API Key", key=key)
            check(not any("remote write" in line for line in lines), "a write reached the receiver:\n%s" %
                  "\n".join(lines))
            check(not any(REMOTE_KEY in line for line in lines), "the key shows on serve's stderr")
    finally:
        provider.stop()


def test_no_provider_listening_falls_back():
    expect_fallback("http://%s:9" % PROVIDER_HOST, "remote_provider_failed", "did not answer")


def test_a_provider_of_another_model_is_refused_before_any_byte_moves():
    provider = Provider(OTHER_MODEL)
    try:
        lines = expect_fallback(provider.url, "remote_provider_failed", "answered 400")
        check(not any("remote write" in line for line in lines), "a write reached the decoder:\n%s" % "\n".join(lines))
    finally:
        provider.stop()


def cpu_ticks(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def kill_once_busy(pid, kill, idle_ticks, done=None, busy_ticks=5, landed=None):
    """Calls kill() once process `pid` has burnt `busy_ticks` x 10 ms of CPU past
    `idle_ticks` (mid-prefill: the provider sends its rows layer by layer as it computes
    them), or once `done` (a threading.Event: the request ended without reaching it) is set,
    or after 60 s. Appends to `landed` (a list) whether the kill came before `done`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (done and done.is_set()):
        try:
            if cpu_ticks(pid) >= idle_ticks + busy_ticks:
                break
        except FileNotFoundError:
            return
        time.sleep(0.002)
    if landed is not None:
        landed.append(not (done and done.is_set()))
    kill()


def quiet_ticks(pid):
    """The CPU ticks of `pid` once it has stopped using CPU (two samples 50 ms apart agree;
    at most 10 s): a provider that just started may still be loading its model, and a
    sample taken then would make the next tick of that look like its prefill."""
    deadline = time.monotonic() + 10
    last = cpu_ticks(pid)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = cpu_ticks(pid)
        if now == last:
            return now
        last = now
    return last


class BusyLoops:
    """Two CPU burners beside the test (the 2-core CI machine, busy): bounded, always ended."""

    def __enter__(self):
        self.procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait(10)


def serve_children_alive(serve):
    """serve and its decoder are both still running."""
    check(serve.proc.poll() is None, "kvshare-serve exited:\n%s" % "\n".join(serve.lines[-30:]))
    port = decoder_port(serve)
    status, data = decoder_get(port, "/health")
    check(status == 200, "the decoder does not answer /health: %s %s" % (status, data))


def decoder_get(port, path):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


def test_a_provider_killed_mid_prefill_ten_times_under_load_leaves_decoder_and_serve_alive():
    import threading
    # Ten rounds on loopback; across namespaces one round shows the same (the kill is local to B).
    rounds = 1 if MODE == "--inside" else 10
    first = Provider()
    serve = start_serve("hybrid", first.url)
    landed = []
    try:
        with BusyLoops():
            provider = first
            for round_ in range(rounds):
                if provider is None:
                    provider = Provider(port=first.port)  # serve's --prefill-remote names this port
                idle = quiet_ticks(provider.proc.pid)
                # A request inside the receiver's back-off never reaches the provider: then
                # it is killed once the reply is in.
                replied = threading.Event()
                # One tick (10 ms) of CPU: a fast machine prefills this prompt in 40 ms.
                killer = threading.Thread(target=kill_once_busy, args=(
                    provider.proc.pid, lambda p=provider: p.stop(signal.SIGKILL), idle, replied, 1, landed))
                killer.start()
                prompt = LONG_PROMPTS[round_ % 2]
                expected = cpu_reply(prompt)
                try:
                    text, _ = reply(serve, prompt)
                finally:
                    replied.set()
                    killer.join()
                provider.stop()
                provider = None
                check(text == expected, "round %d: reply %r after the provider died differs from --device cpu %r" %
                      (round_, text, expected))
                serve_children_alive(serve)
            # A round whose request fell in the receiver's back-off (a kill mid-wire-up can
            # abort the receiver, below) never reached the provider, and one whose provider
            # finished first was handed off: neither is a fallback of its own. A quarter of
            # the rounds must be kills that landed, or the test tested nothing (seen: 5 to
            # 10 of 10 beside two busy loops).
            kills = sum(landed)
            check(kills >= max(1, rounds // 4), "only %d of %d kills came before the reply" % (kills, rounds))
            fallbacks = serve.wait_count(r"hybrid: fallback \(remote_", kills, timeout=30)
            check(len(fallbacks) >= kills, "expected %d remote fallbacks:\n%s" % (kills, "\n".join(serve.lines)))
        # A provider's death mid-wire-up can abort the receiver (the UCX 1.13 assertion): each
        # such death was a restart, said on stderr. With a provider that stays, the route is
        # taken again once the receiver's back-off has passed.
        deaths = [line for line in serve.lines if re.search(r"kvshare-serve: the remote receiver \(pid \d+\)", line)]
        print("remote_route: %d provider kills (%d before the reply), %d receiver deaths:\n%s" %
              (rounds, sum(landed), len(deaths), "\n".join(deaths)))
        provider = Provider(port=first.port)
        try:
            take_the_route_again(serve)
        finally:
            provider.stop()
    finally:
        stop_checked(serve)


class FakeProvider:
    """A provider server on 127.0.0.1 that does not prefill: `behave(offer)` decides what it
    does with the offer, then it answers 200 as if all went well."""

    def __init__(self, behave, status=200):
        import http.server
        import threading
        fake = self
        self.seen_keys = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen_keys.append(self.headers.get("Authorization", ""))
                behave(body["share"])
                data = json.dumps({"n_tokens": len(body["tokens"]), "prefill_ms": 1.0} if status == 200 else
                                  {"error": {"code": status, "message": "the provider server is busy: 1 prefilling, "
                                             "0 waiting (--queue 0)", "type": "unavailable_error"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_hostile_provider_writing_outside_its_grant_is_refused_and_the_reply_is_unharmed():
    attack = {}

    def run_attack_peer(offer):
        offer_path = os.path.join(WORK, "offer.json")
        with open(offer_path, "w") as f:
            json.dump(offer, f)
        attack["result"] = subprocess.run(PROVIDER_PREFIX + [ATTACK_PEER, offer_path], capture_output=True, text=True,
                                          timeout=120)

    fake = FakeProvider(run_attack_peer)
    try:
        lines = expect_fallback(fake.url, "remote_transfer_refused", "outside cells")
        result = attack["result"]
        check(result.returncode == 0, "the attack peer got a write accepted:\n%s%s" % (result.stdout, result.stderr))
        # Six attempts (docs/remote.md, tests/remote/attack_peer.cc), the last a wrong secret.
        check(result.stdout.count("refused:") == 6 and "ACCEPTED" not in result.stdout,
              "attack peer output:\n%s" % result.stdout)
        check_no_sanitizer_report(result.stderr.splitlines(), "the attack peer")
        check(any(re.search(r"kvshare-remote-receiver: remote write refused: share \d+: .*outside cells", line)
                  for line in lines), "no refusal on serve's stderr:\n%s" % "\n".join(lines))
        check(fake.seen_keys and all(key == "Bearer " + REMOTE_KEY for key in fake.seen_keys),
              "serve did not send the provider server's key: %r" % fake.seen_keys)
    finally:
        fake.stop()


def test_a_provider_that_claims_success_without_writing_is_refused_at_the_completion_check():
    fake = FakeProvider(lambda offer: None)
    try:
        expect_fallback(fake.url, "remote_transfer_refused", "no completion message from the provider: partial transfer")
    finally:
        fake.stop()


def test_a_busy_prefill_host_is_passed_over_for_the_next():
    busy = FakeProvider(lambda offer: None, status=503)
    provider = Provider()
    serve = start_serve("hybrid", [busy.url, provider.url])
    try:
        for prompt in PROMPTS[:2]:
            text, prompt_n = reply(serve, prompt)
            check(text == cpu_reply(prompt), "reply %r differs from --device cpu %r" % (text, cpu_reply(prompt)))
            check(prompt_n == 1, "prompt_n %s, expected 1" % prompt_n)
        line = serve.wait_line(r"hybrid: prefill host %s failed \(remote_provider_busy\): .*answered 503: the provider "
                               r"server is busy.*; trying %s" % (re.escape(busy.url), re.escape(provider.url)), 30)
        check(line, "no line for the busy host")
        lines = serve.wait_count(REMOTE_LINE, 2)
        check([REMOTE_LINE.search(l).group(3) for l in lines] == [provider.url] * 2, "\n".join(serve.lines[-20:]))
        status, _, data = serve.request("GET", "/metrics")
        check(re.search(r'kvshare_remote_prefills_total\{host="%s",result="busy"\} [12]\n' % re.escape(busy.url),
                        data.decode()), "the busy host is asked, then backs off: %s" % data.decode())
    finally:
        stop_checked(serve)
        provider.stop()
        busy.stop()


def take_the_route_again(serve):
    """Requests PROMPTS[0] and PROMPTS[1] by turns (the same one again would be all cached)
    until one is handed off (the receiver may be in its back-off), at most 30 times; each
    reply must equal --device cpu's, the handed-off one with prompt_n 1."""
    before = len(serve.wait_count(REMOTE_LINE, 0))
    for attempt in range(30):
        prompt = PROMPTS[attempt % 2]
        text, prompt_n = reply(serve, prompt)
        check(text == cpu_reply(prompt), "reply while the route recovers: %r" % text)
        if len(serve.wait_count(REMOTE_LINE, before + 1, timeout=5)) > before:
            check(prompt_n == 1, "prompt_n %s after the route was taken again, expected 1" % prompt_n)
            return
    raise Failure("the route was not taken again:\n%s" % "\n".join(serve.lines[-40:]))


RECEIVER_PID_RE = re.compile(r"remote receiver (?:running|started again) \(pid (\d+)")


def receiver_pid(serve, start=0):
    return int(RECEIVER_PID_RE.search(serve.wait_line(RECEIVER_PID_RE, 60, start)).group(1))


def receiver_killed_mid_transfer(sig):
    import threading
    provider = Provider()
    serve = start_serve("hybrid", provider.url)
    pid = None
    try:
        pid = receiver_pid(serve)
        # After two ticks (20 ms) of the provider's prefill, from when it was quiet: the
        # receiver holds the grant from before the prefill to after it, so that is
        # mid-transfer on any machine. Five ticks came after the last rows on a fast one
        # (the transfer complete before the receiver died, seen under load); a sample taken
        # while the provider still loaded its model fired before the request.
        idle = quiet_ticks(provider.proc.pid)
        killer = threading.Thread(target=kill_once_busy, args=(provider.proc.pid, lambda: os.kill(pid, sig), idle,
                                                               None, 2))
        killer.start()
        text, _ = reply(serve, LONG_PROMPT)
        killer.join()
        check(text == cpu_reply(LONG_PROMPT), "reply %r after the receiver died differs from --device cpu %r" %
              (text, cpu_reply(LONG_PROMPT)))
        line = serve.wait_line(r"hybrid: fallback \(remote_receiver_died\)", 30)
        # Under ASan a SIGSEGV is caught and turned into an abort (signal 6).
        signals = "(%d|%d)" % (sig, signal.SIGABRT) if sig == signal.SIGSEGV else str(int(sig))
        check(re.search(r"remote receiver \(pid %d\) .*signal %s" % (pid, signals), line),
              "the fallback does not name the receiver's end: %r" % line)
        serve_children_alive(serve)
        # serve starts another receiver; within a few requests the route is taken again.
        take_the_route_again(serve)
        check(receiver_pid(serve, 0) and any("started again" in l for l in serve.lines), "no restart said")
        status, data = serve.request("GET", "/metrics")[0::2]
        check(b"kvshare_remote_receiver_restarts_total 1" in data, "metrics: %s" % data.decode())
    finally:
        stop_checked(serve, pid if sig == signal.SIGSEGV else None)
        provider.stop()


def test_the_receiver_killed_with_sigkill_mid_transfer_is_a_fallback_and_is_restarted():
    receiver_killed_mid_transfer(signal.SIGKILL)


def test_the_receiver_killed_with_sigsegv_mid_transfer_is_a_fallback_and_is_restarted():
    receiver_killed_mid_transfer(signal.SIGSEGV)


def chat_request(messages, max_tokens=8):
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": False}


def chat_turns(serve, user_texts):
    """A conversation: each turn sends the history so far (system, then user/assistant pairs)
    and the next user text. Returns the replies."""
    messages = [{"role": "system", "content": "You are terse."}]
    replies = []
    for text in user_texts:
        messages.append({"role": "user", "content": text})
        status, data = serve.post("/v1/chat/completions", chat_request(messages), timeout=120)
        answer, prompt_n = chat_reply_of(status, data, False)
        replies.append((answer, prompt_n))
        messages.append({"role": "assistant", "content": answer})
    return replies


CHAT = ["Tell me about the sea, in a few words.", "And the mountains? " + "tall " * 12,
        "Which of the two is older? " + "rocks " * 10, "Thank you. One last line, please. " + "end " * 8]


def test_a_conversation_across_hosts_moves_only_the_suffix():
    cpu = start_serve("cpu")
    try:
        expected = chat_turns(cpu, CHAT)
    finally:
        stop_checked(cpu)
    provider = Provider()
    serve = start_serve("hybrid", provider.url)
    try:
        got = chat_turns(serve, CHAT)
        for turn, ((text, prompt_n), (want, _)) in enumerate(zip(got, expected)):
            check(text == want, "turn %d: reply %r differs from --device cpu %r" % (turn + 1, text, want))
            check(prompt_n == 1, "turn %d: prompt_n %s, expected 1" % (turn + 1, prompt_n))
        lines = serve.wait_count(REMOTE_LINE, len(CHAT))
        check(len(lines) == len(CHAT), "remote lines:\n%s" % "\n".join(serve.lines))
        parsed = [REMOTE_LINE.search(line) for line in lines]
        n_first = int(parsed[0].group(1))
        bytes_first = int(parsed[0].group(4))
        check(parsed[0].group(2) is None, "turn 1 had cached tokens: %s" % lines[0])
        # Turn 1 moved every token but the last; a token's KV is the same size in every turn.
        check(bytes_first % (n_first - 1) == 0, "turn 1: %d bytes for %d tokens" % (bytes_first, n_first - 1))
        per_token = bytes_first // (n_first - 1)
        for turn, match in enumerate(parsed[1:], start=2):
            n_prompt, n_cached, moved = int(match.group(1)), int(match.group(2) or 0), int(match.group(4))
            check(n_cached > 0, "turn %d: the slot held nothing of the conversation: %s" % (turn, match.group(0)))
            check(moved == (n_prompt - 1 - n_cached) * per_token,
                  "turn %d moved %d bytes; the suffix of %d tokens takes %d: %s" %
                  (turn, moved, n_prompt - 1 - n_cached, (n_prompt - 1 - n_cached) * per_token, match.group(0)))
        status, _, data = serve.request("GET", "/metrics")
        total = sum(int(m.group(4)) for m in parsed)
        check(("kvshare_remote_kv_bytes_total{host=\"%s\"} %d" % (provider.url, total)).encode() in data,
              "metrics do not count %d bytes: %s" % (total, data.decode()))
    finally:
        stop_checked(serve)
        provider.stop()


SLOT_PROMPTS = ["Client %d asks about %s. " % (i, topic) + "detail " * (i % 5)
                for i, topic in enumerate(["the sea", "the sky", "rivers", "trees"] * 4)]


def test_sixteen_clients_into_four_slots_across_hosts():
    if DECODER_NAME != "llama-server":
        print("SKIP the -np 4 case: kvshare-decoder serves one slot (REMOTE_ROUTE_DECODER=llama-server runs it)")
        return
    import concurrent.futures
    slots = ["-np", "4"]
    cpu = start_serve("cpu", extra=slots)
    try:
        expected = {p: reply(cpu, p)[0] for p in SLOT_PROMPTS}
    finally:
        stop_checked(cpu)
    provider = Provider(extra=["--parallel", "2"])
    serve = start_serve("hybrid", provider.url, extra=slots)
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: (p, reply(serve, p)), SLOT_PROMPTS))
        for prompt, (text, prompt_n) in results:
            check(text == expected[prompt], "reply %r to %r differs from --device cpu %r" % (text, prompt, expected[prompt]))
            check(prompt_n == 1, "prompt_n %s for %r, expected 1" % (prompt_n, prompt))
        lines = serve.wait_count(REMOTE_LINE, len(SLOT_PROMPTS))
        check(len(lines) == len(SLOT_PROMPTS), "remote lines:\n%s" % "\n".join(serve.lines))
        check(len({re.search(r"slot (\d+)", l).group(1) for l in lines}) > 1, "every request went to one slot")
    finally:
        stop_checked(serve)
        provider.stop()


def test_two_prefill_hosts_one_killed_mid_run_loses_no_reply():
    import threading
    first, second = Provider(), Provider()
    serve = start_serve("hybrid", [first.url, second.url])
    try:
        prompts = [LONG_PROMPTS[i % 2] + " turn %d" % i for i in range(8)]
        killed = threading.Event()
        results = []
        for i, prompt in enumerate(prompts):
            if i == 2:
                # Mid-run: once the first host is busy with this request's prefill.
                idle = quiet_ticks(first.proc.pid)
                killer = threading.Thread(target=kill_once_busy, args=(
                    first.proc.pid, lambda: (first.stop(signal.SIGKILL), killed.set()), idle, None, 1))
                killer.start()
            results.append((prompt, reply(serve, prompt)))
            if i == 2:
                killer.join()
        check(killed.is_set(), "the first host was not killed")
        cpu = start_serve("cpu")
        try:
            for prompt, (text, _) in results:
                want = reply(cpu, prompt)[0]
                check(text == want, "reply %r to %r differs from --device cpu %r" % (text, prompt, want))
        finally:
            stop_checked(cpu)
        failover = serve.wait_line(r"hybrid: prefill host %s failed \(remote_provider_failed\): .*; trying %s" %
                                   (re.escape(first.url), re.escape(second.url)), 30)
        check(failover, "no failover line")
        check(not any("hybrid: fallback" in l for l in serve.lines),
              "a request fell back although a host was up:\n%s" % "\n".join(serve.lines[-30:]))
        lines = serve.wait_count(REMOTE_LINE, len(prompts))
        check(len(lines) == len(prompts), "not every request was handed off:\n%s" % "\n".join(serve.lines[-30:]))
        hosts = {REMOTE_LINE.search(l).group(3) for l in lines}
        check(second.url in hosts, "the second host never prefilled: %s" % hosts)
        after = [REMOTE_LINE.search(l).group(3) for l in lines if first.url not in l]
        check(len(after) >= 5, "too few requests handed off after the kill:\n%s" % "\n".join(serve.lines[-30:]))
        status, _, data = serve.request("GET", "/metrics")
        check(('kvshare_remote_prefills_total{host="%s",result="ok"}' % second.url).encode() in data,
              "metrics: %s" % data.decode())
        serve_children_alive(serve)
    finally:
        stop_checked(serve)
        first.stop()
        second.stop()


run_tests(globals(), WORK)
