#!/usr/bin/env python3
"""conversation: a chat through kvshare-serve --device hybrid, turn after turn, the way
people use it (issue #23): every later turn hands over only what the decoder's slot does
not hold, or is forwarded when that is little. For each decoder (kvshare-decoder with
kvshare-prefill; with LLAMA_SERVER_KVSHARE=path also the patched llama-server with
llama-kvshare-prefill) and each local route (the shared route, incremental; the file
route, whole prompts only), one conversation of five turns with another conversation
between its third and fourth, and its history edited in its last turn:

  A1 long             handed off whole (nothing cached)
  A2 short            forwarded: "below --handoff 64"; the decoder evaluates only the new part
  A3 long             shared: handed off with A2's prompt cached, only the rest prefilled;
                      file: handed off whole
  B1 long             another user: only the common system prompt is cached
  A4 long             back to A: the slot holds B, so little is cached again
  A5 edited history   A3's message changed near its end: cached up to the edit only

Each reply equals the --device cpu reply to the same messages (the decoder alone, its own
prompt cache), a handed-off turn's decoder evaluates one token (timings.prompt_n 1), each
turn's log line says what was decided and how much was cached, and the KV after the last
turn equals (kvshare-state diff, 0.01) the decoder's own after the same turns.

And with the reference pair: `auto`, the default, hands off a long first prompt (nothing
measured yet), forwards a short turn, and forwards the next long part to measure the
decoder (the metrics count each rule); --handoff never forwards every turn; a prompt too long for the
context is forwarded (the decoder's own answer, whatever --handoff says); a provider that
exits 2 on --cached (one from before it) gets that turn and every later one whole.

--vulkan (issue #42): the chat of the patched llama-server pair on the shared route, the
decoder on a Vulkan device (-ngl 99, GGML_VK_VISIBLE_DEVICES=0: lavapipe in CI; skipped
without one, failed under CI=true), its provider on the CPU (the NPU case), against
--device cpu of that decoder.

usage: conversation.py BIN_DIR [--vulkan]     (exit 77 = skipped: a tool of the reference pair is missing)
"""
import http.client
import json
import os
import re
import shutil
import stat
import subprocess
import sys

from hybrid_common import (VULKAN_ENV, Serve, chat_reply_of, check, llama_kvshare_prefill, run_tests, temp_dir,
                           vulkan_device, wrapped_provider)

BIN = os.path.abspath(sys.argv[1])
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-decoder", "kvshare-prefill",
                                                    "kvshare-mkmodel", "kvshare-state")}
missing = [name for name, path in TOOLS.items() if not os.access(path, os.X_OK)]
if missing:
    print("SKIP conversation: %s not built" % ", ".join(missing))
    sys.exit(77)
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
LLAMA_PREFILL = llama_kvshare_prefill(LLAMA)
PAIRS = {"reference": (TOOLS["kvshare-decoder"], TOOLS["kvshare-prefill"])}
if LLAMA and os.access(LLAMA, os.X_OK) and os.access(LLAMA_PREFILL, os.X_OK):
    PAIRS["llama"] = (LLAMA, LLAMA_PREFILL)
VULKAN = "--vulkan" in sys.argv[2:]
if VULKAN:
    if "llama" not in PAIRS:
        print("SKIP conversation --vulkan: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
              "scripts/build-llama-server.sh --with-kvshare")
        sys.exit(77)
    vulkan_device(LLAMA, "conversation --vulkan")  # exits without a Vulkan device

WORK = temp_dir()
if VULKAN:
    # the provider on the CPU, as an NPU engine is (on lavapipe a per-request provider on the
    # device would compile its pipelines anew for every turn)
    PAIRS["vulkan"] = (LLAMA, wrapped_provider(WORK, "cpu-provider", "os.environ.pop('GGML_VK_VISIBLE_DEVICES', None)",
                                               LLAMA_PREFILL))
