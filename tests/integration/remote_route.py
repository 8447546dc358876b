#!/usr/bin/env python3
"""remote_route: the remote route end to end, kvshare-serve --prefill-remote with a
kvshare-provider-server, the KV moved over UCX (UCX_TLS=tcp):

- the greedy reply equals --device cpu's, prompt_n is 1, the log line says "share Y ms
  remote", and the decoder's KV after the handoff equals its own prefill's (kvshare-state diff);
- a hostile peer (kvshare-remote-attack-peer) writing outside its share is refused, and
  the decoder's cells and replies are unharmed;
- every failure falls back and the reply is still right: no provider listening, a provider
  of another model (refused before any byte moves), a provider killed mid-prefill, an
  adopt without the provider's completion.

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
missing = [p for p in list(TOOLS.values()) + [ATTACK_PEER] if not os.access(p, os.X_OK)]
if missing:
    print("SKIP remote_route: %s not built" % ", ".join(missing))
    sys.exit(77)

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
REMOTE_LINE = re.compile(r"^hybrid: (\d+) prompt tokens: prefill \d+\.\d{3} ms, share \d+\.\d{3} ms remote, "
                         r"first byte \d+\.\d{3} ms$")
PROMPTS = ["Tell me about the sea.", "Write one line of code.",
           "A longer prompt, so that the handoff carries a few dozen tokens of KV: " + "words " * 20]
LONG_PROMPT = "a long prompt for the provider to be killed in: " + "many words " * 80
LISTEN_RE = re.compile(r"listening on http://[\d.]+:(\d+)")


def request(text, stream=False, max_tokens=8):
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


# The deployment's key on the serve -> provider-server hop, new every run; the provider
# takes it from its environment (never a command line, which /proc shows).
REMOTE_KEY = secrets.token_hex(16)


class Provider:
    """kvshare-provider-server (in namespace B with --netns), on a free port, keyed with REMOTE_KEY."""

    def __init__(self, model=MODEL, extra=()):
        self.proc = subprocess.Popen(PROVIDER_PREFIX + [TOOLS["kvshare-provider-server"], "-m", model, "--host",
                                                        PROVIDER_HOST, "--port", "0", "-t", "2"] + list(extra),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                     env=dict(os.environ, KVSHARE_REMOTE_KEY=REMOTE_KEY))
        line = self.proc.stderr.readline().decode()
        match = LISTEN_RE.search(line)
        if not match:
            self.stop()
            raise Failure("the provider server did not start: %r" % line)
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


def check_no_sanitizer_report(lines, who):
    """Under the ASan+UBSan build a child's report would only show on its stderr."""
    bad = [line for line in lines if "Sanitizer" in line or "runtime error:" in line]
    check(not bad, "%s reported:\n%s" % (who, "\n".join(bad[:20])))


def stop_checked(serve):
    serve.stop()
    check_no_sanitizer_report(serve.lines, "kvshare-serve or its decoder")


def start_serve(device, url=None, kv_flags=KV_FLAGS):
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", TOOLS["kvshare-decoder"]] + kv_flags
    env = dict(DECODER_ENV, TMPDIR=SERVE_TMP, ONEBIT_HYBRID_PREFILL="", ONEBIT_KV_SHARE=None)
    if url:
        args += ["--prefill-remote", url]
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=120)


def reply(serve, text, stream=False):
    status, data = serve.post("/v1/chat/completions", request(text, stream), timeout=120)
    return chat_reply_of(status, data, stream)


CPU = {}


def cpu_reply(text):
    if text not in CPU:
        serve = start_serve("cpu")
        try:
            for prompt in PROMPTS + [LONG_PROMPT]:
                CPU[prompt] = reply(serve, prompt)[0]
        finally:
            stop_checked(serve)
    return CPU[text]


def expect_fallback(url, reason, why_pattern, prompts=PROMPTS[:1]):
    serve = start_serve("hybrid", url)
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


