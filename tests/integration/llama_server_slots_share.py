#!/usr/bin/env python3
"""llama_server_slots_share: the patched llama-server (LLAMA_SERVER_KVSHARE=path, from
scripts/build-llama-server.sh --with-kvshare; skipped, exit 77, without it) hands over any
slot's KV stream, not only slot 0's (issue #27, many slots).

With -np 3 -c 768 and no --kv-unified the cache keeps one stream of 256 cells per slot. On
kvshare-mkmodel's qwen3, with the server started directly (ONEBIT_KV_SHARE=1) and this test
as the broker of two sockets:
- POST /slots/2?action=share, then /slots/1?action=share: each reply names its stream, each
  socket receives a share message for that stream; slot 1's share leaves slot 2's pending;
- llama-kvshare-prefill --stream 2 and --stream 1 place their context (the header's -c,
  -np and -kvu: three streams) in the fds and prefill a prompt as that sequence;
- adopt of slot 2 with slot 1's share_id is refused (400) and changes nothing; both slots
  adopt their own; a completion on each evaluates its last token only and replies as the
  server does after its own prefill of that prompt in that slot;
- the shares and adopts while slot 0 keeps generating (a share or adopt of slot s waits only
  for slot s);
- llama-kvshare-prefill --stream 3 of that three-stream share is a usage error (exit 2).
The same with llama-kvshare-prefill --serve as a resident provider (this test plays
kvshare-serve): one region, then a shared prefill per slot whose message names its stream;
a stream past the region's is refused (EINVAL) and the provider serves on.
With --kv-unified -np 2 every slot's cells are in one stream: a share of slot 1 is refused
with 501 naming the unified cache, so a caller falls back to the file route.

usage: llama_server_slots_share.py BIN_DIR
"""
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from hybrid_common import (LlamaServer, check, llama_kvshare_prefill, receive_share, run_tests, same_logprobs,
                           share_listener, temp_dir, timed, top_logprobs, wait_until)

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP llama_server_slots_share: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
PREFILL = llama_kvshare_prefill(LLAMA)
MKMODEL = os.path.join(BIN, "kvshare-mkmodel")
for needed in (PREFILL, MKMODEL):
    if not os.access(needed, os.X_OK):
        print("SKIP llama_server_slots_share: %s is not built" % needed)
        sys.exit(77)

WORK = temp_dir()
# Two prompts inside the generated vocabulary (134 tokens), of different lengths.
PROMPTS = {1: [5 + (7 * i) % 120 for i in range(40)], 2: [9 + (11 * i) % 117 for i in range(57)]}
PROMPT_0 = [3 + (5 * i) % 121 for i in range(24)]
N_PREDICT = 6
# -lv 4: llama_context's and the glue's lines are info, which the default verbosity drops.
COMMON_ARGS = ["-fa", "on", "-ctk", "f16", "-ctv", "f16", "-t", "2", "--temp", "0", "-lv", "4"]
_model = []


def model():
    if not _model:
        path = os.path.join(WORK, "qwen3.gguf")
        # --residual-gain 3: replies depend on the whole prompt, so on every cell handed over.
        subprocess.run([MKMODEL, path, "--arch", "qwen3", "--seed", "7", "--residual-gain", "3"], check=True,
                       timeout=120, capture_output=True)
        _model.append(path)
    return _model[0]


def share(server, slot, name):
    """POST /slots/{slot}?action=share to a socket of ours: (reply, message, fds)."""
    listener, path = share_listener(WORK, name)
    status, reply = server.post("/slots/%d?action=share" % slot, {"socket": path})
    if status != 200:
        listener.close()
    check(status == 200, "share of slot %d: %s %s" % (slot, status, reply))
    message, fds = receive_share(listener)
    check(reply.get("stream") == slot and reply.get("id_slot") == slot,
          "share of slot %d: the reply names stream %s, slot %s" % (slot, reply.get("stream"), reply.get("id_slot")))
    check(message["type"] == "share" and message["share_id"] == reply["share_id"],
          "share of slot %d: message %s for share %s" % (slot, {k: message.get(k) for k in ("type", "share_id")},
                                                         reply))
    check(message.get("stream", 0) == slot, "share of slot %d: the message is for stream %s" %
          (slot, message.get("stream")))
    check(len(fds) == reply["n_fds"], "share of slot %d: %d fds, n_fds %d" % (slot, len(fds), reply["n_fds"]))
    return reply, message, fds


