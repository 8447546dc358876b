#!/usr/bin/env python3
"""fault_matrix: one kvshare-serve --device hybrid per fault (fake decoder, fake provider),
each row asserting the four things docs/hybrid.md's fault matrix promises:

  1. the reply: equal to what `--device cpu` answers for the same request (a serve in cpu
     mode against the same fake decoder), or, where the decoder itself dies, a clean
     failure (an error status or a cut stream) and never a wrong reply;
  2. the stderr line that names the reason;
  3. the metric that counts it (/metrics);
  4. nothing left behind: serve's descriptors and memfd mappings as before the request,
     no process of a provider's group alive, no socket directory, header or state file in
     TMPDIR or the slot directory, and after serve exits nothing of it at all.

The fake decoder models stale cells (see fake_decoder.py): a completion that reuses cached
tokens after a provider wrote the shared region and nothing cleaned it up answers a wrong
reply, so a row that would let that through fails on the reply.

usage: fault_matrix.py BIN_DIR
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time

from hybrid_common import (FAKE_DECODER, descendants, FAKE_PROVIDER, HERE, Failure, Serve, chat, check, events, read_log,
                           pid_alive, run_tests, temp_dir, wait_until)

BIN = os.path.abspath(sys.argv[1])
SERVE = os.path.join(BIN, "kvshare-serve")
HEADER = os.path.join(HERE, "..", "data", "layout-example.json")
WORK = temp_dir()
MODEL = os.path.join(WORK, "model.gguf")
with open(MODEL, "w") as f:
    f.write("not read by the fakes")

_cpu = {}


def cpu_reply(body):
    """What --device cpu answers to `body` (one cpu serve for the whole run)."""
    key = json.dumps(body, sort_keys=True)
    if key not in _cpu:
        if "serve" not in _cpu:
            log_dir = os.path.join(WORK, "cpu")
            os.makedirs(log_dir, exist_ok=True)
            _cpu["serve"] = Serve(SERVE, ["-m", MODEL, "--device", "cpu", "--port", "0", "--backend", FAKE_DECODER],
                                  {"TMPDIR": log_dir}, timeout=60)
        status, data = _cpu["serve"].post("/v1/chat/completions", body)
        check(status == 200, "the cpu serve answered %s: %s" % (status, data))
        _cpu[key] = content_of(data)
    return _cpu[key]


def content_of(data):
    return json.loads(data)["choices"][0]["message"]["content"]


def stream_content(raw):
    text = ""
    for line in raw.decode("utf-8", "replace").split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            text += delta.get("content", "")
    return text


def metric(serve, name, labels):
    _, _, data = serve.request("GET", "/metrics")
    for line in data.decode().split("\n"):
        if line.startswith("%s{%s} " % (name, labels)):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Row:
    """One serve for one fault, with its own TMPDIR (the broker's sockets and the decoder's
    slot directory live there), logs and a snapshot of what serve holds when idle."""

    def __init__(self, name, shared=False, env=None, args=None):
        self.dir = os.path.join(WORK, name)
        self.tmp = os.path.join(self.dir, "tmp")
        os.makedirs(self.tmp)
        self.decoder_log = os.path.join(self.dir, "decoder.log")
        self.provider_log = os.path.join(self.dir, "provider.log")
        self.mode_file = os.path.join(self.dir, "provider.mode")
        full_env = {"TMPDIR": self.tmp, "FAKE_DECODER_LOG": self.decoder_log, "FAKE_PROVIDER_LOG": self.provider_log,
                    "FAKE_PROVIDER_MODE_FILE": self.mode_file, "ONEBIT_KV_SHARE": None}
        if shared:
            full_env.update({"ONEBIT_KV_SHARE": "1", "FAKE_DECODER_SHARE_HEADER": HEADER})
        full_env.update(env or {})
        self.serve = Serve(SERVE, ["-m", MODEL, "--device", "hybrid", "--handoff", "always", "--port", "0", "--backend", FAKE_DECODER,
                                   "--prefill-provider", FAKE_PROVIDER] + (args or []), full_env, timeout=60)
        start = events(self.decoder_log, "start")[0]
        self.decoder_pid = start["pid"]
        self.slot_dir = start["slot_dir"]
        self.baseline = self.snapshot()

    def provider_mode(self, mode):
        with open(self.mode_file, "w") as f:
            f.write(mode)

    def snapshot(self):
        pid = self.serve.proc.pid
        fds = {}
        for name in os.listdir("/proc/%d/fd" % pid):
            try:
                fds[int(name)] = os.readlink("/proc/%d/fd/%s" % (pid, name))
            except OSError:
                pass
        with open("/proc/%d/maps" % pid) as f:
            shared_maps = [line.strip() for line in f if "memfd:" in line or "dmabuf" in line or "/dev/dma" in line]
        return {"fds": fds, "maps": shared_maps, "children": sorted(descendants(pid) - {self.decoder_pid}),
                "tmp": sorted(set(os.listdir(self.tmp)) - {os.path.basename(self.slot_dir)}),
                "slot_dir": sorted(os.listdir(self.slot_dir))}

    def chat(self, text, **extra):
        body = chat(text)
        body.update(extra)
        return body

    def post(self, body, timeout=60):
        return self.serve.post("/v1/chat/completions", body, timeout)

    def assert_reply_is_cpus(self, body):
        status, data = self.post(body)
        check(status == 200, "status %s: %s" % (status, data))
        check(content_of(data) == cpu_reply(body), "reply %r, --device cpu says %r" % (content_of(data),
                                                                                        cpu_reply(body)))

    def assert_line(self, pattern):
        return self.serve.wait_line(pattern, timeout=15)

    def assert_metric(self, name, labels, at_least=1):
        value = metric(self.serve, name, labels)
        check(value >= at_least, "metric %s{%s} is %s, expected >= %s" % (name, labels, value, at_least))

    def left_behind(self):
        """What serve holds now that it did not hold idle before the first request: fds
        (number and target), shared mappings, children, files. Fewer is not a leak: a
        descriptor of serve's start (seen once under ASan: a pipe) may still have been open
        when the baseline was taken."""
        now = self.snapshot()
        extra = {}
        for key, value in now.items():
            if key == "fds":
                new = {fd: target for fd, target in value.items() if self.baseline["fds"].get(fd) != target}
            else:
                new = [item for item in value if item not in self.baseline[key]]
            if new:
                extra[key] = new
        return extra

    def assert_nothing_left(self):
        """Idle again: serve holds nothing it did not hold before the first request, and
        every provider's process group is gone."""
        try:
            wait_until(lambda: not self.left_behind(), 10, "")
        except Failure:
            raise Failure("left behind (held now, not before the first request): %s; before: %s" %
                          (self.left_behind(), self.baseline))
        self.assert_providers_gone()

    def assert_providers_gone(self):
        for record in read_log(self.provider_log):
            for key in ("pid", "grandchild_pid"):
                if key in record:
                    wait_until(lambda: not pid_alive(record[key]), 10,
                               "provider %s %d is still alive" % (key, record[key]))

    def assert_serve_gone_clean(self, code=None):
        status = self.serve.wait_exit(20)
        if code is not None:
            check(status == code, "serve exited %s, expected %s" % (status, code))
        wait_until(lambda: not pid_alive(self.decoder_pid), 10, "the decoder outlived serve")
        self.assert_providers_gone()
        wait_until(lambda: os.listdir(self.tmp) == [], 10, "left in TMPDIR: %s" % os.listdir(self.tmp)
                   if os.path.isdir(self.tmp) else "")

    def close(self):
        self.serve.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def fallback_row(name, reason, line, shared=False, env=None, args=None, mode="ok"):
    """A handoff that fails and is forwarded: the decoder prefills, the reply is the cpu reply."""
    with Row(name, shared, env, args) as row:
        row.provider_mode(mode)
        body = row.chat("fault %s: a prompt long enough to share a prefix" % name)
        row.assert_reply_is_cpus(body)
        row.assert_line(r"^hybrid: fallback \(%s\): .*%s" % (reason, line))
        row.assert_metric("kvshare_fallbacks_total", 'reason="%s"' % reason)
        row.assert_nothing_left()
        return row


