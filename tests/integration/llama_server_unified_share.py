#!/usr/bin/env python3
"""llama_server_unified_share: the patched llama-server (LLAMA_SERVER_KVSHARE=path, from
scripts/build-llama-server.sh --with-kvshare; skipped, exit 77, without it) hands over slots
of a unified KV cache (--kv-unified, llama-server's -np auto: every slot's cells in one
stream, wherever llama.cpp put them; issue #27, many slots).

With -c 1536 -np 3 -kvu on kvshare-mkmodel's qwen3, the server started directly
(ONEBIT_KV_SHARE=1) and this test as the broker:
- while slot 0 streams a long reply, POST /slots/{1,2}?action=share with the prompt's ids,
  both before either adopt: the reply and the share message name a run of cells
  (first_cell, n_cells = the ids), inside the cache and disjoint from each other, so both
  shares stay adoptable; llama-kvshare-prefill --first-cell C
  --cells N prefills each prompt into its run; the slot adopts it; afterwards a completion
  on each slot evaluates one token and replies (text, top logprobs within 1e-3) as the
  server does after its own prefill of that prompt in that slot, and slot 0's streamed
  replies are those of a run without the handoffs;
- with the server idle, llama-kvshare-prefill writes the region's bytes of cells C..C+n-1
  of every K and V tensor only: every other byte of the region is unchanged;
- an adopt after ?action=erase of the slot is refused (400) and the slot then prefills by
  itself; llama-kvshare-prefill with more ids than --cells is a usage error (exit 2);
- a share with more ids than any run of free cells is refused (503, naming the file route)
  and the slot keeps its cached prompt (the next completion evaluates one token);
- a share without ids is refused (501: a unified cache reserves cells for the ids).
- without the RAM prompt cache (--cache-ram 0), so a slot's cells stay in position order:
  slot 1 handed over into cells after slot 0's replies exactly (logprobs within 1e-3) as
  the server's own prefill into the same cells.
The server runs with llama-server's default RAM prompt cache otherwise: it saves idle slots
at each task start and, with a unified cache, clears them (an adopted slot's reserved cells
excepted).

usage: llama_server_unified_share.py BIN_DIR
"""
import http.client
import json
import mmap
import os
import subprocess
import sys
import threading
import time

from hybrid_common import (LlamaServer, check, llama_kvshare_prefill, receive_share, run_tests, same_logprobs,
                           share_listener, temp_dir, timed, top_logprobs, wait_until)

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP llama_server_unified_share: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
PREFILL = llama_kvshare_prefill(LLAMA)
MKMODEL = os.path.join(BIN, "kvshare-mkmodel")
for needed in (PREFILL, MKMODEL):
    if not os.access(needed, os.X_OK):
        print("SKIP llama_server_unified_share: %s is not built" % needed)
        sys.exit(77)

WORK = temp_dir()
N_CTX = 1536
# Prompts inside the generated vocabulary (134 tokens), of different lengths.
PROMPTS = {1: [5 + (7 * i) % 120 for i in range(40)], 2: [9 + (11 * i) % 117 for i in range(57)]}
PROMPT_0 = [3 + (5 * i) % 121 for i in range(24)]
N_PREDICT = 6
N_PREDICT_0 = 300
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


def start_server(name, extra=()):
    args = ["-m", model(), "-c", str(N_CTX), "-np", "3", "-kvu", "--slot-save-path", WORK + "/"] + list(extra)
    server = LlamaServer(LLAMA, args + COMMON_ARGS, log_path=os.path.join(WORK, name + ".log"),
                         env={"ONEBIT_KV_SHARE": "1"})
    try:
        wait_until(lambda: "kvshare: KV cache in exported region" in server.log_text() or
                   "share_degrade" in server.log_text(), 30,
                   "%s: the log says neither that the cache was exported nor why not:\n%s" %
                   (name, server.log_text()[-3000:]))
        degraded = [line for line in server.log_text().splitlines() if "share_degrade" in line]
        check(not degraded, "%s: the cache was not exported:\n%s" % (name, "\n".join(degraded)))
    except Exception:
        server.stop()
        raise
    return server


