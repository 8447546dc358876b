#!/usr/bin/env python3
"""hybrid_kvshare_route: kvshare-serve's shared route (ONEBIT_KV_SHARE=1) against the fake
decoder speaking ?action=share/?action=adopt and sending REAL fds (memfds, SCM_RIGHTS via
socket.send_fds) in the handshake frame of docs/protocol.md, and the fake provider checking
what it inherited. No model, no dma-buf.

Checks the listen -> share -> fds -> provider -> adopt order, the inherited descriptors
(only the region fds, at the numbers --fds names), the share_id on adopt, the socket's
private directory and its cleanup, a slow provider's work kept (adopted, not thrown away),
the fallbacks (a decoder that refuses to share, or whose message on the socket is not the
share it answered (an earlier share's message replayed) -> the state-file route for that request;
a provider or an adopt that fails -> forwarded as it came, never the file route), and the
shared log line.

usage: hybrid_kvshare_route.py BIN_DIR
"""
import json
import os
import re
import sys
import tempfile

from hybrid_common import (FAKE_DECODER, FAKE_PROVIDER, HERE, Serve, chat, check, events,
                           expected_chat_ids, expected_reply, read_log, run_tests, temp_dir)

BIN = os.path.abspath(sys.argv[1])
SERVE = os.path.join(BIN, "kvshare-serve")
HEADER = os.path.join(HERE, "..", "data", "layout-example.json")
SHARED_LINE = re.compile(r"^hybrid: (\d+) prompt tokens(?:, \d+ cached)?: prefill (\d+\.\d{3}) ms(?: of \d+ tokens)?, share (\d+\.\d{3}) ms, "
                         r"first byte (\d+\.\d{3}) ms$")
FELL_BACK_LINE = re.compile(r"^hybrid: (\d+) prompt tokens(?:, \d+ cached)?: prefill (\d+\.\d{3}) ms(?: of \d+ tokens)?, share 0\.000 ms, "
                            r"restore (\d+\.\d{3}) ms, first byte (\d+\.\d{3}) ms$")
WORK = temp_dir()
MODEL = os.path.join(WORK, "model.gguf")
with open(MODEL, "w") as f:
    f.write("not read by the fakes")


class Case:
    def __init__(self, name, env=None, args=None):
        self.dir = os.path.join(WORK, name)
        os.makedirs(self.dir, exist_ok=True)
        self.decoder_log = os.path.join(self.dir, "decoder.log")
        self.provider_log = os.path.join(self.dir, "provider.log")
        # serve's slot directory goes under the test's own directory: a case ends with a
        # SIGKILL, which leaves it behind, and the machine's /tmp is not the test's to fill.
        full_env = {"TMPDIR": tempfile.mkdtemp(dir=WORK), "FAKE_DECODER_LOG": self.decoder_log,
                    "FAKE_PROVIDER_LOG": self.provider_log,
                    "ONEBIT_KV_SHARE": "1", "FAKE_DECODER_SHARE_HEADER": HEADER}
        full_env.update(env or {})
        self.serve = Serve(SERVE, ["-m", MODEL, "--device", "hybrid", "--handoff", "always", "--port", "0", "--backend", FAKE_DECODER,
                                   "--prefill-provider", FAKE_PROVIDER] + (args or []), full_env, timeout=60)

    def log(self):
        return read_log(self.decoder_log)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.serve.kill()


def reply_of(data):
    return json.loads(data)["choices"][0]["message"]["content"]