def file_fallback_row(name, reason, line, env=None, mode="ok"):
    """A shared-route step that fails before the provider ran: the state-file route takes it."""
    with Row(name, True, env) as row:
        row.provider_mode(mode)
        body = row.chat("fault %s: shared first, then the state file" % name)
        row.assert_reply_is_cpus(body)
        row.assert_line(r"^hybrid: shared route not taken \(%s\): .*%s" % (reason, line))
        row.assert_line(r"^hybrid: \d+ prompt tokens: prefill [\d.]+ ms, share 0\.000 ms, restore ")
        row.assert_metric("kvshare_fallbacks_total", 'reason="%s"' % reason)
        row.assert_metric("kvshare_handoffs_total", 'route="file",outcome="ok"')
        row.assert_nothing_left()


# --- the rows (docs/hybrid.md lists them in this order) --------------------------------------

def test_01_provider_exits_non_zero():
    fallback_row("exit3", "provider_failed", r"the provider exit code 3 ", mode="fail")


def test_02_provider_exit_130_is_an_exit_code_not_a_signal():
    fallback_row("exit130", "provider_failed", r"the provider exit code 130 ", shared=True, mode="exit130")


def test_03_provider_times_out_with_its_group():
    # 3 s: the row checks the grandchild the provider logs, and a loaded machine needs over
    # a second to start that Python provider.
    fallback_row("timeout", "provider_timeout", r"timed out after \d+ ms \(killed with its process group\)",
                 args=["--provider-timeout", "3"], mode="hang")