def share(server, slot, ids, name):
    """POST /slots/{slot}?action=share with the ids to a socket of ours: (reply, message, fds)."""
    listener, path = share_listener(WORK, name)
    status, reply = server.post("/slots/%d?action=share" % slot, {"socket": path, "tokens": ids})
    if status != 200:
        listener.close()
    check(status == 200, "share of slot %d: %s %s" % (slot, status, reply))
    message, fds = receive_share(listener)
    check(reply.get("stream") == 0 and reply.get("id_slot") == slot and reply.get("n_cached") == 0,
          "share of slot %d: the reply names stream %s, slot %s, n_cached %s" %
          (slot, reply.get("stream"), reply.get("id_slot"), reply.get("n_cached")))
    check(reply.get("n_cells") == len(ids) and isinstance(reply.get("first_cell"), int),
          "share of slot %d with %d ids: the reply names cells %s, n_cells %s" %
          (slot, len(ids), reply.get("first_cell"), reply.get("n_cells")))
    check(message["type"] == "share" and message["share_id"] == reply["share_id"] and
          message.get("stream", 0) == 0 and message.get("first_cell", 0) == reply["first_cell"] and
          message.get("n_cells") == reply["n_cells"],
          "share of slot %d: message %s for share %s" %
          (slot, {k: message.get(k) for k in ("type", "share_id", "stream", "first_cell", "n_cells")}, reply))
    kv_size = message["header"]["memory"]["kv_caches"][0]["kv_size"]
    check(reply["first_cell"] + reply["n_cells"] <= kv_size,
          "share of slot %d: cells %d..%d past the cache's %d" %
          (slot, reply["first_cell"], reply["first_cell"] + reply["n_cells"] - 1, kv_size))
    check(len(fds) == reply["n_fds"], "share of slot %d: %d fds, n_fds %d" % (slot, len(fds), reply["n_fds"]))
    return reply, message, fds


def prefill(name, message, fds, ids, first_cell, n_cells, close=True):
    """llama-kvshare-prefill --first-cell --cells into the share's fds: the CompletedProcess."""
    try:
        layout_path = os.path.join(WORK, name + "-layout.json")
        with open(layout_path, "w") as f:
            json.dump(message["header"], f)
        ids_path = os.path.join(WORK, name + "-ids.json")
        with open(ids_path, "w") as f:
            json.dump(ids, f)
        return subprocess.run([PREFILL, "--tokens", ids_path, "--model", model(), "--layout", layout_path,
                               "--fds", ",".join(str(fd) for fd in fds), "--first-cell", str(first_cell),
                               "--cells", str(n_cells), "-t", "2"],
                              pass_fds=fds, capture_output=True, text=True, timeout=120)
    finally:
        if close:
            for fd in fds:
                os.close(fd)


def completion(server, slot, ids, cache_prompt):
    status, reply = server.post("/completion", {"prompt": ids, "n_predict": N_PREDICT, "id_slot": slot,
                                                "temperature": 0, "n_probs": 4, "cache_prompt": cache_prompt})
    check(status == 200, "completion on slot %d: %s %s" % (slot, status, reply))
    return reply