def test_shared_route_order_fds_share_id_and_cleanup():
    header = json.load(open(HEADER))
    with Case("shared") as case:
        texts = ["first shared prompt", "second shared prompt"]
        for text in texts:
            status, data = case.serve.post("/v1/chat/completions", chat(text))
            check(status == 200, data)
            check(reply_of(data) == expected_reply(expected_chat_ids(text)), "reply %s" % data)
            check(json.loads(data)["timings"]["prompt_n"] == 1, "prompt_n %s" % data)
        start = events(case.decoder_log, "start")[0]
        check(start["kv_share"] == "1", "the decoder did not inherit ONEBIT_KV_SHARE: %s" % start)
        log = case.log()
        providers = read_log(case.provider_log)
        check(len(providers) == 2, "%d provider runs" % len(providers))
        for n, (text, provider) in enumerate(zip(texts, providers), start=1):
            share_post = [e for e in log if e["event"] == "post" and e.get("query") == {"action": "share"}][n - 1]
            connected = [e for e in log if e["event"] == "share_connected"][n - 1]
            sent = [e for e in log if e["event"] == "share_sent"][n - 1]
            adopt = [e for e in log if e["event"] == "adopt"][n - 1]
            # listen -> share -> fds -> provider -> adopt
            check(share_post["t"] <= connected["t"] <= sent["t"] < provider["t_start"] < provider["t_end"] <
                  adopt["t"], "order broken in request %d" % n)
            check(connected["socket_dir_mode"] == "0o700", "socket directory mode %s" % connected["socket_dir_mode"])
            # The socket lives in serve's own 0700 slot directory, which stays for serve's
            # life; the socket itself is gone with its request.
            check(not os.path.exists(connected["socket"]), "socket %s left behind" % connected["socket"])
            check(os.path.basename(os.path.dirname(connected["socket"])).startswith("kvshare-serve-slots"),
                  "socket %s is not in serve's slot directory" % connected["socket"])
            # inherited descriptors: exactly the region's, at the numbers --fds names
            argv = provider["argv"]
            check("--layout" in argv and "--fds" in argv and "--out" not in argv, "provider argv %s" % argv)
            numbers = [int(x) for x in argv[argv.index("--fds") + 1].split(",")]
            check(len(numbers) == len(header["chunks"]), "--fds %s for %d chunks" % (numbers, len(header["chunks"])))
            for number, chunk in zip(numbers, header["chunks"]):
                fd = provider["fd_checks"][str(number)]
                check(fd["open"] and fd["memfd"] and fd["size"] >= chunk["size_bytes"], "fd %d: %s" % (number, fd))
            check(provider["other_fds"] == [], "the provider inherited more: %s" % provider["fds_at_start"])
            check(provider["layout_header"]["chunks"] == header["chunks"], "--layout file differs from the header")
            ids = expected_chat_ids(text)
            check(provider["ids"] == ids[:-1], "the provider got the prompt less its last token")
            # share_id on adopt, and the bytes the provider wrote are what was adopted
            check(adopt["share_id"] == n and adopt["body"]["share_id"] == n, "adopt share_id %s" % adopt)
            check(adopt["body"]["tokens"] == ids[:-1], "adopt tokens")
            check(adopt["region_holds_tokens"], "the region does not hold what the provider wrote")
        check(not events(case.decoder_log, "restore"), "a shared handoff also restored a file")
        forwarded = events(case.decoder_log, "completion")[-1]["body"]
        check(forwarded["id_slot"] == 0 and forwarded["cache_prompt"] is True and forwarded["leave_one_token"] is True,
              "forwarded %s" % forwarded)
        lines = case.serve.wait_count(SHARED_LINE, 2)
        check(len(lines) == 2, "shared lines:\n%s" % "\n".join(case.serve.lines))
        m = SHARED_LINE.match(lines[0])
        check(int(m.group(1)) == len(expected_chat_ids(texts[0])) and m.group(2) == "12.500" and
              m.group(3) == "0.750", "line %r (share 0.5 + adopt 0.25 from the decoder's timings)" % lines[0])
        check(os.listdir(start["slot_dir"]) == [], "files left in the slot directory")
        _, _, metrics = case.serve.request("GET", "/metrics")
        check('kvshare_handoffs_total{route="shared",outcome="ok"} 2' in metrics.decode(), "metrics")


def test_slow_provider_work_is_kept():
    text = "a slow provider"
    with Case("slow", env={"FAKE_PROVIDER_MODE": "slow", "FAKE_PROVIDER_SLEEP_MS": "1500"},
              args=["--provider-timeout", "20"]) as case:
        status, data = case.serve.post("/v1/chat/completions", chat(text), timeout=60)
        check(status == 200 and reply_of(data) == expected_reply(expected_chat_ids(text)), data)
        adopt = events(case.decoder_log, "adopt")
        check(len(adopt) == 1 and adopt[0]["region_holds_tokens"], "the slow provider's work was not adopted")
        check(json.loads(data)["timings"]["prompt_n"] == 1, "prompt re-evaluated after a slow provider")
        case.serve.wait_line(SHARED_LINE)