class Decoder:
    """kvshare-decoder alone, with its remote receiver (for the attack and adopt cases)."""

    def __init__(self):
        self.slots = os.path.join(WORK, "decoder-slots")
        os.makedirs(self.slots, exist_ok=True)
        self.serve = Serve(TOOLS["kvshare-decoder"], ["-m", MODEL, "--port", "0", "--slot-save-path", self.slots]
                           + KV_FLAGS, dict(DECODER_ENV, KVSHARE_REMOTE="ucx", ONEBIT_KV_SHARE=None),
                           expect_listen=False)
        line = self.serve.wait_line(r"server is listening on http://127\.0\.0\.1:(\d+)", 60)
        self.port = int(re.search(r":(\d+)$", line).group(1))
        self.serve.wait_line("model loaded", 60)

    def share(self, n_tokens):
        status, data = decoder_post(self.port, "/slots/0?action=share", {"transport": "ucx", "n_tokens": n_tokens})
        check(status == 200, "remote share: %d %s" % (status, data))
        return json.loads(data)


def test_a_peer_writing_outside_its_share_is_refused():
    decoder = Decoder()
    try:
        before = decoder_post(decoder.port, "/v1/chat/completions", request(PROMPTS[2]))
        shared = decoder.share(8)
        offer_path = os.path.join(WORK, "offer.json")
        with open(offer_path, "w") as f:
            json.dump(shared["offer"], f)
        prefix = PROVIDER_PREFIX
        result = subprocess.run(prefix + [ATTACK_PEER, offer_path], capture_output=True, text=True, timeout=120)
        check(result.returncode == 0, "the attack peer got a write accepted:\n%s%s" % (result.stdout, result.stderr))
        check(result.stdout.count("refused:") == 5, "attack peer output:\n%s" % result.stdout)
        check_no_sanitizer_report(result.stderr.splitlines(), "the attack peer")
        decoder.serve.wait_line("remote write refused: share \\d+: remote write of \\d+ bytes .* outside cells 0..7", 10)
        # The share is spoiled: its adopt is refused, with the first refusal as the reason.
        status, data = decoder_post(decoder.port, "/slots/0?action=adopt",
                                    {"tokens": [1] * 8, "share_id": shared["share_id"]})
        check(status != 200 and b"outside cells" in data, "adopt after the attack: %d %s" % (status, data))
        # The decoder still answers exactly as before.
        after = decoder_post(decoder.port, "/v1/chat/completions", request(PROMPTS[2]))
        check(json.loads(after[1])["choices"] == json.loads(before[1])["choices"], "reply changed after the attack")
    finally:
        stop_checked(decoder.serve)


def test_adopt_without_the_providers_completion_is_refused():
    decoder = Decoder()
    try:
        shared = decoder.share(4)
        status, data = decoder_post(decoder.port, "/slots/0?action=adopt",
                                    {"tokens": [1, 2, 3, 4], "share_id": shared["share_id"]})
        check(status != 200 and b"partial transfer" in data, "adopt without completion: %d %s" % (status, data))
        decoder.serve.wait_line("adopt refused: remote share \\d+: no completion message", 10)
        status, data = decoder_post(decoder.port, "/slots/0?action=adopt",
                                    {"tokens": [1, 2, 3, 4], "share_id": shared["share_id"]})
        check(status != 200, "a second adopt of a revoked share was accepted: %s" % data)
    finally:
        stop_checked(decoder.serve)


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


def test_a_provider_killed_mid_prefill_falls_back():
    provider = Provider()
    serve = start_serve("hybrid", provider.url)
    try:
        import threading
        idle = cpu_ticks(provider.proc.pid)

        def kill_once_busy():
            # SIGKILL once the provider has burnt 50 ms of CPU on this prompt: mid-prefill,
            # with some layers' rows already sent (they go out layer by layer).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and cpu_ticks(provider.proc.pid) < idle + 5:
                time.sleep(0.002)
            provider.stop(signal.SIGKILL)

        killer = threading.Thread(target=kill_once_busy)
        killer.start()
        text, _ = reply(serve, LONG_PROMPT)
        killer.join()
        check(text == cpu_reply(LONG_PROMPT), "reply %r after the provider died differs from --device cpu %r" %
              (text, cpu_reply(LONG_PROMPT)))
        serve.wait_line(r"hybrid: fallback \(remote_provider_failed\): the remote provider .* did not answer", 30)
        # The next request, with no provider at all, is still served right.
        text, _ = reply(serve, PROMPTS[0])
        check(text == cpu_reply(PROMPTS[0]), "reply after the provider died: %r" % text)
    finally:
        stop_checked(serve)
        provider.stop()


run_tests(globals(), WORK)