def streamed_completion(server, slot, ids, n_predict):
    """A streamed completion (SSE) on `slot`: the concatenated content."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/completion", body=json.dumps({
        "prompt": ids, "n_predict": n_predict, "id_slot": slot, "temperature": 0, "cache_prompt": False,
        "ignore_eos": True, "stream": True}), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise OSError("status %d: %s" % (response.status, response.read()[:500]))
    content = []
    n_tokens = 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        content.append(event.get("content", ""))
        n_tokens += 1
        if event.get("stop"):
            break
    conn.close()
    return "".join(content)


class Background:
    """Streamed completions on slot 0, one after another, until stopped: the other slots'
    handoffs happen while slot 0 generates. Records each one's (start, end, content)."""

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
                content = streamed_completion(self.server, 0, PROMPT_0, N_PREDICT_0)
            except (OSError, ValueError) as error:
                self.errors.append(str(error))
                return
            self.runs.append((start, time.monotonic(), content))

    def stop(self, reference):
        self.done.set()
        self.thread.join(180)
        check(not self.thread.is_alive(), "slot 0's completions did not end")
        check(not self.errors, "slot 0's completion failed: %s" % self.errors)
        check(self.runs, "slot 0 completed nothing")
        differ = [content for _, _, content in self.runs if content != reference]
        check(not differ, "slot 0's streamed replies while slots 1 and 2 were handed over differ from the run "
              "without handoffs (%d of %d): %r vs %r" % (len(differ), len(self.runs), differ[:1], reference))


def save_slot(server, name, slot, what):
    """POST /slots/{slot}?action=save: the state file's path."""
    filename = "%s-s%d-%s.bin" % (name, slot, what)
    status, body = server.post("/slots/%d?action=save" % slot, {"filename": filename})
    check(status == 200, "%s: save of slot %d: %s %s" % (name, slot, status, body))
    return os.path.join(WORK, filename)


# llama.cpp's own unified cache gives a token's logprobs ~1e-3 relative apart when the same
# K and V bytes sit in another order of cells: flash attention accumulates V in f16 cell by
# cell. With the RAM prompt cache, a task purges the idle slots' cells and the cache's head
# drops to cell 0, so the re-evaluated last prompt token lands before the handed-over run
# (measured: top-2 logprob -16.458 against -16.474 in order; the server alone, without a
# handoff, gives -16.458 too when that token lands below its prompt). The bytes are compared
# exactly; logprobs exactly where the cells are in the same order (test_in_order_cells_...).
ORDER_TOLERANCE = 0.05


def check_against_own_prefill(server, name, handed, handed_states, tolerance):
    """Each handed-over slot against the server's own prefill of its prompt in that slot: the
    K and V bytes of its cells (saved right after the adopt) are the own prefill's exactly, and
    its reply is the own prefill's (text; top logprobs within `tolerance`)."""
    for slot in sorted(handed):
        check(handed[slot]["timings"]["prompt_n"] == 1, "%s: after the handoff slot %d evaluated %s prompt tokens" %
              (name, slot, handed[slot]["timings"]["prompt_n"]))
    for slot in sorted(handed):
        status, body = server.post("/slots/%d?action=erase" % slot, {})
        check(status == 200, "%s: erase of slot %d: %s %s" % (name, slot, status, body))
        # n_predict 1: the prompt's cells only, as right after the adopt.
        status, body = server.post("/completion", {"prompt": PROMPTS[slot], "n_predict": 1, "id_slot": slot,
                                                   "temperature": 0, "cache_prompt": True})
        check(status == 200 and body["timings"]["prompt_n"] == len(PROMPTS[slot]),
              "%s: own prefill in slot %d: %s %s" % (name, slot, status, body))
        own_state = save_slot(server, name, slot, "own")
        diff = subprocess.run([os.path.join(BIN, "kvshare-state"), "diff", handed_states[slot], own_state],
                              capture_output=True, text=True, timeout=300)
        check(diff.returncode == 0, "%s: slot %d's K and V after the handoff differ from its own prefill's:\n%s%s" %
              (name, slot, diff.stdout, diff.stderr))
        status, body = server.post("/slots/%d?action=erase" % slot, {})
        check(status == 200, "%s: erase of slot %d: %s %s" % (name, slot, status, body))
        own = completion(server, slot, PROMPTS[slot], False)
        check(own["timings"]["prompt_n"] == len(PROMPTS[slot]), "%s: own prefill of %s tokens in slot %d" %
              (name, own["timings"]["prompt_n"], slot))
        got = handed[slot]
        check(got["content"] == own["content"] and got["tokens_predicted"] == own["tokens_predicted"],
              "%s: slot %d after the handoff %r (%d tokens), after its own prefill %r (%d tokens)" %
              (name, slot, got["content"], got["tokens_predicted"], own["content"], own["tokens_predicted"]))
        check(same_logprobs(top_logprobs(got), top_logprobs(own), tolerance),
              "%s: slot %d after the handoff the candidates are %s, after its own prefill %s (tolerance %g)" %
              (name, slot, top_logprobs(got), top_logprobs(own), tolerance))
        print("  slot %d: K and V equal to its own prefill's byte for byte, reply %r" % (slot, own["content"]),
              flush=True)


