#!/usr/bin/env python3
"""soak: 32 concurrent clients for a bounded time against two kvshare-serve --device hybrid
(one on the state-file route, one on the shared route; fake decoder and provider), with
mixed prompt lengths, streamed and whole replies, and some clients that leave after the
first chunk. Every complete reply must be the right one, and once the clients are done
each serve must hold what it held before: descriptors, threads, children, files in TMPDIR
and the slot directory equal, RSS within a small margin.

usage: soak.py BIN_DIR [--seconds N] [--clients N]
"""
import argparse
import http.client
import json
import os
import random
import socket
import sys
import threading
import time

from hybrid_common import (FAKE_DECODER, descendants, FAKE_PROVIDER, HERE, Failure, Serve, chat, check, events,
                           expected_chat_ids, expected_reply, temp_dir, wait_until)

parser = argparse.ArgumentParser()
parser.add_argument("bin_dir")
parser.add_argument("--seconds", type=float, default=20)
parser.add_argument("--clients", type=int, default=32)
ARGS = parser.parse_args()
SERVE = os.path.join(os.path.abspath(ARGS.bin_dir), "kvshare-serve")
HEADER = os.path.join(HERE, "..", "data", "layout-example.json")
WORK = temp_dir()
MODEL = os.path.join(WORK, "model.gguf")
with open(MODEL, "w") as f:
    f.write("not read by the fakes")
# What RSS may grow by over the run (allocator arenas of 64 server threads settle late).
RSS_MARGIN_KB = 16 * 1024


def is_sanitized(path):
    """ASan keeps freed memory in its quarantine: RSS says nothing about leaks there."""
    with open(path, "rb") as f:
        return b"AddressSanitizer" in f.read()


SANITIZED = is_sanitized(SERVE)


class Target:
    def __init__(self, name, shared):
        self.name = name
        self.tmp = os.path.join(WORK, name)
        os.makedirs(self.tmp)
        self.decoder_log = os.path.join(self.tmp, "..", name + "-decoder.log")
        env = {"TMPDIR": self.tmp, "FAKE_DECODER_LOG": self.decoder_log, "FAKE_DECODER_CHUNK_DELAY_MS": "3",
               "FAKE_PROVIDER_PREFILL_MS": "1.0", "ONEBIT_KV_SHARE": None}
        if shared:
            env.update({"ONEBIT_KV_SHARE": "1", "FAKE_DECODER_SHARE_HEADER": HEADER})
        self.serve = Serve(SERVE, ["-m", MODEL, "--device", "hybrid", "--handoff", "always", "--port", "0", "--backend", FAKE_DECODER,
                                   "--prefill-provider", FAKE_PROVIDER], env, timeout=60)
        start = events(self.decoder_log, "start")[0]
        self.decoder_pid = start["pid"]
        self.slot_dir = start["slot_dir"]

    def counts(self):
        pid = self.serve.proc.pid
        status = {}
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key, _, value = line.partition(":")
                status[key] = value.strip()
        return {"fds": len(os.listdir("/proc/%d/fd" % pid)), "threads": int(status["Threads"]),
                "rss_kb": int(status["VmRSS"].split()[0]),
                "children": sorted(descendants(pid) - {self.decoder_pid}),
                "tmp": sorted(set(os.listdir(self.tmp)) - {os.path.basename(self.slot_dir)}),
                "slot_dir": sorted(os.listdir(self.slot_dir))}


SETTLED_KEYS = ("fds", "threads", "children", "tmp", "slot_dir")


def quiet_counts(target, quiet_s=1.0, limit_s=15.0):
    """The counts once they have held still for quiet_s: a request's reply reaches the client
    a moment before its worker thread and sockets are gone, so a snapshot taken right after
    a reply can hold a thread and descriptors that end by themselves."""
    deadline = time.monotonic() + limit_s
    last = target.counts()
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = target.counts()
        if any(now[k] != last[k] for k in SETTLED_KEYS):
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= quiet_s:
            break
    return last


def prompt_text(rng, n):
    words = ["kv", "cache", "handoff", "npu", "decoder", "prefill", "slot", "region", "memfd", "adopt"]
    length = rng.choice([1, 3, 12, 40, 160])
    return "soak %d: %s" % (n, " ".join(rng.choice(words) for _ in range(length)))


