#!/usr/bin/env python3
"""resident_provider: kvshare-serve --device hybrid with a resident provider (issue 24), the
patched llama-server as the decoder (LLAMA_SERVER_KVSHARE=path; skipped, exit 77, without
it), both providers: kvshare-prefill (the CPU reference) and llama-kvshare-prefill (beside
the server, or LLAMA_KVSHARE_PREFILL=path), each started once by serve with
--provider-resident, and kvshare-prefill --serve PATH reached with --prefill-provider-socket.

- both routes (ONEBIT_KV_SHARE=1: shared; unset: the file route): every greedy reply equals
  --device cpu's on the same server, streamed and not; timings.prompt_n is 1; serve's line
  names the route, its phases line follows; one provider process serves every request (its
  pid in serve's start line, no restart), and on the shared route the region went to it once;
- a resident provider killed with SIGKILL between requests: the next requests' replies are
  still --device cpu's (a fallback or the restarted provider), serve starts another,
  /metrics counts the restart, and the handoffs come back;
- (a provider that dies during a prefill, hangs or breaks the protocol: the unit tests of
  tests/route/resident_provider_test.cc, against a fake that does so on demand);
- SIGTERM to serve ends the resident provider with it; nothing is left behind.

usage: resident_provider.py BIN_DIR
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

from hybrid_common import (SHARED_LINE, Serve, chat_reply_of, check, llama_kvshare_prefill, pid_alive, run_tests,
                           temp_dir, wait_until)

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP resident_provider: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
LLAMA_PREFILL = llama_kvshare_prefill(LLAMA)
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-prefill", "kvshare-mkmodel")}

WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7", "--residual-gain", "3"], check=True, timeout=120,
               capture_output=True)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
KV_FLAGS = ["-c", "1024", "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
PROMPTS = ["Tell me about the sea.", "Write one line of code.",
           "A longer prompt, so that the handoff carries a few dozen tokens of KV: " + "words " * 20]
FILE_LINE = re.compile(r"hybrid: (\d+) prompt tokens: prefill \d+\.\d{3} ms, restore \d+\.\d{3} ms, "
                       r"first byte \d+\.\d{3} ms$")
PHASES_LINE = re.compile(r"phases: tokenize [\d.]+ ms, share [\d.]+ ms, provider [\d.]+ ms \(region [\d.]+ ms\), "
                         r"(adopt|restore) [\d.]+ ms, first token -?[\d.]+ ms$")
RESIDENT_RE = re.compile(r"kvshare-serve: resident provider running \(pid (\d+)")
CPU_REPLIES = {}


def request(text, stream=False):
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            "max_tokens": 8, "temperature": 0, "stream": stream}


def start(device, kv_share=False, provider=None, resident_args=None):
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", LLAMA] + KV_FLAGS
    env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": "1" if kv_share else None}
    if device == "hybrid":
        if provider:
            args += ["--prefill-provider", provider]
        # Every prompt here is short: the test is of the handoff, which auto would skip.
        args += (resident_args or ["--provider-resident"]) + ["--handoff", "always"]
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=180)


def reply(serve, text, stream=False):
    return chat_reply_of(*serve.post("/v1/chat/completions", request(text, stream), timeout=180), stream)


def cpu_reply(text):
    if not CPU_REPLIES:
        serve = start("cpu")
        try:
            for prompt in PROMPTS:
                CPU_REPLIES[prompt] = reply(serve, prompt)[0]
        finally:
            serve.stop()
    return CPU_REPLIES[text]


def resident_pid(serve):
    return int(RESIDENT_RE.search(serve.wait_line(RESIDENT_RE, timeout=120)).group(1))


def metric(serve, name):
    status, _, data = serve.request("GET", "/metrics")
    check(status == 200, "/metrics %d" % status)
    found = re.search(r"^%s (\d+)$" % re.escape(name), data.decode(), re.M)
    return int(found.group(1)) if found else None


def slot_files():
    out = []
    for d in os.listdir(SERVE_TMP):
        if d.startswith("kvshare-serve-slots"):
            out += os.listdir(os.path.join(SERVE_TMP, d))
    return out


def serves_every_prompt(provider, kv_share, resident_args=None):
    serve = start("hybrid", kv_share, provider, resident_args)
    try:
        pid = resident_pid(serve)
        line_re = SHARED_LINE if kv_share else FILE_LINE
        n = 0
        for stream in (False, True):
            for prompt in PROMPTS:
                text, prompt_n = reply(serve, prompt, stream)
                n += 1
                check(text == cpu_reply(prompt), "resident %s reply %r differs from --device cpu %r (stream=%s)" %
                      (provider, text, cpu_reply(prompt), stream))
                check(prompt_n == 1, "prompt_n %s after the handoff, expected 1" % prompt_n)
        check(len(serve.wait_count(line_re, n, timeout=10)) == n, "not every request was handed off:\n%s" %
              "\n".join(serve.lines))
        check(len(serve.wait_count(PHASES_LINE, n, timeout=10)) == n, "phases lines:\n%s" % "\n".join(serve.lines))
        check(not [line for line in serve.lines if "fallback" in line or "not taken" in line],
              "\n".join(serve.lines))
        check(pid_alive(pid), "the resident provider (pid %d) is gone" % pid)
        check(metric(serve, "kvshare_provider_restarts_total") == 0, "restarts counted")
        check(not [line for line in serve.lines if "started again" in line], "\n".join(serve.lines))
        return serve, pid
    except Exception:
        serve.stop()
        raise


def finish(serve, pid):
    code = serve.stop()
    check(code == 0, "serve exited %s" % code)
    wait_until(lambda: not pid_alive(pid), 15, "the resident provider (pid %d) outlived serve" % pid)
    check(not slot_files(), "left in the slot directory: %s" % slot_files())


def test_cpu_reference_resident_shared():
    serve, pid = serves_every_prompt(TOOLS["kvshare-prefill"], kv_share=True)
    finish(serve, pid)


def test_cpu_reference_resident_file():
    serve, pid = serves_every_prompt(TOOLS["kvshare-prefill"], kv_share=False)
    finish(serve, pid)


def test_llama_resident_shared():
    serve, pid = serves_every_prompt(LLAMA_PREFILL, kv_share=True)
    finish(serve, pid)


def test_llama_resident_file():
    serve, pid = serves_every_prompt(LLAMA_PREFILL, kv_share=False)
    finish(serve, pid)


def test_provider_socket_reached_by_serve():
    """kvshare-prefill --serve PATH, started on its own; serve reaches it; it outlives serve."""
    private = os.path.join(WORK, "provider-dir")
    os.makedirs(private, mode=0o700, exist_ok=True)
    socket_path = os.path.join(private, "provider.sock")
    provider = subprocess.Popen([TOOLS["kvshare-prefill"], "--model", MODEL, "--serve", socket_path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    # Drained as it comes: a provider that writes a line per request must never block on us.
    err_lines = []
    threading.Thread(target=lambda: err_lines.extend(provider.stderr), daemon=True).start()
    try:
        wait_until(lambda: os.path.exists(socket_path) or provider.poll() is not None, 60, "no provider socket")
        if provider.poll() is not None:
            check(False, "kvshare-prefill --serve exited: %s" % b"".join(err_lines).decode())
        serve, pid = serves_every_prompt(None, kv_share=True, resident_args=["--prefill-provider-socket", socket_path])
        check(pid == provider.pid, "serve reached pid %d, the provider is %d" % (pid, provider.pid))
        check(serve.stop() == 0, "serve exit")
        check(provider.poll() is None, "the provider ended with serve; it belongs to its own supervisor")
    finally:
        provider.kill()
        provider.wait(timeout=15)


def test_killed_between_requests_is_restarted():
    serve = start("hybrid", True, TOOLS["kvshare-prefill"])
    try:
        pid = resident_pid(serve)
        check(reply(serve, PROMPTS[0])[0] == cpu_reply(PROMPTS[0]), "first reply")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 15, "the provider did not die")
        # Within the back-off a request falls back (the decoder prefills it); every reply
        # stays right, and once the provider is started again the handoffs come back.
        # The prompts take turns: one the slot holds whole would be forwarded by decision.
        deadline = time.monotonic() + 120
        turn = 0
        while True:
            check(time.monotonic() < deadline, "no handoff after the restart:\n%s" % "\n".join(serve.lines))
            before = len(serve.wait_count(SHARED_LINE, 0, timeout=0))
            turn += 1
            prompt = PROMPTS[turn % len(PROMPTS)]
            text, _ = reply(serve, prompt)
            check(text == cpu_reply(prompt), "after the kill: %r, --device cpu %r" % (text, cpu_reply(prompt)))
            if serve.wait_count(r"started again \(pid \d+, restart 1\)", 1, timeout=0) and \
                    len(serve.wait_count(SHARED_LINE, before + 1, timeout=5)) > before:
                break
        serve.wait_line(r"resident provider \(pid %d\) exited between requests: signal 9" % pid, 5)
        check(metric(serve, "kvshare_provider_restarts_total") == 1, "restarts:\n%s" % "\n".join(serve.lines))
        new_pid = int(re.search(r"started again \(pid (\d+)", serve.wait_line(r"started again", 5)).group(1))
        check(new_pid != pid and pid_alive(new_pid), "the new provider runs")
        finish(serve, new_pid)
    except Exception:
        serve.stop()
        raise


run_tests(globals(), WORK)