def test_slots_1_and_2_handed_over_while_slot_0_streams():
    name = "qwen3-c1536-np3-kvu"
    with start_server(name) as server:
        reference = streamed_completion(server, 0, PROMPT_0, N_PREDICT_0)
        check(reference, "slot 0's reference reply is empty")
        background = Background(server)
        wait_until(lambda: background.runs or background.errors, 300, "slot 0's first completion did not end")
        spans = []
        ranges = {}
        try:
            # Both shares before either adopt: the two runs of the one stream are disjoint,
            # so slot 2's share leaves slot 1's adoptable (kvshare stales only an earlier
            # share whose cells overlap the new one's).
            handed_over = {}
            handed_states = {}
            for slot in (1, 2):
                (handed_over[slot], span) = timed(lambda: share(server, slot, PROMPTS[slot], "%s-s%d" % (name, slot)))
                spans.append(span)
                ranges[slot] = (handed_over[slot][0]["first_cell"], handed_over[slot][0]["n_cells"])
            for slot in (1, 2):
                shared, message, fds = handed_over[slot]
                if slot == 1:
                    # More ids than the run's cells: a usage error, nothing written.
                    bad = prefill(name + "-long", message, [os.dup(fd) for fd in fds], PROMPTS[2], shared["first_cell"],
                                  shared["n_cells"])
                    check(bad.returncode == 2 and "--cells" in bad.stderr,
                          "llama-kvshare-prefill with %d ids into %d cells: exit %d:\n%s" %
                          (len(PROMPTS[2]), shared["n_cells"], bad.returncode, bad.stderr))
                done = prefill("%s-s%d" % (name, slot), message, fds, PROMPTS[slot], shared["first_cell"],
                               shared["n_cells"])
                check(done.returncode == 0, "%s: llama-kvshare-prefill --first-cell %d --cells %d exit %d:\n%s" %
                      (name, shared["first_cell"], shared["n_cells"], done.returncode, done.stderr))
            for slot in (1, 2):
                shared = handed_over[slot][0]
                (status, adopted), span = timed(lambda: server.post(
                    "/slots/%d?action=adopt" % slot, {"tokens": PROMPTS[slot], "share_id": shared["share_id"]}))
                spans.append(span)
                check(status == 200 and adopted["n_adopted"] == len(PROMPTS[slot]),
                      "%s: adopt in slot %d (both slots shared first): %s %s" % (name, slot, status, adopted))
                handed_states[slot] = save_slot(server, name, slot, "handed")
                print("  slot %d: cells %d..%d" % (slot, ranges[slot][0], sum(ranges[slot]) - 1), flush=True)
        finally:
            background.stop(reference)
        (a0, an), (b0, bn) = ranges[1], ranges[2]
        check(a0 + an <= b0 or b0 + bn <= a0, "%s: slot 1's cells %s and slot 2's %s overlap" % (name, ranges[1],
                                                                                            ranges[2]))
        overlapped = [s for s in spans if any(start < s[0] and s[1] < end for start, end, _ in background.runs)]
        print("  %d of %d share/adopt calls answered inside one of slot 0's %d streamed replies" %
              (len(overlapped), len(spans), len(background.runs)), flush=True)
        check(overlapped, "%s: no share or adopt was answered while slot 0 generated" % name)
        # Generated with slot 0 idle, as the server's own prefill below.
        handed = {slot: completion(server, slot, PROMPTS[slot], True) for slot in (1, 2)}
        check_against_own_prefill(server, name, handed, handed_states, ORDER_TOLERANCE)