def test_refused_share_takes_the_state_file_route():
    with Case("refused", env={"FAKE_DECODER_REFUSE_SHARE": "1"}) as case:
        # Two prompts: the same one again would be all cached, and forwarded.
        for text in ("a decoder that cannot export", "another decoder that cannot export"):
            status, data = case.serve.post("/v1/chat/completions", chat(text))
            check(status == 200 and reply_of(data) == expected_reply(expected_chat_ids(text)), data)
        refusals = case.serve.wait_count(r"^hybrid: shared route not taken \(share_refused\)", 2)
        check(len(refusals) == 2 and "state-file route" in refusals[0], "said once per request: %s" % refusals)
        lines = case.serve.wait_count(FELL_BACK_LINE, 2)
        check(len(lines) == 2, "fell-back lines:\n%s" % "\n".join(case.serve.lines))
        check(len(events(case.decoder_log, "restore")) == 2, "the state file did not carry the handoff")
        check(not events(case.decoder_log, "adopt"), "adopt after a refused share")
        check(not [p for p in read_log(case.provider_log) if "--fds" in p["argv"]], "shared provider ran")
        _, _, metrics = case.serve.request("GET", "/metrics")
        text = metrics.decode()
        check('kvshare_handoffs_total{route="shared",outcome="file_fallback"} 2' in text and
              'kvshare_handoffs_total{route="file",outcome="ok"} 2' in text, text)


def test_a_handshake_that_fails_before_the_provider_takes_the_state_file_route():
    text = "unsealed fds"
    with Case("bad_handshake", env={"FAKE_DECODER_UNSEALED": "1"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200 and reply_of(data) == expected_reply(expected_chat_ids(text)), data)
        line = case.serve.wait_line(r"^hybrid: shared route not taken \(handshake_failed\)")
        check("sealed" in line, "the reason names the fd check: %s" % line)
        case.serve.wait_line(FELL_BACK_LINE)
        check(not [p for p in read_log(case.provider_log) if "--fds" in p["argv"]], "shared provider ran")
        check(len(events(case.decoder_log, "restore")) == 1, "the state file did not carry the handoff")
        connected = events(case.decoder_log, "share_connected")[0]
        check(not os.path.exists(connected["socket"]), "socket %s left behind" % connected["socket"])


def test_a_replayed_share_message_is_never_handed_to_the_provider():
    # The second share's message on the socket carries the first share's id (its message
    # replayed): serve must not give those fds to a provider nor adopt; the file route
    # carries the prompt. A reply without a share_id cannot be matched: the same.
    for mode, words in (("replay", "the share reply says share_id 2, the message on the socket says 1"),
                        ("no_id", "the share reply has no share_id to match the message on the socket")):
        texts = ["first prompt before the replay", "second prompt, replayed share"]
        with Case("share_" + mode, env={"FAKE_DECODER_SHARE": mode}) as case:
            for text in texts if mode == "replay" else texts[1:]:
                status, data = case.serve.post("/v1/chat/completions", chat(text))
                check(status == 200 and reply_of(data) == expected_reply(expected_chat_ids(text)), data)
            line = case.serve.wait_line(r"^hybrid: shared route not taken \(handshake_failed\)")
            check(words in line, "%s: the reason names the mismatch: %s" % (mode, line))
            case.serve.wait_line(FELL_BACK_LINE)
            shared_runs = [p for p in read_log(case.provider_log) if "--fds" in p["argv"]]
            check(len(shared_runs) == (1 if mode == "replay" else 0), "%s: shared provider runs %d" %
                  (mode, len(shared_runs)))
            adopts = events(case.decoder_log, "adopt")
            check([a["share_id"] for a in adopts] == ([1] if mode == "replay" else []), "%s: adopts %s" % (mode, adopts))
            check(len(events(case.decoder_log, "restore")) == 1, "%s: the state file did not carry the prompt" % mode)


def test_failed_provider_forwards_never_the_file_route():
    text = "provider fails after the share"
    with Case("provider_fails", env={"FAKE_PROVIDER_MODE": "fail"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200 and reply_of(data) == expected_reply(expected_chat_ids(text)), data)
        case.serve.wait_line(r"^hybrid: fallback \(provider_failed\)")
        check(not events(case.decoder_log, "restore"), "fell back to the file route after the provider started")
        check(not events(case.decoder_log, "adopt"), "adopted after a failed provider")
        posts = [(e["path"], e.get("query")) for e in case.log() if e["event"] == "post"]
        check(("/slots/0", {"action": "erase"}) in posts, "the slot was not erased: %s" % posts)
        check(events(case.decoder_log, "completion")[0]["body"] == chat(text), "not forwarded as it came")


def test_failed_adopt_forwards_as_it_came():
    text = "adopt fails"
    with Case("adopt_fails", env={"FAKE_DECODER_ADOPT": "fail"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200 and reply_of(data) == expected_reply(expected_chat_ids(text)), data)
        case.serve.wait_line(r"^hybrid: fallback \(adopt_failed\)")
        check(not events(case.decoder_log, "restore"), "fell back to the file route after a failed adopt")
        check(events(case.decoder_log, "completion")[0]["body"] == chat(text), "not forwarded as it came")


def main():
    run_tests(globals(), WORK)


if __name__ == "__main__":
    main()
