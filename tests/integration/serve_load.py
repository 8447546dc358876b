#!/usr/bin/env python3
"""serve_load: --handoff auto beside a busy decoder (issue #43). kvshare-serve --device hybrid
-np 4 --handoff auto --stream-weight 8 on the shared route, the patched llama-server as the
decoder (LLAMA_SERVER_KVSHARE=path; skipped, exit 77, without it) and llama-kvshare-prefill
behind a wrapper that waits a second before it starts: a provider that is always later than
the decoder for the arriving request (the seed's NPU beside its iGPU), whatever the speeds of
the machine the test runs on, so a prompt it takes is taken for the streams' sake.

- serve learns both speeds on the idle decoder: a long prompt handed off (the provider's
  speed is not measured yet), a long one forwarded (measuring the decoder's);
- on the idle decoder a long prompt is forwarded (the decoder is sooner), none for load;
- two streams decode long replies in other slots, and a long prompt arrives while both have
  relayed their first chunk and not their last: serve says `handed off: 2 slots decoding`,
  and /metrics counts every such line in kvshare_load_handoffs_total and as the decision
  rule="load";
- every reply, the streams' and the long prompts', equals --device cpu's for the same request;
- a model trained on 512 cells under -c 2048: serve learns the capped slot from GET /props and
  sends a longer prompt straight to the decoder, no provider run.

usage: serve_load.py BIN_DIR
"""
import http.client
import json
import os
import re
import subprocess
import sys
import threading

from hybrid_common import Serve, check, llama_kvshare_prefill, run_tests, temp_dir, wrapped_provider

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP serve_load: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
LLAMA_PREFILL = llama_kvshare_prefill(LLAMA)
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-mkmodel")}

WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
# 8 layers, as the measurement: each step long enough that a stream is still decoding
# when the next request arrives.
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7", "--residual-gain", "3", "--layers", "8", "--embd", "256",
                "--ff", "768"], check=True, timeout=120, capture_output=True)
# A second before the provider starts: its start-up, which serve learns, outweighs the
# decoder's prefill of any prompt here (a resident provider's per-token speed depends on
# what else the machine runs, and the test must not).
SLOW_PREFILL = wrapped_provider(WORK, "slow-start-prefill", "import time\ntime.sleep(1.0)", LLAMA_PREFILL)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
# 1024 cells per slot: a long prompt, or a short one and a long reply.
KV_FLAGS = ["-c", "4096", "-fa", "on", "-ctk", "f16", "-ctv", "f16", "-np", "4"]
WORDS = ("river stone harbour lantern meadow copper willow thunder orchard candle glacier pepper "
         "falcon velvet canyon marble ember saddle compass tide").split()


def long_prompt(tag):
    """About 470 tokens, each prompt its own from its first word (nothing cached between them)."""
    words = [WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(80)]
    return "%s: %s." % (tag, " ".join(words))


LEARN_PROVIDER, LEARN_DECODER, IDLE, ARRIVAL = (long_prompt(t) for t in ("Alpha", "Bravo", "Charlie", "Delta"))
STREAMS = ["Stream one: count the birds.", "Stream two: name the rivers."]
STREAM_TOKENS = 900


def completion(prompt, n_predict, stream=False):
    return {"prompt": prompt, "max_tokens": n_predict, "temperature": 0, "ignore_eos": True, "stream": stream}


def start(device):
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", LLAMA] + KV_FLAGS
    env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": "1"}
    if device == "hybrid":
        # A weight of 8: the arrival waits about a second more on the provider, which two
        # streams' stall outweighs only when their worth is raised (the rule's arithmetic is
        # handoff_policy_test's; this checks the wiring: the streams counted, the log line,
        # the metrics, the replies).
        args += ["--prefill-provider", SLOW_PREFILL, "--handoff", "auto", "--stream-weight", "8"]
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=180)


def text_of(serve, prompt, n_predict):
    status, data = serve.post("/v1/completions", completion(prompt, n_predict), timeout=300)
    check(status == 200, "status %d: %s" % (status, data[:300]))
    return json.loads(data)["choices"][0]["text"]