MODEL = os.path.join(WORK, "tiny.gguf")
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7", "--residual-gain", "3"], check=True, timeout=120,
               capture_output=True)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
N_CTX = 1024
KV_FLAGS = ["-c", str(N_CTX), "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
THRESHOLD = 64
SYSTEM = "You are terse."
# Matched anywhere in a stderr line: llama-server's log shares serve's stderr.
TURN_LINE = re.compile(r"hybrid: (\d+) prompt tokens(?:, (\d+) cached)?: (?:forwarded \((.*)\)|prefill "
                       r"\d+\.\d{3} ms(?: of (\d+) tokens)?, (share|restore|share 0\.000 ms, restore) )")
DECODER_RE = re.compile(r"decoder \S+ on 127\.0\.0\.1:(\d+)")


def long_text(topic, n):
    return "Tell me about %s, and about each of these in turn: %s." % (
        topic, ", ".join("%s number %d" % (topic, i) for i in range(n)))


A1 = long_text("the sea", 16)
A2 = "Thanks. Shorter?"
A3 = long_text("the mountains", 16)
B1 = long_text("rivers", 16)
A4 = long_text("the forests", 16)
A3_EDITED = A3[:-12] + "and deserts."
A5 = "One more."


class Turn:
    def __init__(self, name, history, message):
        self.name, self.history, self.message = name, history, message

    def messages(self, replies):
        out = [{"role": "system", "content": SYSTEM}]
        for text, reply_of in self.history:
            out.append({"role": "user", "content": text})
            out.append({"role": "assistant", "content": replies[reply_of]})
        out.append({"role": "user", "content": self.message})
        return out


# Each history entry: (the user's text, the turn whose reply followed it).
TURNS = [
    Turn("A1", [], A1),
    Turn("A2", [(A1, "A1")], A2),
    Turn("A3", [(A1, "A1"), (A2, "A2")], A3),
    Turn("B1", [], B1),
    Turn("A4", [(A1, "A1"), (A2, "A2"), (A3, "A3")], A4),
    Turn("A5", [(A1, "A1"), (A2, "A2"), (A3_EDITED, "A3"), (A4, "A4")], A5),
]


def start(device, pair, kv_share, args=(), provider=None):
    decoder, pair_provider = PAIRS[pair]
    full = ["-m", MODEL, "--device", device, "--port", "0", "--backend", decoder] + KV_FLAGS + list(args)
    if device == "hybrid":
        full += ["--prefill-provider", provider or pair_provider]
    env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": "1" if kv_share else None}
    if pair == "vulkan":
        # every layer on the device; the provider inherits the environment and uses it too
        full += ["--", "-ngl", "99"]
        env.update(VULKAN_ENV)
    return Serve(TOOLS["kvshare-serve"], full, env, timeout=300)


def ask(serve, messages):
    status, data = serve.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0},
                              timeout=300)
    return chat_reply_of(status, data, False)


def save_slot(serve, name):
    """The decoder's slot 0, saved through the decoder's own API, moved out of serve's
    private slot directory."""
    port = int(DECODER_RE.search(serve.wait_line(DECODER_RE, timeout=60)).group(1))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/slots/0?action=save", body=json.dumps({"filename": name}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    check(response.status == 200, "save: %s %s" % (response.status, body[:300]))
    saved = [os.path.join(SERVE_TMP, d, name) for d in os.listdir(SERVE_TMP)
             if d.startswith("kvshare-serve-slots") and os.path.exists(os.path.join(SERVE_TMP, d, name))]
    check(len(saved) == 1, "%s saved in %d slot directories" % (name, len(saved)))
    out = os.path.join(WORK, name)
    shutil.move(saved[0], out)
    return out


BASELINES = {}