def test_04_provider_killed_mid_write_file_route():
    fallback_row("killed_file", "provider_failed", r"the provider signal 9 ", mode="killed")


def test_05_provider_killed_mid_write_shared_route():
    with Row("killed_shared", True) as row:
        first = row.chat("killed shared: the first prompt, handed off")
        row.assert_reply_is_cpus(first)
        row.provider_mode("killed")
        second = row.chat("killed shared: the second prompt, whose provider dies writing")
        row.assert_reply_is_cpus(second)
        row.assert_line(r"^hybrid: fallback \(provider_failed\): the provider signal 9 ")
        erase = [e for e in read_log(row.decoder_log) if e["event"] == "post" and e.get("query") == {"action": "erase"}]
        check(len(erase) == 1, "the slot was not erased after the provider died mid-write")
        row.assert_metric("kvshare_fallbacks_total", 'reason="provider_failed"')
        row.assert_nothing_left()


def test_06_provider_prints_garbage():
    with Row("garbage") as row:
        row.provider_mode("garbage")
        body = row.chat("a provider that prints binary junk and no summary line")
        row.assert_reply_is_cpus(body)
        # Handed off all the same; its prefill figure is the wall time.
        row.assert_line(r"^hybrid: \d+ prompt tokens: prefill [\d.]+ ms, restore 1\.250 ms, first byte ")
        row.assert_metric("kvshare_handoffs_total", 'route="file",outcome="ok"')
        row.assert_nothing_left()


def test_07_state_file_short():
    fallback_row("short_file", "restore_failed", r"restore answered 400", mode="short")


def test_08_state_file_wrong_version():
    # An unknown version is caught in the file's header before any restore; a known one that
    # is not the decoder's (it reads 3, the provider wrote 2) names both versions.
    fallback_row("bad_version", "bad_state_file", r"version 99 is unknown", mode="badversion")
    fallback_row("other_version", "state_version_mismatch",
                 r"the provider wrote state version 2 .*the decoder restores version 3 only",
                 env={"FAKE_PROVIDER_STATE_VERSION": "2"})


def test_09_state_file_wrong_token_count():
    fallback_row("wrong_count", "restore_short", r"the slot holds \d+ tokens after the restore", mode="wrongcount")


def test_10_restore_fails():
    fallback_row("restore_fails", "restore_failed", r"restore answered 400", env={"FAKE_DECODER_RESTORE": "fail"})