class Stream(threading.Thread):
    """A streamed completion read chunk by chunk: `first` is set at its first text chunk."""

    def __init__(self, port, prompt):
        super().__init__(daemon=True)
        self.port, self.prompt = port, prompt
        self.first = threading.Event()
        self.done = threading.Event()
        self.text, self.error = "", None

    def run(self):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            conn.request("POST", "/v1/completions", json.dumps(completion(self.prompt, STREAM_TOKENS, True)),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            check(response.status == 200, "stream status %d" % response.status)
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    self.text += choice.get("text") or ""
                    if self.text:
                        self.first.set()
            conn.close()
        except Exception as error:  # noqa: BLE001 - reported by the test
            self.error = error
        finally:
            self.first.set()
            self.done.set()


def metric(serve, name):
    _, _, data = serve.request("GET", "/metrics")
    for line in data.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_auto_hands_off_a_long_prompt_while_other_slots_decode():
    cpu = start("cpu")
    try:
        expected = {p: text_of(cpu, p, 8) for p in (LEARN_PROVIDER, LEARN_DECODER, IDLE, ARRIVAL)}
        expected.update({p: text_of(cpu, p, STREAM_TOKENS) for p in STREAMS})
    finally:
        cpu.stop()

    serve = start("hybrid")
    try:
        got = {LEARN_PROVIDER: text_of(serve, LEARN_PROVIDER, 8)}
        serve.wait_line(r"hybrid: \d+ prompt tokens, slot \d: prefill ", 30)
        got[LEARN_DECODER] = text_of(serve, LEARN_DECODER, 8)
        serve.wait_line(r"forwarded \(uncached \d+ tokens: the decoder evaluates them, measuring its speed", 30)
        got[IDLE] = text_of(serve, IDLE, 8)
        # The decision is counted before the request goes on: its reply has it.
        check(metric(serve, 'kvshare_handoff_decisions_total{decision="forward",rule="faster"}') == 1 and
              metric(serve, "kvshare_load_handoffs_total") == 0,
              "on the idle decoder the long prompt was not forwarded as the sooner:\n%s" %
              "\n".join(serve.stderr_lines("hybrid: ")))

        streams = [Stream(serve.port, p) for p in STREAMS]
        for stream in streams:
            stream.start()
        for stream in streams:
            check(stream.first.wait(120), "a stream relayed nothing within 120 s")
            check(stream.error is None, "stream failed: %s" % stream.error)
        check(not any(s.done.is_set() for s in streams),
              "a stream ended before the long prompt arrived: raise STREAM_TOKENS")
        got[ARRIVAL] = text_of(serve, ARRIVAL, 8)
        loaded = serve.wait_count(r"handed off: 2 slots decoding", 1, 30)
        _, _, metrics = serve.request("GET", "/metrics")
        check(loaded, "the arrival was not handed off for load; the decisions:\n%s\n%s" % (
            "\n".join(line for line in metrics.decode().splitlines() if line.startswith("kvshare_handoff_decisions")),
            "\n".join(serve.stderr_lines("hybrid: ") + serve.stderr_lines("phases: "))))
        line = loaded[-1]
        check(re.search(r"\(decoder about \d+ ms would stall them, provider about \d+ ms\)$", line), line)
        for stream in streams:
            check(stream.done.wait(300), "a stream did not end within 300 s")
            check(stream.error is None, "stream failed: %s" % stream.error)
            got[stream.prompt] = stream.text
        # A stream's short prompt may be handed off for load too, when the other stream
        # decodes at its arrival and the estimates say it is worth it: each one is counted.
        n_load = len(serve.wait_count(r"handed off: \d+ slots? decoding", 1))
        check(metric(serve, "kvshare_load_handoffs_total") == n_load >= 1,
              "kvshare_load_handoffs_total is not the %d load lines" % n_load)
        check(metric(serve, 'kvshare_handoff_decisions_total{decision="handoff",rule="load"}') == n_load,
              "the decision is not counted with rule load")
        for prompt, text in expected.items():
            check(got[prompt] == text, "%r: %r, --device cpu says %r" % (prompt[:30], got[prompt][:80], text[:80]))
    finally:
        serve.stop()


def test_a_slot_capped_at_the_training_context_is_what_fits():
    # #43: llama-server caps -c at the model's training context, saying so only in its log;
    # serve trusted -c, handed a prompt past the slot to the provider, and the restore failed.
    model = os.path.join(WORK, "ctx512.gguf")
    subprocess.run([TOOLS["kvshare-mkmodel"], model, "--seed", "7", "--ctx", "512"], check=True, timeout=120,
                   capture_output=True)
    args = ["-m", model, "--device", "hybrid", "--port", "0", "--backend", LLAMA, "-c", "2048",
            "--prefill-provider", LLAMA_PREFILL, "--handoff", "always"]
    serve = Serve(TOOLS["kvshare-serve"], args, {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": ""}, timeout=180)
    try:
        serve.wait_line(r"kvshare-serve: each decoder slot holds 512 cells, not the 2048 of -c 2048 / -np 1 ")
        status, data = serve.post("/v1/completions", completion(long_prompt("Echo") * 2, 8), timeout=300)
        line = serve.wait_line(r"hybrid: \d+ prompt tokens, 0 cached: forwarded \(\d+ tokens do not fit the "
                               r"decoder's context of 512 cells", 30)
        check(not serve.stderr_lines("hybrid: fallback"), "a handoff was tried: %s" % serve.stderr_lines("hybrid: "))
        check(status in (200, 400), "the decoder's own answer, relayed: %d %s (%s)" % (status, data[:200], line))
    finally:
        serve.stop()


def main():
    run_tests(globals(), WORK)


if __name__ == "__main__":
    main()
