#!/usr/bin/env python3
"""llama_server_incremental: the incremental handoff of issue #23 ("Conversations") with the
real decoder, a llama-server built with the patch series of integrations/llama.cpp
(LLAMA_SERVER_KVSHARE=path; skipped, exit 77, without it), and llama-kvshare-prefill from
the same build (beside the server, or LLAMA_KVSHARE_PREFILL=path) as the provider. This
test is its own broker: it listens, takes the share message (the layout header and the
fds) and runs the provider with them, as kvshare-serve does.

- turn 2 of a chat (turn 1's prompt + part of its reply + a new message): share with the
  ids to hand over answers n_cached = their common prefix with the slot's cached tokens;
  llama-kvshare-prefill --cached P writes the rest (its stdout line says n_prefilled);
  adopt with n_cached; the completion evaluates one token (prompt_n 1) and its greedy reply
  equals the server's own prefill of the same prompt;
- the KV after the incremental handoff (?action=save, kvshare-state diff) equals the
  server's own turn 2 after turn 1 (cache_prompt reusing the prefix) and a whole-prompt
  handoff's within 0.01: f16 rounding apart, as batch shapes differ (the own turn runs ids
  P..n-1 as one batch, the handoff P..n-2 and then n-1 alone; a whole prefill computes
  the prefix in one batch where turn 1 decoded part of it one token at a time); the
  whole-prompt handoff equals the server's own prefill within the same 0.01;
- a prefix that diverges from the slot's tokens gives the shorter n_cached; share without
  tokens answers n_cached 0;
- adopt with an n_cached the slot no longer holds, past its tokens or not an unsigned
  integer is refused (400, invalid_request_error) and the slot is unchanged; share with
  tokens that are not ids is refused (400 naming "tokens");
- llama-kvshare-prefill's usage errors (exit 2): --cached on the file route, --cached not
  below the number of ids (naming both), an unknown flag.

usage: llama_server_incremental.py BIN_DIR
"""
import http.client
import json
import os
import socket
import struct
import subprocess
import sys

from hybrid_common import llama_kvshare_prefill, Failure, check, run_tests, temp_dir, wait_until

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP llama_server_incremental: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
LLAMA_PREFILL = llama_kvshare_prefill(LLAMA)
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-mkmodel", "kvshare-state")}
missing = [name for name, path in TOOLS.items() if not os.access(path, os.X_OK)]
if not os.access(LLAMA_PREFILL, os.X_OK):
    missing.append(LLAMA_PREFILL)
if missing:
    print("SKIP llama_server_incremental: %s not built" % ", ".join(missing))
    sys.exit(77)

WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7", "--residual-gain", "3"], check=True, timeout=120,
               capture_output=True)
SLOTS = os.path.join(WORK, "slots")
os.makedirs(SLOTS)
N_PREDICT = 8
TURN1 = "You are terse. Tell me about the sea, in a few words."
NEW_MESSAGE = " And now tell me about the mountains, please, briefly."