def baseline(pair):
    """The decoder alone (--device cpu), the same turns in the same order: each turn's
    reply, and its slot after the last turn."""
    if pair not in BASELINES:
        serve = start("cpu", pair, False)
        try:
            replies = {}
            for turn in TURNS:
                replies[turn.name] = ask(serve, turn.messages(replies))[0]
            state = save_slot(serve, "%s-cpu.state" % pair)
        finally:
            serve.stop()
        BASELINES[pair] = (replies, state)
    return BASELINES[pair]


def turn_lines(serve, count):
    lines = serve.wait_count(TURN_LINE, count, timeout=60)
    check(len(lines) >= count, "%d turn lines, expected %d:\n%s" % (len(lines), count, "\n".join(serve.lines)))
    return [TURN_LINE.search(line) for line in lines]


class Seen:
    """One turn's outcome: its reply, prompt_n and log line."""

    def __init__(self, reply, prompt_n, line):
        self.reply, self.prompt_n = reply, prompt_n
        self.n_prompt = int(line.group(1))
        self.n_cached = int(line.group(2) or 0)
        self.forwarded_because = line.group(3)
        self.n_prefilled = int(line.group(4)) if line.group(4) else None
        self.handoff = line.group(5)
        self.text = line.group(0)


def run_chat(serve, replies_from):
    """Sends TURNS, building each history from `replies_from` (the --device cpu replies, so
    that both runs see the same messages); a Seen per turn."""
    seen = {}
    for i, turn in enumerate(TURNS):
        reply, prompt_n = ask(serve, turn.messages(replies_from))
        seen[turn.name] = Seen(reply, prompt_n, turn_lines(serve, i + 1)[i])
    return seen


def check_handed_off(turn, got, route, cached_at_least=0, cached_below=None):
    check(got.forwarded_because is None, "%s was forwarded (%s), not handed off" % (turn, got.forwarded_because))
    check(got.prompt_n == 1, "%s: the decoder evaluated %s prompt tokens after the handoff, not 1" %
          (turn, got.prompt_n))
    check(got.handoff == ("share" if route == "shared" else "restore"), "%s: %r" % (turn, got.text))
    check(got.n_cached >= cached_at_least, "%s: %d cached, expected at least %d: %r" %
          (turn, got.n_cached, cached_at_least, got.text))
    if cached_below is not None:
        check(got.n_cached < cached_below, "%s: %d cached, expected fewer than %d: %r" %
              (turn, got.n_cached, cached_below, got.text))
    if got.n_cached:
        check(got.n_prefilled == got.n_prompt - 1 - got.n_cached,
              "%s: the provider prefilled %s tokens, not the %d uncached ones but the last: %r" %
              (turn, got.n_prefilled, got.n_prompt - 1 - got.n_cached, got.text))