def one_request(target, rng, n, stats):
    text = prompt_text(rng, n)
    body = chat(text)
    expected = expected_reply(expected_chat_ids(text))
    kind = rng.random()
    if kind < 0.15:
        # Leaves after the first chunk.
        body["stream"] = True
        raw = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", target.serve.port), timeout=60)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        got = b""
        while b"data: " not in got:
            piece = sock.recv(4096)
            if not piece:
                break
            got += piece
        sock.close()
        stats["left_early"] += 1
        return
    stream = kind < 0.5
    body["stream"] = stream
    conn = http.client.HTTPConnection("127.0.0.1", target.serve.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    check(response.status == 200, "%s: status %s: %s" % (target.name, response.status, data[:200]))
    if stream:
        text_out = ""
        for line in data.decode().split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                text_out += json.loads(line[6:])["choices"][0].get("delta", {}).get("content", "")
    else:
        text_out = json.loads(data)["choices"][0]["message"]["content"]
    check(text_out == expected, "%s: wrong reply %r, expected %r" % (target.name, text_out, expected))
    stats["correct"] += 1


def main():
    targets = [Target("file", shared=False), Target("shared", shared=True)]
    try:
        # Warm up (lazy allocations), then take the counts the run must come back to.
        warm = {"correct": 0, "left_early": 0}
        for target in targets:
            for n in range(3):
                one_request(target, random.Random(n), -n, warm)
        before = {t.name: quiet_counts(t) for t in targets}
        stats = {"correct": 0, "left_early": 0}
        errors = []
        lock = threading.Lock()
        deadline = time.monotonic() + ARGS.seconds

        def client(index):
            rng = random.Random(1000 + index)
            local = {"correct": 0, "left_early": 0}
            n = 0
            while time.monotonic() < deadline:
                n += 1
                try:
                    one_request(rng.choice(targets), rng, index * 100000 + n, local)
                except Exception as error:  # noqa: BLE001 - every failure is reported
                    with lock:
                        errors.append("client %d request %d: %s" % (index, n, error))
                    return
            with lock:
                for key in stats:
                    stats[key] += local[key]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(ARGS.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(ARGS.seconds + 120)
        check(not errors, "%d failures, the first: %s" % (len(errors), errors[:3]))

        def settled():
            for target in targets:
                now, then = target.counts(), before[target.name]
                if any(now[k] != then[k] for k in SETTLED_KEYS):
                    return False
            return True

        try:
            wait_until(settled, 15, "")
        except Failure:
            pass
        report = {}
        for target in targets:
            now, then = target.counts(), before[target.name]
            report[target.name] = {"before": then, "after": now}
            for key in SETTLED_KEYS:
                check(now[key] == then[key], "%s serve: %s %s before, %s after" % (target.name, key, then[key],
                                                                                   now[key]))
            check(SANITIZED or now["rss_kb"] - then["rss_kb"] <= RSS_MARGIN_KB,
                  "%s serve: RSS grew from %d to %d KiB" % (target.name, then["rss_kb"], now["rss_kb"]))
        print("soak: %d clients for %.0f s: %d correct replies, %d clients left early" %
              (ARGS.clients, ARGS.seconds, stats["correct"], stats["left_early"]))
        for name, counts in report.items():
            print("soak: %s serve: fds %d -> %d, threads %d -> %d, RSS %d -> %d KiB, children %s -> %s, "
                  "temp files %s -> %s" % (name, counts["before"]["fds"], counts["after"]["fds"],
                                           counts["before"]["threads"], counts["after"]["threads"],
                                           counts["before"]["rss_kb"], counts["after"]["rss_kb"],
                                           len(counts["before"]["children"]), len(counts["after"]["children"]),
                                           len(counts["before"]["tmp"] + counts["before"]["slot_dir"]),
                                           len(counts["after"]["tmp"] + counts["after"]["slot_dir"])))
        if SANITIZED:
            print("soak: RSS not compared: an ASan build (its quarantine holds freed memory; LeakSanitizer checks "
                  "at exit)")
        check(stats["correct"] > 0, "no request completed")
        # A clean stop: exit 0 (under ASan, LeakSanitizer runs at this exit).
        for target in targets:
            code = target.serve.stop()
            check(code == 0, "%s serve exited %s after SIGTERM" % (target.name, code))
    finally:
        for target in targets:
            target.serve.kill()
    print("PASS soak")


if __name__ == "__main__":
    try:
        main()
    except Failure as failure:
        print("FAIL soak: %s" % failure)
        sys.exit(1)
    finally:
        import shutil
        shutil.rmtree(WORK, ignore_errors=True)