class Decoder:
    """The patched llama-server with ONEBIT_KV_SHARE=1 on a free loopback port, one slot,
    its log in WORK; ready once /health answers 200."""

    def __init__(self):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.log_path = os.path.join(WORK, "llama-server.log")
        env = dict(os.environ, ONEBIT_KV_SHARE="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([LLAMA, "--host", "127.0.0.1", "--port", str(self.port), "-m", MODEL,
                                          "-c", "1024", "-np", "1", "-fa", "on", "-ctk", "f16", "-ctv", "f16",
                                          "--slot-save-path", SLOTS], stdout=subprocess.DEVNULL, stderr=log, env=env)

        def healthy():
            check(self.proc.poll() is None, "llama-server exited %s:\n%s" % (self.proc.returncode, self.log()))
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            except OSError:
                return False
        wait_until(healthy, 180, "llama-server did not come up")

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def post(self, path, body, timeout=120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", path, body=body if isinstance(body, str) else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, json.loads(data) if data.startswith(b"{") else data

    def ok(self, path, body):
        status, reply = self.post(path, body)
        check(status == 200, "%s: %s %s\n%s" % (path, status, reply, self.log()))
        return reply

    def tokenize(self, text):
        return self.ok("/tokenize", {"content": text, "add_special": False})["tokens"]

    def complete(self, ids):
        """(content, generated ids, timings.prompt_n) of a greedy completion on slot 0."""
        reply = self.ok("/completion", {"prompt": ids, "n_predict": N_PREDICT, "temperature": 0, "top_k": 1,
                                        "cache_prompt": True, "id_slot": 0, "return_tokens": True})
        return reply["content"], reply["tokens"], reply["timings"]["prompt_n"]

    def save(self, name):
        self.ok("/slots/0?action=save", {"filename": name})
        return os.path.join(SLOTS, name)

    def erase(self):
        self.ok("/slots/0?action=erase", {})

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def recv_share(listener):
    """The one share message of the listening `listener`: (the message JSON, its fds)."""
    listener.settimeout(30)
    conn, _ = listener.accept()
    conn.settimeout(30)
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
        chunk, more_fds, _, _ = socket.recv_fds(conn, 1 << 20, 16)
        check(chunk, "the share connection closed after %d bytes" % len(data))
        data += chunk
        fds += more_fds
    conn.close()
    return json.loads(data[4:4 + struct.unpack("<I", data[:4])[0]]), fds


def share(decoder, tokens=None, name="share"):
    """?action=share to a listener of ours: (the reply, the layout header path, the fds)."""
    sock_path = os.path.join(WORK, name + ".sock")
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(1)
    try:
        body = {"socket": sock_path}
        if tokens is not None:
            body["tokens"] = tokens
        reply = decoder.ok("/slots/0?action=share", body)
        message, fds = recv_share(listener)
    finally:
        listener.close()
    check(len(fds) == reply["n_fds"] and message["share_id"] == reply["share_id"],
          "share message %s with %d fds for the reply %s" % (list(message), len(fds), reply))
    layout = os.path.join(WORK, name + ".layout.json")
    with open(layout, "w") as f:
        json.dump(message["header"], f)
    return reply, layout, fds


def provide(ids, layout, fds, cached=None, name="ids"):
    """llama-kvshare-prefill into the shared region: (exit code, stdout, stderr)."""
    ids_path = os.path.join(WORK, name + ".txt")
    with open(ids_path, "w") as f:
        f.write("\n".join(str(i) for i in ids) + "\n")
    args = [LLAMA_PREFILL, "--tokens", ids_path, "--model", MODEL, "--layout", layout,
            "--fds", ",".join(str(fd) for fd in fds)]
    if cached is not None:
        args += ["--cached", str(cached)]
    try:
        result = subprocess.run(args, pass_fds=fds, capture_output=True, text=True, timeout=300)
    finally:
        for fd in fds:
            os.close(fd)
    return result.returncode, result.stdout, result.stderr


def prefill_line(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def state_diff(a, b, tolerance=0):
    result = subprocess.run([TOOLS["kvshare-state"], "diff", a, b, "--tolerance", str(tolerance)], capture_output=True,
                            text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


DECODER = None
TURN = {}


def setup():
    global DECODER
    DECODER = Decoder()
    turn1 = DECODER.tokenize(TURN1)
    DECODER.erase()
    _, reply1, _ = DECODER.complete(turn1)
    check(len(reply1) == N_PREDICT, "turn 1 generated %s" % reply1)
    # Turn 2 = turn 1 + the first three reply tokens + the new message, whose first id is
    # made to differ from the reply's fourth so the common prefix is known exactly.
    new = DECODER.tokenize(NEW_MESSAGE)
    if new[0] == reply1[3]:
        new = DECODER.tokenize(" So," + NEW_MESSAGE)
    turn2 = turn1 + reply1[:3] + new
    # The slot holds turn 1 and the reply tokens it decoded (the last sampled one is not).
    slot_tokens = turn1 + reply1[:-1]
    # The server's own prefill of turn 2: the reply and KV the handoffs must reproduce.
    DECODER.erase()
    own_text, _, own_prompt_n = DECODER.complete(turn2)
    check(own_prompt_n == len(turn2), "own prefill evaluated %s of %d" % (own_prompt_n, len(turn2)))
    own_state = DECODER.save("own.state")
    # The server's own turn 2 after turn 1 (cache_prompt reuses the common prefix): what an
    # incremental handoff computes, cell for cell. Its prefix cells were written by turn 1's
    # prefill and one-token decodes, so they differ from a whole prefill's in the last bits.
    DECODER.erase()
    DECODER.complete(turn1)
    own_inc_text, _, own_inc_prompt_n = DECODER.complete(turn2)
    check(own_inc_prompt_n == len(turn2) - common_prefix(turn2, slot_tokens),
          "own turn 2 evaluated %s of %d" % (own_inc_prompt_n, len(turn2)))
    own_inc_state = DECODER.save("own-incremental.state")
    TURN.update(turn1=turn1, reply1=reply1, turn2=turn2, slot_tokens=slot_tokens, own_text=own_text,
                own_state=own_state, own_inc_text=own_inc_text, own_inc_state=own_inc_state)


def run_turn1():
    DECODER.erase()
    text, reply1, _ = DECODER.complete(TURN["turn1"])
    check(reply1 == TURN["reply1"], "turn 1 replied %s, first time %s" % (reply1, TURN["reply1"]))


def test_1_incremental_handoff_equals_a_whole_prompt_handoff_and_the_own_prefill():
    turn2 = TURN["turn2"]
    ids = turn2[:-1]
    expected = common_prefix(ids, TURN["slot_tokens"])
    check(expected == len(TURN["turn1"]) + 3, "the test's prompts: common prefix %d" % expected)

    # Whole-prompt handoff (share without tokens: n_cached 0).
    DECODER.erase()
    reply, layout, fds = share(DECODER, name="whole")
    check(reply["n_cached"] == 0, "share without tokens: %s" % reply)
    code, out, err = provide(ids, layout, fds, name="whole-ids")
    check(code == 0, "whole prefill exit %d:\n%s" % (code, err))
    check(prefill_line(out)["n_prefilled"] == len(ids), "whole prefill stdout %r" % out)
    DECODER.ok("/slots/0?action=adopt", {"tokens": ids, "share_id": reply["share_id"]})
    text, _, prompt_n = DECODER.complete(turn2)
    check(text == TURN["own_text"] and prompt_n == 1, "whole handoff: %r prompt_n %s, own %r" %
          (text, prompt_n, TURN["own_text"]))
    whole_state = DECODER.save("whole.state")

    # Incremental: turn 1 as a chat would have it, then share with turn 2's ids.
    run_turn1()
    reply, layout, fds = share(DECODER, ids, name="inc")
    check(reply["n_cached"] == expected, "share n_cached %s, the common prefix is %d" % (reply["n_cached"], expected))
    check(list(reply) == ["id_slot", "share_id", "stream", "backend", "n_fds", "region_bytes", "n_cached", "timings"],
          "share reply keys %s" % list(reply))
    code, out, err = provide(ids, layout, fds, cached=reply["n_cached"], name="inc-ids")
    check(code == 0, "incremental prefill exit %d:\n%s" % (code, err))
    line = prefill_line(out)
    check(line["n_prefilled"] == len(ids) - expected and "prefill_ms" in line, "incremental stdout %r" % out)
    check("the first %d already in the decoder's cells" % expected in err, "provider stderr %r" % err)
    adopted = DECODER.ok("/slots/0?action=adopt", {"tokens": ids, "share_id": reply["share_id"],
                                                    "n_cached": reply["n_cached"]})
    check(adopted["n_adopted"] == len(ids), "adopt %s" % adopted)
    text, _, prompt_n = DECODER.complete(turn2)
    check(text == TURN["own_inc_text"], "incremental reply %r, the server's own turn 2 %r" % (text, TURN["own_inc_text"]))
    check(text == TURN["own_text"], "incremental reply %r, own whole prefill %r" % (text, TURN["own_text"]))
    check(prompt_n == 1, "incremental handoff: prompt_n %s, expected 1" % prompt_n)
    inc_state = DECODER.save("inc.state")

    # The server's own turn 2: the same cells from the same computation, but the server ran
    # ids P..n-1 as one batch where the provider ran P..n-2 and the decoder n-1 alone, and
    # ggml's CPU kernels round a one-row batch differently (layer 0 is exact; from layer 1 on
    # cells n-1.. differ by about one f16 ulp). A cached prefix the provider did not attend
    # over, or cells it overwrote, differ by orders of magnitude more.
    code, report = state_diff(inc_state, TURN["own_inc_state"], 0.01)
    check(code == 0, "the KV after the incremental handoff differs from the server's own turn 2:\n%s" % report)
    # A whole-prompt handoff computed cells 0..P-1 in one batch, turn 1 partly one token at a
    # time: the same function, f16 rounding apart (as the refmodel provider's tolerance).
    code, report = state_diff(inc_state, whole_state, 0.01)
    check(code == 0, "the KV after the incremental handoff differs from the whole-prompt handoff's:\n%s" % report)
    # (not exact either for this prompt: the handoff decodes id n-1 alone, the own prefill in
    # its batch; the same rounding as above)
    code, report = state_diff(whole_state, TURN["own_state"], 0.01)
    check(code == 0, "the KV after the whole-prompt handoff differs from the server's own prefill:\n%s" % report)


def test_2_a_diverging_prefix_gives_the_shorter_n_cached():
    run_turn1()
    for diverge_at in (0, 5, len(TURN["turn1"]) - 1):
        ids = list(TURN["turn2"][:-1])
        held = TURN["slot_tokens"][diverge_at]
        ids[diverge_at] = held - 1 if held > 0 else held + 1
        reply, _, fds = share(DECODER, ids, name="diverge-%d" % diverge_at)
        for fd in fds:
            os.close(fd)
        check(reply["n_cached"] == common_prefix(ids, TURN["slot_tokens"]) == diverge_at,
              "diverging at %d: n_cached %s" % (diverge_at, reply["n_cached"]))
    # A prefix shorter than the slot's tokens: capped at the ids given.
    reply, _, fds = share(DECODER, TURN["turn1"][:4], name="short")
    for fd in fds:
        os.close(fd)
    check(reply["n_cached"] == 4, "4 cached ids: n_cached %s" % reply["n_cached"])


def test_3_adopt_with_a_wrong_n_cached_is_refused_and_the_slot_unchanged():
    run_turn1()
    before = DECODER.save("before.state")
    ids = TURN["turn2"][:-1]
    reply, layout, fds = share(DECODER, ids, name="wrong")
    p = reply["n_cached"]
    for n_cached, says in ((p + 1, "n_cached"), (len(ids) + 1, "n_cached"), (-1, "n_cached"), ("3", "n_cached")):
        status, body = DECODER.post("/slots/0?action=adopt", {"tokens": ids, "share_id": reply["share_id"],
                                                               "n_cached": n_cached})
        check(status == 400 and body["error"]["type"] == "invalid_request_error" and says in body["error"]["message"],
              "adopt with n_cached %r (the slot holds %d): %s %s" % (n_cached, p, status, body))
    # tokens[0..P-1] that are not the slot's any more
    changed = [ids[0] + 1 if ids[0] < 200 else 1] + ids[1:]
    status, body = DECODER.post("/slots/0?action=adopt", {"tokens": changed, "share_id": reply["share_id"],
                                                           "n_cached": p})
    check(status == 400 and "n_cached" in body["error"]["message"], "adopt of changed ids: %s %s" % (status, body))
    status, body = DECODER.post("/slots/0?action=share", {"socket": "/nonexistent.sock", "tokens": "1 2"})
    check(status == 400 and "tokens" in body["error"]["message"], "share with tokens not a list: %s %s" % (status, body))
    status, body = DECODER.post("/slots/0?action=share", {"socket": "/nonexistent.sock", "tokens": [1, 10 ** 7]})
    check(status == 400 and "tokens[1]" in body["error"]["message"], "share with an id past the vocabulary: %s %s" %
          (status, body))
    # Unchanged: the same KV, and turn 1's tokens are still cached.
    after = DECODER.save("after.state")
    code, report = state_diff(before, after)
    check(code == 0, "a refused adopt changed the slot's KV:\n%s" % report)
    _, reply1, prompt_n = DECODER.complete(TURN["turn1"])
    check(prompt_n == 1 and reply1 == TURN["reply1"], "after the refusals: prompt_n %s, reply %s" % (prompt_n, reply1))
    # The refusals spent nothing: the share's provider and adopt still complete the handoff.
    code, out, err = provide(ids, layout, fds, cached=p, name="wrong-ids")
    check(code == 0 and prefill_line(out)["n_prefilled"] == len(ids) - p, "prefill after the refusals: %d %r\n%s" %
          (code, out, err))
    DECODER.ok("/slots/0?action=adopt", {"tokens": ids, "share_id": reply["share_id"], "n_cached": p})
    text, _, prompt_n = DECODER.complete(TURN["turn2"])
    check(text == TURN["own_text"] and prompt_n == 1, "after the refusals: %r prompt_n %s" % (text, prompt_n))


def test_4_provider_usage_errors_exit_2():
    ids_path = os.path.join(WORK, "usage-ids.txt")
    with open(ids_path, "w") as f:
        f.write("1\n2\n3\n")
    state = os.path.join(WORK, "usage.state")
    cases = [
        (["--tokens", ids_path, "--model", MODEL, "--out", state, "--cached", "1"], "shared route"),
        (["--tokens", ids_path, "--model", MODEL, "--layout", "/nonexistent.json", "--fds", "99", "--cached", "3"],
         "--cached 3"),
        (["--tokens", ids_path, "--model", MODEL, "--layout", "/nonexistent.json", "--fds", "99", "--cached", "x"],
         "--cached x"),
        (["--tokens", ids_path, "--model", MODEL, "--out", state, "--no-such-flag"], "unknown argument"),
    ]
    for args, says in cases:
        result = subprocess.run([LLAMA_PREFILL] + args, capture_output=True, text=True, timeout=60)
        check(result.returncode == 2 and says in result.stderr, "%s: exit %d, stderr %r" %
              (" ".join(args[-2:]), result.returncode, result.stderr))
    # both numbers named
    result = subprocess.run([LLAMA_PREFILL, "--tokens", ids_path, "--model", MODEL, "--layout", "/nonexistent.json",
                             "--fds", "99", "--cached", "3"], capture_output=True, text=True, timeout=60)
    check("3" in result.stderr and "3 ids" in result.stderr, "--cached 3 of 3 ids: %r" % result.stderr)
    check(not os.path.exists(state), "a usage error wrote %s" % state)


def main():
    try:
        setup()
    except Failure as error:
        print("FAIL setup: %s" % error)
        if DECODER is not None:
            print(DECODER.log())
            DECODER.stop()
        sys.exit(1)
    try:
        run_tests(globals(), WORK)
    finally:
        DECODER.stop()


if __name__ == "__main__":
    main()