def test_11_erase_fails_after_a_failed_provider():
    # The provider wrote part of the region and died; the erase that should drop the slot's
    # cached tokens fails. Forwarded as it came, the decoder would reuse the cached prefix
    # over cells the provider overwrote (the fake answers "stale cells ..." then).
    with Row("erase_fails", True, {"FAKE_DECODER_ERASE": "fail"}) as row:
        first = row.chat("erase fails: the first prompt, handed off and cached")
        row.assert_reply_is_cpus(first)
        row.provider_mode("killed")
        second = row.chat("erase fails: the second prompt shares the template prefix")
        row.assert_reply_is_cpus(second)
        row.assert_line(r"^hybrid: POST /slots/0\?action=erase failed \(500: erase failed on demand\); the request "
                        r"goes to slot 0 with cache_prompt false")
        row.assert_line(r"^hybrid: fallback \(provider_failed\): .*forwarding the request to slot 0 with "
                        r"cache_prompt false")
        forwarded = events(row.decoder_log, "completion")[-1]
        check(forwarded["body"].get("cache_prompt") is False and forwarded["body"].get("id_slot") == 0,
              "forwarded %s" % forwarded["body"])
        check(not forwarded["used_stale_cells"], "the decoder reused stale cells")
        row.assert_metric("kvshare_fallbacks_total", 'reason="erase_failed"')
        row.assert_metric("kvshare_fallbacks_total", 'reason="provider_failed"')
        # The next request is handed off normally and reuses the recomputed cells.
        row.provider_mode("ok")
        row.assert_reply_is_cpus(row.chat("erase fails: a third prompt after the recompute"))
        row.assert_nothing_left()


def test_12_share_refused_501():
    file_fallback_row("share_501", "share_refused", r"the decoder refused to share \(501: ",
                      env={"FAKE_DECODER_REFUSE_SHARE": "1"})


def test_13_socket_never_connects():
    file_fallback_row("no_connect", "handshake_failed", r"receiving the decoder's fds failed",
                      env={"FAKE_DECODER_SHARE": "noconnect"})


def test_14_fd_count_mismatch():
    file_fallback_row("fewer_fds", "handshake_failed", r"receiving the decoder's fds failed",
                      env={"FAKE_DECODER_SHARE": "fewer_fds"})


def test_15_adopt_refused():
    with Row("adopt_refused", True, {"FAKE_DECODER_ADOPT": "fail"}) as row:
        body = row.chat("adopt refused: forwarded after the erase")
        row.assert_reply_is_cpus(body)
        row.assert_line(r"^hybrid: fallback \(adopt_failed\): POST /slots/0\?action=adopt answered 400")
        row.assert_metric("kvshare_fallbacks_total", 'reason="adopt_failed"')
        row.assert_nothing_left()