def tensor_ranges(header, first_cell, n_cells):
    """Per chunk: the byte ranges [begin, end) of cells first_cell..+n_cells-1 of every tensor."""
    allowed = {}
    for t in header["tensors"]:
        check(t["ne"][2] == 1, "tensor %s has %d streams, a unified cache one" % (t["name"], t["ne"][2]))
        begin = t["offset"] + first_cell * t["row_bytes"]
        allowed.setdefault(t["chunk"], []).append((begin, begin + n_cells * t["row_bytes"]))
    return allowed


def snapshot(fds):
    out = []
    for fd in fds:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            out.append(bytes(m))
    return out


def test_provider_writes_only_its_cells():
    name = "qwen3-c1536-np3-kvu-bytes"
    with start_server(name) as server:
        # Slot 0 holds a prompt and its reply in the first cells, so slot 1's run starts after them.
        completion(server, 0, PROMPT_0, True)
        shared1, message, fds = share(server, 1, PROMPTS[1], name + "-s1")
        first, n = shared1["first_cell"], shared1["n_cells"]
        check(first >= len(PROMPT_0), "%s: slot 1's run starts at cell %d, inside slot 0's %d cells" %
              (name, first, len(PROMPT_0) + N_PREDICT))
        try:
            # -fa on: V is stored by rows, as K; every byte of cells first..first+n-1 is a row's.
            before = snapshot(fds)
            done = prefill(name + "-s1", message, fds, PROMPTS[1], first, n, close=False)
            check(done.returncode == 0, "%s: llama-kvshare-prefill exit %d:\n%s" % (name, done.returncode,
                                                                                   done.stderr))
            after = snapshot(fds)
        finally:
            for fd in fds:
                os.close(fd)
        allowed = tensor_ranges(message["header"], first, n)
        n_written = 0
        for chunk, (old, new) in enumerate(zip(before, after)):
            spans = sorted(allowed.get(chunk, []))
            position = 0
            for begin, end in spans + [(len(old), len(old))]:
                check(old[position:begin] == new[position:begin],
                      "%s: chunk %d: bytes %d..%d (outside cells %d..%d) changed" %
                      (name, chunk, position, begin - 1, first, first + n - 1))
                n_written += sum(1 for i in range(begin, end, 64) if old[i:i + 64] != new[i:i + 64])
                position = max(position, end)
        check(n_written > 0, "%s: the prefill wrote none of cells %d..%d" % (name, first, first + n - 1))
        print("  cells %d..%d written, every other byte of %d chunk(s) unchanged" % (first, first + n - 1,
                                                                                     len(before)), flush=True)

        # Slot 2 runs a task before slot 1 adopts: llama-server then purges its idle slots of a
        # unified cache (to its prompt cache), but not slot 1's reserved cells. Slot 2's cells
        # go after them.
        own2 = completion(server, 2, PROMPTS[2], True)
        check(own2["timings"]["prompt_n"] == len(PROMPTS[2]), "%s: slot 2 evaluated %s of %d tokens" %
              (name, own2["timings"]["prompt_n"], len(PROMPTS[2])))

        # No run of free cells for a prompt nearly as long as the cache (slot 1's reserved run
        # splits it): 503, slot 2 keeps its prompt.
        listener, path = share_listener(WORK, name + "-big")
        try:
            big = [5 + (3 * i) % 120 for i in range(N_CTX - 40)]
            status, body = server.post("/slots/2?action=share", {"socket": path, "tokens": big})
        finally:
            listener.close()
        message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
        check(status == 503 and "free cells" in message and "file route" in message,
              "%s: share of %d ids: %s %s" % (name, len(big), status, body))
        print("  share of %d ids: %s %s" % (len(big), status, message), flush=True)
        again = completion(server, 2, PROMPTS[2], True)
        check(again["timings"]["prompt_n"] == 1 and again["content"] == own2["content"],
              "%s: slot 2 after the refused share evaluated %s tokens, replied %r (before: %r)" %
              (name, again["timings"]["prompt_n"], again["content"], own2["content"]))

        status, adopted = server.post("/slots/1?action=adopt", {"tokens": PROMPTS[1], "share_id": shared1["share_id"]})
        check(status == 200, "%s: adopt in slot 1 (after slot 2's tasks): %s %s" % (name, status, adopted))
        handed_states = {1: save_slot(server, name, 1, "handed")}
        handed = {1: completion(server, 1, PROMPTS[1], True)}

        # An adopt after the slot was erased: the reservation is gone, refused.
        shared, message, fds = share(server, 2, PROMPTS[2], name + "-s2")
        done = prefill(name + "-s2", message, fds, PROMPTS[2], shared["first_cell"], shared["n_cells"])
        check(done.returncode == 0, "%s: llama-kvshare-prefill exit %d:\n%s" % (name, done.returncode, done.stderr))
        status, body = server.post("/slots/2?action=erase", {})
        check(status == 200, "%s: erase of slot 2: %s %s" % (name, status, body))
        status, body = server.post("/slots/2?action=adopt", {"tokens": PROMPTS[2], "share_id": shared["share_id"]})
        check(status == 400, "%s: adopt after erase: %s %s" % (name, status, body))
        print("  adopt after erase: %s %s" % (status, body.get("error", {}).get("message")), flush=True)
        own = completion(server, 2, PROMPTS[2], True)
        check(own["timings"]["prompt_n"] == len(PROMPTS[2]), "%s: slot 2 after the refused adopt evaluated %s of %d "
              "tokens" % (name, own["timings"]["prompt_n"], len(PROMPTS[2])))

        # Without ids a unified cache has nothing to reserve: 501, the caller falls back.
        listener, path = share_listener(WORK, name + "-noids")
        try:
            status, body = server.post("/slots/1?action=share", {"socket": path})
        finally:
            listener.close()
        error = body.get("error", {}) if isinstance(body, dict) else {}
        check(status == 501 and "unified" in error.get("message", ""), "%s: share without ids: %s %s" %
              (name, status, body))
        # Slot 1's handoff above against its own prefill (slot 0 idle, as then).
        check_against_own_prefill(server, name, handed, handed_states, ORDER_TOLERANCE)