def prefill(name, message, fds, ids, stream):
    """llama-kvshare-prefill --stream into the share's fds (closed here): the CompletedProcess."""
    try:
        layout_path = os.path.join(WORK, name + "-layout.json")
        with open(layout_path, "w") as f:
            json.dump(message["header"], f)
        ids_path = os.path.join(WORK, name + "-ids.json")
        with open(ids_path, "w") as f:
            json.dump(ids, f)
        return subprocess.run([PREFILL, "--tokens", ids_path, "--model", model(), "--layout", layout_path,
                               "--fds", ",".join(str(fd) for fd in fds), "--stream", str(stream), "-t", "2"],
                              pass_fds=fds, capture_output=True, text=True, timeout=120)
    finally:
        for fd in fds:
            os.close(fd)


def completion(server, slot, ids, cache_prompt):
    status, reply = server.post("/completion", {"prompt": ids, "n_predict": N_PREDICT, "id_slot": slot,
                                                "temperature": 0, "n_probs": 4, "cache_prompt": cache_prompt})
    check(status == 200, "completion on slot %d: %s %s" % (slot, status, reply))
    return reply


class Background:
    """Completions on slot 0, one after another, until stopped: the other slots' handoffs
    happen while slot 0 generates. Records each one's (start, end) and reply."""

    def __init__(self, server):
        self.server = server
        self.done = threading.Event()
        self.runs = []
        self.errors = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.is_set():
            start = time.monotonic()
            try:
                status, reply = self.server.post("/completion", {
                    "prompt": PROMPT_0, "n_predict": 200, "id_slot": 0, "temperature": 0, "cache_prompt": False,
                    "ignore_eos": True})
            except OSError as error:
                self.errors.append(str(error))
                return
            if status != 200:
                self.errors.append("%s %s" % (status, reply))
                return
            self.runs.append((start, time.monotonic(), reply["content"]))

    def stop(self):
        self.done.set()
        self.thread.join(120)
        check(not self.thread.is_alive(), "slot 0's completions did not end")
        check(not self.errors, "slot 0's completion failed: %s" % self.errors)
        check(self.runs, "slot 0 completed nothing")
        check(len(set(content for _, _, content in self.runs)) == 1,
              "slot 0's greedy replies differ while other slots were handed over: %s" %
              sorted(set(content for _, _, content in self.runs)))