def check_chat(pair, route):
    cpu_replies, cpu_state = baseline(pair)
    serve = start("hybrid", pair, route == "shared", ["--handoff", str(THRESHOLD)])
    try:
        seen = run_chat(serve, cpu_replies)
        for turn in TURNS:
            check(seen[turn.name].reply == cpu_replies[turn.name], "%s %s %s: %r, --device cpu said %r" %
                  (pair, route, turn.name, seen[turn.name].reply, cpu_replies[turn.name]))
        a1, a2, a3, b1, a4, a5 = (seen[t.name] for t in TURNS)
        check_handed_off("A1", a1, route, cached_below=1)
        check(a2.forwarded_because is not None and ("below --handoff %d" % THRESHOLD) in a2.forwarded_because,
              "A2 (a short turn) was not forwarded as short: %r" % a2.text)
        check(1 < a2.prompt_n < THRESHOLD, "A2: the decoder evaluated %s prompt tokens: its cache was not reused" %
              a2.prompt_n)
        if route == "shared":
            # A3 begins with A2's prompt, which the slot holds with A2's reply after it.
            check_handed_off("A3", a3, route, cached_at_least=a2.n_prompt - 2)
            # B shares the system prompt with A, nothing more.
            check_handed_off("B1", b1, route, cached_at_least=1, cached_below=a1.n_prompt // 4)
            check_handed_off("A4", a4, route, cached_at_least=1, cached_below=a1.n_prompt // 4)
            # A5 differs from A4 near the end of A3's message: the slot holds A4, so the
            # prefix up to the edit, past A2's prompt and short of A3's.
            check_handed_off("A5", a5, route, cached_at_least=a2.n_prompt, cached_below=a3.n_prompt)
        else:
            for name, got in (("A3", a3), ("B1", b1), ("A4", a4), ("A5", a5)):
                check_handed_off(name, got, route, cached_below=1)
        state = save_slot(serve, "%s-%s.state" % (pair, route))
        result = subprocess.run([TOOLS["kvshare-state"], "diff", state, cpu_state, "--tolerance", "0.01"],
                                capture_output=True, text=True, timeout=120)
        check(result.returncode == 0, "%s %s: the KV after the chat differs from the decoder's own:\n%s%s" %
              (pair, route, result.stdout, result.stderr))
        check(not [line for line in serve.lines if "hybrid: fallback" in line],
              "fallbacks:\n%s" % "\n".join(serve.lines))
    finally:
        serve.stop()


def test_chat_reference_shared_route():
    check_chat("reference", "shared")


def test_chat_reference_file_route():
    check_chat("reference", "file")


def test_chat_llama_server_shared_route():
    if "llama" not in PAIRS:
        print("SKIP test_chat_llama_server_shared_route: set LLAMA_SERVER_KVSHARE=path of a llama-server built "
              "with scripts/build-llama-server.sh --with-kvshare (llama-kvshare-prefill beside it)")
        return
    check_chat("llama", "shared")


def test_chat_llama_server_file_route():
    if "llama" not in PAIRS:
        print("SKIP test_chat_llama_server_file_route: set LLAMA_SERVER_KVSHARE (see above)")
        return
    check_chat("llama", "file")


def first_turns(serve, count):
    cpu_replies, _ = baseline("reference")  # computed before `serve` started (BASELINES)
    out = []
    for i, turn in enumerate(TURNS[:count]):
        reply, prompt_n = ask(serve, turn.messages(cpu_replies))
        check(reply == cpu_replies[turn.name], "%s: %r, --device cpu said %r" % (turn.name, reply,
                                                                                cpu_replies[turn.name]))
        out.append(Seen(reply, prompt_n, turn_lines(serve, i + 1)[i]))
    return out


def test_auto_by_default_learns_the_provider_then_the_decoder():
    """auto's first steps, the same on any machine: a long prompt is handed off (nothing is
    measured: the count rule), a short turn forwarded, the next long part forwarded to
    measure the decoder on a part that long (a short turn's speed says little of it)."""
    cpu_replies, _ = baseline("reference")
    serve = start("hybrid", "reference", True)  # no --handoff: auto
    try:
        turns = [Turn("long", [], long_text("the sky", 24)), Turn("short", [], A2), Turn("again", [], A3)]
        turns[1].history = [(turns[0].message, "long")]
        turns[2].history = [(turns[0].message, "long"), (A2, "short")]
        replies, seen = dict(cpu_replies), []
        for i, turn in enumerate(turns):
            reply, prompt_n = ask(serve, turn.messages(replies))
            replies[turn.name] = reply
            seen.append(Seen(reply, prompt_n, turn_lines(serve, i + 1)[i]))
        check(seen[0].n_prompt > 257, "the long turn has only %d tokens" % seen[0].n_prompt)
        check_handed_off("long", seen[0], "shared", cached_below=1)
        check(seen[1].forwarded_because is not None and "below 256 before the decoder's speed is measured" in
              seen[1].forwarded_because, "the short turn: %r" % seen[1].text)
        check(1 < seen[1].prompt_n < 64, "the short turn: prompt_n %s" % seen[1].prompt_n)
        check(seen[2].forwarded_because is not None and "the decoder evaluates them, measuring its speed" in
              seen[2].forwarded_because, "the third turn: %r" % seen[2].text)
        check(seen[2].prompt_n > 256, "the third turn: prompt_n %s" % seen[2].prompt_n)
        status, _, metrics = serve.request("GET", "/metrics")
        check(status == 200, "metrics %d" % status)
        for series in ('kvshare_handoff_decisions_total{decision="handoff",rule="threshold"} 1',
                       'kvshare_handoff_decisions_total{decision="forward",rule="short"} 1',
                       'kvshare_handoff_decisions_total{decision="forward",rule="measuring"} 1'):
            check(series in metrics.decode(), "%s not in /metrics:\n%s" % (series, metrics.decode()))
    finally:
        serve.stop()


def test_handoff_never_forwards_every_turn():
    baseline("reference")
    serve = start("hybrid", "reference", True, ["--handoff", "never"])
    try:
        for got in first_turns(serve, 3):
            check(got.forwarded_because is not None and "--handoff never" in got.forwarded_because, got.text)
        check(not serve.stderr_lines("hybrid: provider"), "a provider ran")
    finally:
        serve.stop()


def test_a_prompt_too_long_for_the_context_is_the_decoders_to_answer():
    messages = [{"role": "user", "content": long_text("everything", 300)}]
    cpu = start("cpu", "reference", False)
    try:
        cpu_status, cpu_body = cpu.post("/v1/chat/completions", {"messages": messages, "max_tokens": 4}, timeout=300)
    finally:
        cpu.stop()
    serve = start("hybrid", "reference", True, ["--handoff", "always"])
    try:
        status, body = serve.post("/v1/chat/completions", {"messages": messages, "max_tokens": 4}, timeout=300)
        check(status == cpu_status, "status %d, --device cpu answered %d: %s" % (status, cpu_status, body[:300]))
        check(json.loads(body).get("error") == json.loads(cpu_body).get("error"), "%s against %s" % (body, cpu_body))
        got = turn_lines(serve, 1)[0]
        check(got.group(3) and "do not fit the decoder's context of %d cells" % N_CTX in got.group(3), got.group(0))
    finally:
        serve.stop()


def test_a_provider_without_cached_gets_whole_prompts():
    old_provider = os.path.join(WORK, "provider-before-cached.sh")
    with open(old_provider, "w") as f:
        f.write('#!/bin/sh\n# A provider from before --cached: a usage error on the flag.\n'
                'for a in "$@"; do [ "$a" = --cached ] && { echo "unknown option --cached" >&2; exit 2; }; done\n'
                'exec "%s" "$@"\n' % TOOLS["kvshare-prefill"])
    os.chmod(old_provider, stat.S_IRWXU)
    baseline("reference")
    serve = start("hybrid", "reference", True, ["--handoff", str(THRESHOLD)], provider=old_provider)
    try:
        a1, a2, a3, b1 = first_turns(serve, 4)
        check_handed_off("A1", a1, "shared", cached_below=1)
        check(a2.forwarded_because is not None, a2.text)
        # A3: the share says most is cached; the provider refuses --cached, is run again
        # with the whole prompt, and serve says so once.
        check_handed_off("A3", a3, "shared", cached_below=1)
        check_handed_off("B1", b1, "shared", cached_below=1)
        said = [line for line in serve.lines if "exited 2 on --cached" in line]
        check(len(said) == 1 and "whole prompts from now on" in said[0], "\n".join(serve.lines))
    finally:
        serve.stop()


if VULKAN:
    # the only case of a --vulkan run: the other cases are the CPU run's
    for name in [n for n in globals() if n.startswith("test_")]:
        del globals()[name]

    def test_chat_vulkan_shared_route():
        check_chat("vulkan", "shared")


if __name__ == "__main__":
    run_tests(globals(), WORK)