def test_in_order_cells_reply_exactly_as_own_prefill():
    name = "qwen3-c1536-np3-kvu-in-order"
    # No RAM prompt cache: slot 0's cells stay, so slot 1's run starts after them and the
    # re-evaluated last prompt token returns to the run's last cell, as after its own prefill.
    with start_server(name, ["--cache-ram", "0"]) as server:
        completion(server, 0, PROMPT_0, True)
        shared, message, fds = share(server, 1, PROMPTS[1], name + "-s1")
        first = shared["first_cell"]
        check(first >= len(PROMPT_0), "%s: slot 1's run starts at cell %d, inside slot 0's cells" % (name, first))
        done = prefill(name + "-s1", message, fds, PROMPTS[1], first, shared["n_cells"])
        check(done.returncode == 0, "%s: llama-kvshare-prefill exit %d:\n%s" % (name, done.returncode, done.stderr))
        status, adopted = server.post("/slots/1?action=adopt", {"tokens": PROMPTS[1], "share_id": shared["share_id"]})
        check(status == 200, "%s: adopt in slot 1: %s %s" % (name, status, adopted))
        handed_states = {1: save_slot(server, name, 1, "handed")}
        handed = {1: completion(server, 1, PROMPTS[1], True)}
        check_against_own_prefill(server, name, handed, handed_states, 1e-3)
        print("  slot 1: cells %d..%d after slot 0's, reply exactly the own prefill's" %
              (first, first + shared["n_cells"] - 1), flush=True)


run_tests(globals(), WORK)