def test_slots_1_and_2_handed_over_while_slot_0_generates():
    name = "qwen3-c768-np3"
    args = ["-m", model(), "-c", "768", "-np", "3", "-no-kvu", "--slot-save-path", WORK + "/"]
    with LlamaServer(LLAMA, args + COMMON_ARGS, log_path=os.path.join(WORK, name + ".log"),
                     env={"ONEBIT_KV_SHARE": "1"}) as server:
        wait_until(lambda: "kvshare: KV cache in exported region" in server.log_text() or
                   "share_degrade" in server.log_text(), 30,
                   "%s: the log says neither that the cache was exported nor why not:\n%s" %
                   (name, server.log_text()[-3000:]))
        degraded = [line for line in server.log_text().splitlines() if "share_degrade" in line]
        check(not degraded, "%s: the cache was not exported:\n%s" % (name, "\n".join(degraded)))

        background = Background(server)
        wait_until(lambda: background.runs or background.errors, 60, "slot 0's first completion did not end")
        spans = []
        try:
            # Slot 2 first: slot 1's share after it must leave it adoptable.
            (shared2, message2, fds2), span = timed(lambda: share(server, 2, name + "-s2"))
            spans.append(span)
            (shared1, message1, fds1), span = timed(lambda: share(server, 1, name + "-s1"))
            spans.append(span)
            check(shared1["share_id"] > shared2["share_id"], "share ids %s then %s" %
                  (shared2["share_id"], shared1["share_id"]))
            caches = [(c["kv_size"], c["n_stream"]) for c in message1["header"]["memory"]["kv_caches"]]
            check(caches == [(256, 3)], "%s: the header's caches are %s" % (name, caches))

            # A stream the share has not: a usage error, nothing written.
            bad = prefill(name + "-s3", message1, [os.dup(fd) for fd in fds1], PROMPTS[1], 3)
            check(bad.returncode == 2 and "--stream 3" in bad.stderr,
                  "llama-kvshare-prefill --stream 3 of a 3-stream share: exit %d:\n%s" % (bad.returncode, bad.stderr))

            for slot, message, fds in ((2, message2, fds2), (1, message1, fds1)):
                done = prefill("%s-s%d" % (name, slot), message, fds, PROMPTS[slot], slot)
                check(done.returncode == 0, "%s: llama-kvshare-prefill --stream %d exit %d:\n%s" %
                      (name, slot, done.returncode, done.stderr))

            # Slot 1's share_id in slot 2: made for another stream, refused before anything changes.
            (status, body), span = timed(lambda: server.post(
                "/slots/2?action=adopt", {"tokens": PROMPTS[2], "share_id": shared1["share_id"]}))
            spans.append(span)
            check(status == 400 and "stream 1" in json.dumps(body),
                  "%s: adopt of slot 1's share in slot 2: %s %s" % (name, status, body))
            for slot, shared in ((1, shared1), (2, shared2)):
                (status, adopted), span = timed(lambda: server.post(
                    "/slots/%d?action=adopt" % slot, {"tokens": PROMPTS[slot], "share_id": shared["share_id"]}))
                spans.append(span)
                check(status == 200 and adopted["n_adopted"] == len(PROMPTS[slot]),
                      "%s: adopt in slot %d: %s %s" % (name, slot, status, adopted))
            # Again, now that slot 2 holds its prompt: refused, the cells stay slot 2's.
            status, body = server.post("/slots/2?action=adopt", {"tokens": PROMPTS[2], "share_id": shared1["share_id"]})
            check(status == 400, "%s: second adopt of slot 1's share in slot 2: %s %s" % (name, status, body))
        finally:
            background.stop()
        # Generated with slot 0 idle, as the server's own prefill below: decoded beside slot 0's
        # tokens in one batch the logits differ in rounding, whatever the cache holds.
        handed = {slot: completion(server, slot, PROMPTS[slot], True) for slot in (1, 2)}
        # Slot 0 generated while the shares and adopts of slots 1 and 2 were answered.
        overlapped = [s for s in spans if any(start < s[0] and s[1] < end for start, end, _ in background.runs)]
        print("  %d of %d share/adopt calls answered inside one of slot 0's %d completions" %
              (len(overlapped), len(spans), len(background.runs)), flush=True)
        check(overlapped, "%s: no share or adopt was answered while slot 0 generated" % name)

        for slot in (1, 2):
            check(handed[slot]["timings"]["prompt_n"] == 1, "%s: after the handoff slot %d evaluated %s prompt "
                  "tokens" % (name, slot, handed[slot]["timings"]["prompt_n"]))
        for slot in (1, 2):
            status, body = server.post("/slots/%d?action=erase" % slot, {})
            check(status == 200, "%s: erase of slot %d: %s %s" % (name, slot, status, body))
            own = completion(server, slot, PROMPTS[slot], False)
            check(own["timings"]["prompt_n"] == len(PROMPTS[slot]), "%s: own prefill of %s tokens in slot %d" %
                  (name, own["timings"]["prompt_n"], slot))
            got = handed[slot]
            check(got["content"] == own["content"] and got["tokens_predicted"] == own["tokens_predicted"],
                  "%s: slot %d after the handoff %r (%d tokens), after its own prefill %r (%d tokens)" %
                  (name, slot, got["content"], got["tokens_predicted"], own["content"], own["tokens_predicted"]))
            check(same_logprobs(top_logprobs(got), top_logprobs(own)),
                  "%s: slot %d after the handoff the candidates are %s, after its own prefill %s" %
                  (name, slot, top_logprobs(got), top_logprobs(own)))
            print("  slot %d: reply %r" % (slot, own["content"]), flush=True)