def test_16_decoder_busy_no_restore_under_a_decode():
    # A reply streams slowly; the next request's provider finishes while it still decodes.
    # The restore must not be sent under that decode: serve waits at most the provider
    # timeout, then forwards as it came.
    # The stream (6 chunks, >= 9 s) outlasts the provider plus the 3 s wait, even on a loaded
    # machine where a Python provider takes a second to start.
    env = {"FAKE_DECODER_CHUNK_DELAY_MS": "1500"}
    with Row("decoder_busy", env=env, args=["--provider-timeout", "3"]) as row:
        slow = row.chat("decoder busy: a slow streamed reply", stream=True)
        results = {}

        def stream_slow():
            conn = http.client.HTTPConnection("127.0.0.1", row.serve.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(slow),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            results["slow"] = (response.status, response.read())
            conn.close()

        thread = threading.Thread(target=stream_slow)
        thread.start()
        wait_until(lambda: events(row.decoder_log, "completion"), 15, "the slow request never reached the decoder")
        body = row.chat("decoder busy: the next prompt")
        row.assert_reply_is_cpus(body)
        thread.join(60)
        check(results["slow"][0] == 200, "slow request %s" % (results["slow"],))
        check(stream_content(results["slow"][1]) == cpu_reply(row.chat("decoder busy: a slow streamed reply")),
              "the slow reply")
        busy = [e for e in events(row.decoder_log, "restore_requested") if e["slot_busy"]]
        check(not busy, "a restore was sent while a decode ran: %s" % busy)
        row.assert_line(r"^hybrid: fallback \(decoder_busy\): the decoder was still generating")
        row.assert_metric("kvshare_fallbacks_total", 'reason="decoder_busy"')
        row.assert_nothing_left()


def test_17_decoder_dies_mid_request():
    with Row("decoder_dies", env={"FAKE_DECODER_DIE": "completion"}) as row:
        body = row.chat("the decoder dies while it streams this", stream=True)
        conn = http.client.HTTPConnection("127.0.0.1", row.serve.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        try:
            raw = response.read()
        except http.client.IncompleteRead as cut:
            raw = cut.partial
        conn.close()
        # A cut stream or an error, never a complete wrong reply.
        check(b"data: [DONE]" not in raw, "a complete reply from a decoder that died: %r" % raw)
        row.assert_line(r"kvshare-serve: the decoder exited \(exit code 9\)")
        row.assert_serve_gone_clean(1)


def test_18_decoder_dies_mid_adopt():
    with Row("dies_in_adopt", True, {"FAKE_DECODER_DIE": "adopt"}) as row:
        status, data = row.post(row.chat("the decoder dies in the adopt"))
        check(status != 200, "a reply from a decoder that died: %s %s" % (status, data))
        row.assert_line(r"^hybrid: fallback \(adopt_failed\): ")
        row.assert_line(r"kvshare-serve: the decoder exited \(exit code 9\)")
        row.assert_serve_gone_clean(1)


def test_19_client_disconnects_mid_stream():
    with Row("client_leaves", env={"FAKE_DECODER_CHUNK_DELAY_MS": "200"}) as row:
        body = row.chat("a client that leaves after the first chunk", stream=True)
        raw = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", row.serve.port), timeout=30)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        got = b""
        while b"data: " not in got:
            piece = sock.recv(4096)
            check(piece, "no first chunk")
            got += piece
        sock.close()
        # serve lets the decoder's stream go, counts the cut, and is idle again; the next
        # request is correct.
        wait_until(lambda: metric(row.serve, "kvshare_replies_cut_total", 'by="client"') == 1, 10,
                   "kvshare_replies_cut_total{by=\"client\"} is not 1")
        row.assert_nothing_left()
        row.assert_reply_is_cpus(row.chat("after the client left"))
        row.assert_nothing_left()


def test_20_sigterm_with_requests_in_flight():
    env = {"FAKE_DECODER_CHUNK_DELAY_MS": "150"}
    with Row("sigterm", env=env, args=["--provider-timeout", "5"]) as row:
        row.provider_mode("slow")
        results = []

        def client(n):
            body = row.chat("in flight %d at SIGTERM" % n, stream=True)
            try:
                conn = http.client.HTTPConnection("127.0.0.1", row.serve.port, timeout=30)
                conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                try:
                    raw = response.read()
                except http.client.IncompleteRead as cut:
                    raw = cut.partial
                results.append((body, response.status, raw))
            except (OSError, http.client.HTTPException) as error:
                results.append((body, None, str(error).encode()))

        threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: read_log(row.provider_log) or events(row.decoder_log, "completion"), 15, "nothing started")
        row.serve.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(40)
        check(len(results) == 4, "%d of 4 clients came back" % len(results))
        for body, status, raw in results:
            if status == 200 and b"data: [DONE]" in raw:
                check(stream_content(raw) == cpu_reply(dict(body, stream=False)), "a wrong reply at SIGTERM")
        row.assert_line(r"kvshare-serve: SIGTERM received, stopping")
        row.assert_serve_gone_clean(0)


def test_21_file_route_provider_inherits_no_client_socket():
    with Row("no_inherited_sockets") as row:
        # Other clients hold connections open (a request half sent) while a provider runs.
        idle = [socket.create_connection(("127.0.0.1", row.serve.port), timeout=30) for _ in range(3)]
        for sock in idle:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        # Only sockets serve holds can leak into the provider: wait for serve to have accepted
        # all three (three sockets more than at idle), not for a time.
        def sockets(snapshot):
            return sum(1 for target in snapshot["fds"].values() if target.startswith("socket:"))
        wait_until(lambda: sockets(row.snapshot()) >= sockets(row.baseline) + 3, 60,
                   "serve never accepted the three idle connections")
        row.assert_reply_is_cpus(row.chat("a provider must see only 0, 1 and 2"))
        for sock in idle:
            sock.close()
        provider = read_log(row.provider_log)[-1]
        check(sorted(int(k) for k in provider["fds_at_start"]) == [0, 1, 2],
              "the file-route provider inherited %s" % provider["fds_at_start"])
        check(metric(row.serve, "kvshare_handoffs_total", 'route="file",outcome="ok"') == 1,
              "the handoff beside the open connections is not counted ok")
        check(metric(row.serve, "kvshare_replies_cut_total", 'by="client"') == 0, "a reply counted cut")
        row.assert_nothing_left()


if __name__ == "__main__":
    try:
        run_tests(globals(), WORK)
    finally:
        if "serve" in _cpu:
            _cpu["serve"].kill()