class Resident:
    """llama-kvshare-prefill --model M --serve PATH, and this test as its serve: the resident
    protocol's frames (a u32 little-endian length, then the JSON; fds in SCM_RIGHTS)."""

    def __init__(self, name):
        directory = tempfile.mkdtemp(prefix="prov-", dir=WORK)
        os.chmod(directory, 0o700)
        path = os.path.join(directory, "provider.sock")
        self.log_path = os.path.join(WORK, name + ".log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([PREFILL, "--model", model(), "--serve", path, "-t", "2"],
                                         stdout=subprocess.DEVNULL, stderr=log)
        wait_until(lambda: os.path.exists(path) or self.proc.poll() is not None, 60, "no socket at " + path)
        check(self.proc.poll() is None, "the resident provider exited %s:\n%s" % (self.proc.returncode, self.log()))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(120)
        hello = self.receive()
        check(hello is not None and hello.get("op") == "hello" and hello.get("ok"), "hello %s" % hello)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def receive(self):
        def exactly(n):
            data = b""
            while len(data) < n:
                chunk = self.sock.recv(n - len(data))
                if not chunk:
                    return None
                data += chunk
            return data
        head = exactly(4)
        return None if head is None else json.loads(exactly(struct.unpack("<I", head)[0]))

    def ask(self, body, fds=()):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        frame = struct.pack("<I", len(data)) + data
        sent = socket.send_fds(self.sock, [frame], list(fds)) if fds else self.sock.send(frame)
        self.sock.sendall(frame[sent:])
        reply = self.receive()
        check(reply is not None, "the resident provider closed the channel:\n%s" % self.log())
        return reply

    def stop(self):
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def test_resident_provider_prefills_slots_1_and_2():
    name = "qwen3-c768-np3-resident"
    args = ["-m", model(), "-c", "768", "-np", "3", "-no-kvu", "--slot-save-path", WORK + "/"]
    with LlamaServer(LLAMA, args + COMMON_ARGS, log_path=os.path.join(WORK, name + ".log"),
                     env={"ONEBIT_KV_SHARE": "1"}) as server:
        resident = Resident(name + "-provider")
        try:
            shared = {}
            for slot in (2, 1):
                reply, message, fds = share(server, slot, "%s-s%d" % (name, slot))
                try:
                    if slot == 2:
                        # the region once (slot 2's share message spliced in); slot 1's share is of the same region
                        body = b'{"kvshare_provider":1,"op":"region","region_id":1,"share":%s}' % \
                            json.dumps(message).encode()
                        answer = resident.ask(body, fds)
                        check(answer.get("ok") and answer.get("op") == "region",
                              "%s: region: %s\n%s" % (name, answer, resident.log()))
                finally:
                    for fd in fds:
                        os.close(fd)
                shared[slot] = reply
            # a stream the region has not: refused, nothing written, the provider serves on
            bad = resident.ask({"kvshare_provider": 1, "op": "prefill", "route": "shared", "region_id": 1,
                                "share_id": shared[1]["share_id"], "n_cached": 0, "tokens": PROMPTS[1],
                                "stream": 3})
            check(not bad.get("ok") and "stream" in json.dumps(bad), "%s: prefill of stream 3: %s" % (name, bad))
            for slot in (2, 1):
                done = resident.ask({"kvshare_provider": 1, "op": "prefill", "route": "shared", "region_id": 1,
                                     "share_id": shared[slot]["share_id"], "n_cached": 0, "tokens": PROMPTS[slot],
                                     "stream": slot})
                check(done.get("ok") and done.get("n_prefilled") == len(PROMPTS[slot]),
                      "%s: prefill of stream %d: %s\n%s" % (name, slot, done, resident.log()))
        finally:
            resident.stop()
        for slot in (1, 2):
            status, adopted = server.post("/slots/%d?action=adopt" % slot,
                                          {"tokens": PROMPTS[slot], "share_id": shared[slot]["share_id"]})
            check(status == 200, "%s: adopt in slot %d: %s %s" % (name, slot, status, adopted))
        handed = {slot: completion(server, slot, PROMPTS[slot], True) for slot in (1, 2)}
        for slot in (1, 2):
            server.post("/slots/%d?action=erase" % slot, {})
            own = completion(server, slot, PROMPTS[slot], False)
            got = handed[slot]
            check(got["timings"]["prompt_n"] == 1 and got["content"] == own["content"] and
                  same_logprobs(top_logprobs(got), top_logprobs(own)),
                  "%s: slot %d after the resident handoff %r (prompt_n %s), after its own prefill %r" %
                  (name, slot, got["content"], got["timings"]["prompt_n"], own["content"]))


def test_unified_cache_refuses_slot_1():
    name = "qwen3-c768-np2-kvu"
    args = ["-m", model(), "-c", "768", "-np", "2", "-kvu", "--slot-save-path", WORK + "/"]
    with LlamaServer(LLAMA, args + COMMON_ARGS, log_path=os.path.join(WORK, name + ".log"),
                     env={"ONEBIT_KV_SHARE": "1"}) as server:
        listener, path = share_listener(WORK, name)
        try:
            status, body = server.post("/slots/1?action=share", {"socket": path})
        finally:
            listener.close()
        error = body.get("error", {}) if isinstance(body, dict) else {}
        check(status == 501 and error.get("type") == "not_supported_error" and "unified" in error.get("message", "") and
              "sequence 1" in error.get("message", ""),
              "%s: share of slot 1: %s %s" % (name, status, body))
        print("  %s" % error.get("message"), flush=True)


run_tests(globals(), WORK)
