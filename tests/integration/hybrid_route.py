#!/usr/bin/env python3
"""hybrid_route: kvshare-serve --device hybrid against a fake decoder (fake_decoder.py,
records what reaches it) and a fake provider (fake_provider.py, copies a prepared state
file or fails each way on demand). No model, no NPU.

Checks what reaches the decoder (templating and tokenizing with add_special/parse_special,
the restore body, the file in the slot directory, id_slot 0, cache_prompt, leave_one_token),
the stderr lines, every fallback (the reply stays the decoder's own), the refused flags,
--print-backend, SSE passthrough, /metrics, the decoder's death, clean shutdown, and 32
concurrent requests with nothing left behind. What needs only a working decoder (serve's
relay of GET endpoints, SIGTERM during startup) runs against kvshare-decoder in hybrid_e2e.py.

usage: hybrid_route.py BIN_DIR
"""
import concurrent.futures
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from hybrid_common import (FAKE_DECODER, FAKE_PROVIDER, Failure, Serve, chat, check, events,
                           expected_chat_ids, expected_reply, pid_alive, read_log, state_file_bytes, temp_dir,
                           run_tests, wait_until)
import fake_decoder

BIN = os.path.abspath(sys.argv[1])
SERVE = os.path.join(BIN, "kvshare-serve")
FILE_LINE = re.compile(r"^hybrid: (\d+) prompt tokens: prefill (\d+\.\d{3}) ms, restore (\d+\.\d{3}) ms, "
                       r"first byte (\d+\.\d{3}) ms$")
WORK = temp_dir()
MODEL = os.path.join(WORK, "model.gguf")
with open(MODEL, "w") as f:
    f.write("not read by the fakes")


class Case:
    """One serve run with fresh logs."""

    def __init__(self, name, provider=True, args=None, env=None):
        self.dir = os.path.join(WORK, name)
        os.makedirs(self.dir, exist_ok=True)
        self.decoder_log = os.path.join(self.dir, "decoder.log")
        self.provider_log = os.path.join(self.dir, "provider.log")
        # serve's slot directory goes under the test's own directory: a case ends with a
        # SIGKILL, which leaves it behind, and the machine's /tmp is not the test's to fill.
        full_env = {"TMPDIR": tempfile.mkdtemp(dir=WORK), "FAKE_DECODER_LOG": self.decoder_log,
                    "FAKE_PROVIDER_LOG": self.provider_log}
        full_env.update(env or {})
        full_args = ["-m", MODEL, "--device", "hybrid", "--handoff", "always", "--port", "0", "--backend", FAKE_DECODER]
        if provider:
            full_args += ["--prefill-provider", FAKE_PROVIDER]
        self.serve = Serve(SERVE, full_args + (args or []), full_env, timeout=60)

    def decoder_start(self):
        return events(self.decoder_log, "start")[0]

    def completions(self):
        return events(self.decoder_log, "completion")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.serve.kill()


def reply_text(data):
    body = json.loads(data)
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def fallback_case(name, env, reason, body=None, args=None):
    """A handoff that fails `reason`'s way: said on stderr, forwarded as it came, reply correct."""
    text = "fallback " + name
    with Case(name, env=env, args=args) as case:
        status, data = case.serve.post("/v1/chat/completions", body or chat(text))
        check(status == 200, "status %s: %s" % (status, data))
        ids = expected_chat_ids(text)
        check(reply_text(data) == expected_reply(ids), "reply after a fallback: %s" % data)
        line = case.serve.wait_line(r"^hybrid: fallback \(%s\): " % reason)
        check("forwarding the request as it came" in line, line)
        forwarded = case.completions()[-1]["body"]
        check(forwarded == (body or chat(text)), "the request was not forwarded as it came: %s" % forwarded)
        check(not case.serve.stderr_lines("hybrid: %d prompt tokens: prefill" % len(ids)),
              "a handoff line after a fallback")
        check(os.listdir(case.decoder_start()["slot_dir"]) == [], "files left in the slot directory")
        status, _, metrics = case.serve.request("GET", "/metrics")
        check(('kvshare_fallbacks_total{reason="%s"} 1' % reason) in metrics.decode(), "metrics: no fallback count")
        return case


def test_file_route_chat():
    text = "hello there, hybrid"
    ids = expected_chat_ids(text)
    prepared = os.path.join(WORK, "prepared.state")
    with open(prepared, "wb") as f:
        f.write(state_file_bytes(ids[:-1]))
    with Case("file_route_chat", env={"FAKE_PROVIDER_COPY": prepared, "FAKE_DECODER_RESTORE_MS": "3.25"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200, "status %s" % status)
        reply = json.loads(data)
        check(reply_text(data) == expected_reply(ids), "reply %s" % data)
        check(reply["timings"]["prompt_n"] == 1, "the decoder evaluated %s tokens" % reply["timings"])
        start = case.decoder_start()
        check(start["slot_dir_mode"] == "0o700", "slot dir mode %s" % start["slot_dir_mode"])
        argv = start["argv"]
        check(argv[argv.index("-np") + 1] == "1", "-np: %s" % argv)
        check(argv[argv.index("--host") + 1] == "127.0.0.1", "--host: %s" % argv)
        check("--slot-save-path" in argv and "-fa" in argv and "-ctk" in argv and "-ctv" in argv, argv)
        posts = [e for e in read_log(case.decoder_log) if e["event"] == "post"]
        # At start serve saves the empty slot once to learn the decoder's state-file version.
        check(posts[0]["path"] == "/slots/0" and posts[0]["query"] == {"action": "save"}, "first call %s" % posts[0])
        posts = posts[1:]
        paths = [p["path"] for p in posts]
        check(paths == ["/apply-template", "/tokenize", "/slots/0", "/v1/chat/completions"],
              "calls in order: %s" % paths)
        tokenize = posts[1]["body"]
        check(tokenize["add_special"] is True and tokenize["parse_special"] is True, "tokenize %s" % tokenize)
        restore = events(case.decoder_log, "restore")[0]
        check(restore["exists"] and restore["in_slot_dir"], "restore %s" % restore)
        check(restore["body"].get("leave_one_token") is True, "restore body %s" % restore["body"])
        check(posts[2]["query"] == {"action": "restore"}, "slot action %s" % posts[2])
        forwarded = case.completions()[0]["body"]
        check(forwarded["id_slot"] == 0 and forwarded["cache_prompt"] is True and
              forwarded["leave_one_token"] is True, "forwarded %s" % forwarded)
        check(forwarded["messages"] == chat(text)["messages"], "forwarded messages changed")
        provider = read_log(case.provider_log)[0]
        check(provider["ids"] == ids[:-1], "the provider got %d ids, expected the prompt less its last (%d)" %
              (provider["n_ids"], len(ids) - 1))
        pargv = provider["argv"]
        check(pargv[0] == "--tokens" and pargv[2] == "--out" and pargv[4] == "--model" and pargv[5] == MODEL,
              "provider argv %s" % pargv)
        line = case.serve.wait_line(FILE_LINE)
        m = FILE_LINE.match(line)
        check(int(m.group(1)) == len(ids), "N in %r, expected %d" % (line, len(ids)))
        check(m.group(2) == "12.500", "prefill is the provider's own prefill_ms: %r" % line)
        check(m.group(3) == "3.250", "restore is the decoder's restore_ms: %r" % line)
        check(os.listdir(start["slot_dir"]) == [], "files left in the slot directory")


def test_provider_learns_the_decoders_state_version():
    for version in ("2", "3"):
        text = "state version %s" % version
        with Case("state_version_" + version, env={"FAKE_DECODER_STATE_VERSION": version}) as case:
            case.serve.wait_line(r"^kvshare-serve: the decoder restores state files of version %s " % version)
            status, data = case.serve.post("/v1/chat/completions", chat(text))
            check(status == 200 and reply_text(data) == expected_reply(expected_chat_ids(text)), data)
            check(json.loads(data)["timings"]["prompt_n"] == 1, "the handoff was not restored: %s" % data)
            provider = read_log(case.provider_log)[0]
            check(provider["state_version_env"] == version,
                  "the provider saw ONEBIT_HYBRID_STATE_VERSION=%s" % provider["state_version_env"])
            case.serve.wait_line(FILE_LINE)
            check(os.listdir(case.decoder_start()["slot_dir"]) == [], "the probe file was left behind")


def test_fallback_state_version_mismatch():
    # A provider that ignores ONEBIT_HYBRID_STATE_VERSION and writes version 2 for a decoder of 3:
    # serve reads the header, skips the restore the decoder would refuse without saying why.
    case = fallback_case("version_mismatch", {"FAKE_PROVIDER_STATE_VERSION": "2"}, "state_version_mismatch")
    line = case.serve.stderr_lines("hybrid: fallback (state_version_mismatch)")[0]
    check("the provider wrote state version 2" in line and "the decoder restores version 3 only" in line, line)
    check(not events(case.decoder_log, "restore"), "a restore was sent for a file of the wrong version")


def test_unknown_state_version_when_the_probe_fails():
    with Case("probe_fails", env={"FAKE_DECODER_SAVE": "fail", "FAKE_PROVIDER_STATE_VERSION": "3"}) as case:
        line = case.serve.wait_line(r"^kvshare-serve: could not learn the decoder's state-file version")
        check("answered 500" in line, line)
        text = "probe failed"
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200 and json.loads(data)["timings"]["prompt_n"] == 1, data)
        check(read_log(case.provider_log)[0]["state_version_env"] is None, "a version was set without a probe")


def test_version_mismatch_found_at_restore_names_both_versions():
    # The probe at start failed, so the provider wrote its own choice (2) and the decoder (3)
    # refused the restore with a message that names neither: serve reads the file's header,
    # probes again, names both versions and hands the next provider the decoder's.
    env = {"FAKE_DECODER_SAVE": "fail_first", "FAKE_PROVIDER_STATE_VERSION": "2"}
    with Case("mismatch_at_restore", env=env) as case:
        case.serve.wait_line(r"^kvshare-serve: could not learn the decoder's state-file version")
        text = "refused restore"
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200 and reply_text(data) == expected_reply(expected_chat_ids(text)), data)
        line = case.serve.wait_line(r"^hybrid: fallback \(state_version_mismatch\): ")
        check("answered 400" in line and "the provider wrote state version 2" in line and
              "the decoder restores version 3 only" in line, line)
        check(len(events(case.decoder_log, "restore_failed")) == 1, "the restore was not the check")
        case.serve.wait_line(r"^kvshare-serve: the decoder restores state files of version 3 \(probed after a "
                             r"refused restore\)")
        case.serve.post("/v1/chat/completions", chat("next one"))
        check([p["state_version_env"] for p in read_log(case.provider_log)] == [None, "3"],
              "the next provider was not told the version learned: %s" % read_log(case.provider_log))
        check(os.listdir(case.decoder_start()["slot_dir"]) == [], "files left in the slot directory")


def test_refused_restore_with_no_version_to_learn_names_the_files():
    env = {"FAKE_DECODER_SAVE": "fail", "FAKE_PROVIDER_STATE_VERSION": "2"}
    case = fallback_case("refused_unknown_version", env, "restore_failed")
    line = case.serve.stderr_lines("hybrid: fallback (restore_failed)")[0]
    check("the provider wrote state version 2" in line and "the decoder's version is unknown" in line, line)


def test_wall_time_when_provider_reports_none():
    text = "no prefill_ms"
    with Case("wall_time", env={"FAKE_PROVIDER_PREFILL_MS": "none"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200, data)
        m = FILE_LINE.match(case.serve.wait_line(FILE_LINE))
        check(float(m.group(2)) > 0 and m.group(2) != "12.500", "prefill should be wall time: %s" % m.group(0))


def test_completions_stream_passthrough():
    prompt = "stream me"
    ids = fake_decoder.tokenize(prompt)
    with Case("stream", env={"FAKE_DECODER_CHUNK_DELAY_MS": "150"}) as case:
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", case.serve.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        check(response.getheader("Content-Type", "").startswith("text/event-stream"),
              "content type %s" % response.getheader("Content-Type"))
        received, arrivals = b"", []
        while True:
            piece = response.read1(65536)
            if not piece:
                break
            received += piece
            arrivals.append(time.monotonic())
        conn.close()
        timings = {"cache_n": len(ids) - 1, "prompt_n": 1, "prompt_ms": 1.0, "predicted_n": 5, "predicted_ms": 1.0}
        expected = b"".join(fake_decoder.sse_chunks("/v1/completions", fake_decoder.reply_words(ids), timings))
        check(received == expected, "SSE bytes differ:\n%r\n%r" % (received, expected))
        # The decoder paused 150 ms between chunks: relayed as they came, not at the end.
        check(len(arrivals) >= 4 and arrivals[-1] - arrivals[0] > 0.4,
              "the stream arrived in %d pieces over %.3fs" % (len(arrivals), arrivals[-1] - arrivals[0]))
        case.serve.wait_line(FILE_LINE)


def test_no_provider_is_a_relay():
    text = "no provider"
    with Case("no_provider", provider=False, env={"ONEBIT_HYBRID_PREFILL": ""}) as case:
        lines = case.serve.stderr_lines("kvshare-serve: --device hybrid without a prefill provider")
        check(len(lines) == 1, "said once at start: %s" % case.serve.lines)
        for _ in range(2):
            status, data = case.serve.post("/v1/chat/completions", chat(text))
            check(status == 200 and reply_text(data) == expected_reply(expected_chat_ids(text)), data)
        check(not events(case.decoder_log, "restore"), "a relay restored something")
        check(case.completions()[0]["body"] == chat(text), "a relay changed the request")
        check(len(case.serve.stderr_lines("kvshare-serve: --device hybrid without")) == 1, "said more than once")


def test_provider_from_environment():
    text = "env provider"
    with Case("env_provider", provider=False,
              env={"ONEBIT_HYBRID_PREFILL": FAKE_PROVIDER, "ONEBIT_HYBRID_ELFS": "/opt/elfs"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200, data)
        argv = read_log(case.provider_log)[0]["argv"]
        check(argv[-2:] == ["--elfs", "/opt/elfs"], "ONEBIT_HYBRID_ELFS: provider argv %s" % argv)
        case.serve.wait_line(FILE_LINE)


def test_fallback_provider_fails():
    fallback_case("provider_fails", {"FAKE_PROVIDER_MODE": "fail"}, "provider_failed")


def test_fallback_provider_times_out():
    # 3 s: on a loaded machine a Python provider needs over a second to reach its log line.
    case = fallback_case("provider_timeout", {"FAKE_PROVIDER_MODE": "hang"}, "provider_timeout",
                         args=["--provider-timeout", "3"])
    record = read_log(case.provider_log)[0]
    wait_until(lambda: not pid_alive(record["pid"]) and not pid_alive(record["grandchild_pid"]), 5,
               "the provider or its grandchild outlived the timeout")


def test_fallback_no_state_file():
    fallback_case("no_state_file", {"FAKE_PROVIDER_MODE": "nofile"}, "no_state_file")


def test_fallback_restore_fails():
    fallback_case("restore_fails", {"FAKE_DECODER_RESTORE": "fail"}, "restore_failed")


def test_fallback_restore_short():
    case = fallback_case("restore_short", {"FAKE_DECODER_RESTORE": "short"}, "restore_short")
    paths = [(e["path"], e.get("query")) for e in read_log(case.decoder_log) if e["event"] == "post"]
    check(("/slots/0", {"action": "erase"}) in paths, "the slot was not erased after a short restore: %s" % paths)


def test_fallback_no_text_prompt():
    with Case("no_text_prompt") as case:
        body = {"prompt": [1, 20, 30, 40], "max_tokens": 4}
        status, data = case.serve.post("/v1/completions", body)
        check(status == 200 and reply_text(data) == expected_reply([1, 20, 30, 40]), data)
        case.serve.wait_line(r"^hybrid: fallback \(no_text_prompt\): ")
        check(case.completions()[0]["body"] == body, "not forwarded as it came")
        check(not read_log(case.provider_log), "the provider ran without a text prompt")


def test_prompt_not_reused_is_warned():
    with Case("not_reused", env={"FAKE_DECODER_IGNORE_CACHE": "1"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat("ignored cache"))
        check(status == 200, data)
        case.serve.wait_line(r"^hybrid: warning: the decoder evaluated \d+ prompt tokens, not 1")
        _, _, metrics = case.serve.request("GET", "/metrics")
        check("kvshare_prompt_not_reused_total 1" in metrics.decode(), "metric")


def test_metrics_count_a_file_route_handoff():
    # serve's relay of the decoder's GET endpoints is checked against a real decoder
    # (hybrid_e2e.py): the fake decoder only answers what its faults need.
    with Case("metrics") as case:
        case.serve.post("/v1/chat/completions", chat("metrics"))
        case.serve.wait_line(FILE_LINE)
        status, content_type, data = case.serve.request("GET", "/metrics")
        text = data.decode()
        check(status == 200 and content_type.startswith("text/plain"), content_type)
        for needle in ('kvshare_handoffs_total{route="file",outcome="ok"} 1',
                       'kvshare_prefill_ms_count{route="file"} 1', 'kvshare_handoff_ms_count{route="file"} 1',
                       'kvshare_first_byte_ms_count{route="file"} 1', "# TYPE kvshare_first_byte_ms histogram",
                       'kvshare_prefill_ms_bucket{route="file",le="25"} 1'):
            check(needle in text, "metrics lack %r:\n%s" % (needle, text))


def test_a_prompt_past_the_decoders_slot_context_goes_straight_to_it():
    # #43: llama-server caps -c at the model's training context and serve trusted -c: a
    # prompt was handed off past the slot's real context, and the restore failed.
    text = "a prompt longer than the slot the decoder really has, whatever -c says"
    ids = expected_chat_ids(text)
    with Case("slot_context", env={"FAKE_DECODER_SLOT_CTX": "48"}, args=["-c", "8192"]) as case:
        case.serve.wait_line(r"^kvshare-serve: each decoder slot holds 48 cells, not the 8192 of -c 8192 / -np 1 ")
        status, data = case.serve.post("/v1/chat/completions", chat(text))
        check(status == 200 and reply_text(data) == expected_reply(ids), "reply %s %s" % (status, data))
        line = case.serve.wait_line(r"^hybrid: %d prompt tokens, 0 cached: forwarded \(" % len(ids))
        check("%d tokens do not fit the decoder's context of 48 cells" % len(ids) in line, line)
        check(not events(case.decoder_log, "restore"), "a restore past the slot's context")
        check(not read_log(case.provider_log), "a provider ran for a prompt that cannot fit")
        _, _, metrics = case.serve.request("GET", "/metrics")
        check('kvshare_handoff_decisions_total{decision="forward",rule="too_long"} 1' in metrics.decode(),
              "metrics: no too_long decision")


def test_a_decoder_without_props_leaves_the_context_to_c():
    with Case("slot_context_unknown") as case:
        line = case.serve.wait_line(r"^kvshare-serve: could not learn the decoder's slot context ")
        check("GET /props answered 404" in line and "assumes -c / -np, 4096 cells" in line, line)


def test_refused_flags():
    for flags, name in ((["--parallel", "0"], "--parallel 0"), (["-np", "300"], "--parallel 300"), (["--mtp"], "--mtp"),
                        (["--dflash"], "--dflash"), (["--mmproj", "x.gguf"], "--mmproj"),
                        (["--moe-slots", "2"], "--moe-slots"), (["--embedding"], "--embedding"),
                        (["--reranking"], "--reranking"), (["--pm", "x"], "--pm"), (["--", "-np", "2"], "-np 2"),
                        (["--", "--mtp"], "--mtp")):
        result = subprocess.run([SERVE, "-m", MODEL, "--backend", FAKE_DECODER] + flags, capture_output=True,
                                timeout=20, text=True)
        check(result.returncode == 2, "%s: exit %d, expected 2 (%s)" % (flags, result.returncode, result.stderr))
        check(name in result.stderr and ("refused" in result.stderr or "expected 1..256" in result.stderr),
              "%s: message %r" % (flags, result.stderr))


def test_handoff_flag_values_and_help():
    for value in ("sometimes", "0", "-5", "12x", ""):
        result = subprocess.run([SERVE, "-m", MODEL, "--backend", FAKE_DECODER, "--handoff", value],
                                capture_output=True, timeout=20, text=True)
        check(result.returncode == 2, "--handoff %r: exit %d, expected 2 (%s)" % (value, result.returncode,
                                                                                 result.stderr))
        check("--handoff" in result.stderr and "auto, always, never" in result.stderr,
              "--handoff %r: message %r" % (value, result.stderr))
    for value in ("-1", "nan", "inf"):
        result = subprocess.run([SERVE, "-m", MODEL, "--backend", FAKE_DECODER, "--stream-weight", value],
                                capture_output=True, timeout=20, text=True)
        check(result.returncode == 2 and "--stream-weight" in result.stderr,
              "--stream-weight %s: exit %d (%s)" % (value, result.returncode, result.stderr))
    result = subprocess.run([SERVE, "--help"], capture_output=True, timeout=20, text=True)
    check(result.returncode == 0 and "--handoff" in result.stdout and "auto" in result.stdout, result.stdout)
    check("--stream-weight" in result.stdout, result.stdout)


def test_print_backend():
    result = subprocess.run([SERVE, "-m", MODEL, "--backend", FAKE_DECODER, "--print-backend", "-c", "2048",
                             "--", "--threads", "2"], capture_output=True, timeout=20, text=True)
    check(result.returncode == 0, result.stderr)
    line = result.stdout.strip()
    for needle in (FAKE_DECODER, "-m " + MODEL, "-np 1", "--slot-save-path", "-c 2048", "-fa auto", "-ctk f16",
                   "--host 127.0.0.1", "--port", "--threads 2"):
        check(needle in line, "--print-backend lacks %r: %s" % (needle, line))
    # Without --backend: llama-server on PATH, the decoder of record.
    bin_dir = os.path.join(WORK, "pathbin")
    os.makedirs(bin_dir, exist_ok=True)
    fake_llama = os.path.join(bin_dir, "llama-server")
    shutil.copy(FAKE_DECODER, fake_llama)
    os.chmod(fake_llama, 0o755)
    result = subprocess.run([SERVE, "-m", MODEL, "--print-backend"], capture_output=True, timeout=20, text=True,
                            env=dict(os.environ, PATH=bin_dir))
    check(result.returncode == 0 and result.stdout.startswith(fake_llama + " "), "PATH llama-server: %r %r" %
          (result.stdout, result.stderr))
    result = subprocess.run([SERVE, "-m", MODEL, "--print-backend"], capture_output=True, timeout=20, text=True,
                            env=dict(os.environ, PATH=os.path.join(WORK, "empty")))
    # None on PATH: serve refuses to start and says how to get one; the reference decoder
    # beside it is named, never run unasked (issue #25).
    decoder = os.path.join(BIN, "kvshare-decoder")
    check(result.returncode == 1 and not result.stdout and "no llama-server on PATH" in result.stderr and
          "scripts/build-llama-server.sh --with-kvshare" in result.stderr and "--backend " + decoder in result.stderr,
          "no llama-server on PATH: exit %s, stdout %r, stderr %r" % (result.returncode, result.stdout, result.stderr))


def test_decoder_death_stops_serve():
    with Case("decoder_death", env={"FAKE_DECODER_EXIT_AFTER": "1"}) as case:
        status, data = case.serve.post("/v1/chat/completions", chat("last words"))
        check(status == 200, data)
        code = case.serve.wait_exit(20)
        check(code == 1, "exit code %s after the decoder died" % code)
        case.serve.wait_line(r"the decoder exited \(exit code 3\); it is not restarted")
        check(not os.path.exists(case.decoder_start()["slot_dir"]), "slot directory left behind")


def test_sigterm_stops_everything():
    with Case("sigterm") as case:
        start = case.decoder_start()
        code = case.serve.stop(signal.SIGTERM)
        check(code == 0, "exit code %s after SIGTERM" % code)
        wait_until(lambda: not pid_alive(start["pid"]), 5, "the decoder outlived serve")
        check(not os.path.exists(start["slot_dir"]), "slot directory left behind")


def test_decoder_not_ready_in_time_is_clear():
    # A backend that exits at once: serve says so, naming the command, and exits 1.
    result = subprocess.run([SERVE, "-m", MODEL, "--backend", "/bin/false", "--port", "0"], capture_output=True,
                            timeout=30, text=True)
    check(result.returncode == 1 and "the decoder exited before it was ready" in result.stderr and
          "/bin/false" in result.stderr, "%d %r" % (result.returncode, result.stderr))


def test_concurrent_requests():
    n = 32
    with Case("concurrent", env={"FAKE_DECODER_CHUNK_DELAY_MS": "5"}) as case:
        serve_pid = case.serve.proc.pid
        fds_before = len(os.listdir("/proc/%d/fd" % serve_pid))
        texts = ["concurrent request %d %s" % (i, "x" * i) for i in range(n)]

        def one(i):
            stream = i % 2 == 1
            body = dict(chat(texts[i]), stream=stream)
            status, data = case.serve.post("/v1/chat/completions", body, timeout=120)
            return i, status, data

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
        for i, status, data in results:
            check(status == 200, "request %d: status %d" % (i, status))
            ids = expected_chat_ids(texts[i])
            if i % 2 == 1:
                text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                               for line in data.decode().split("\n\n") if line.startswith("data: {"))
            else:
                text = reply_text(data)
            check(text == expected_reply(ids), "request %d got %r" % (i, text))
        lines = case.serve.wait_count(FILE_LINE, n)
        check(len(lines) == n, "%d handoff lines for %d requests:\n%s" % (len(lines), n, "\n".join(case.serve.lines)))
        check(len(events(case.decoder_log, "restore")) == n, "each request gets its own restore")
        not_one = [c for c in case.completions() if c["prompt_n"] != 1]
        check(not not_one, "%d requests re-evaluated their prompt: %s" % (len(not_one), not_one[:2]))
        check(os.listdir(case.decoder_start()["slot_dir"]) == [], "files left in the slot directory")
        # Other clients' connections were open while each provider ran: none may reach it.
        inherited = [p["fds_at_start"] for p in read_log(case.provider_log)
                     if sorted(int(fd) for fd in p["fds_at_start"]) != [0, 1, 2]]
        check(not inherited, "file-route providers inherited more than 0-2: %s" % inherited[:2])
        wait_until(lambda: len(os.listdir("/proc/%d/fd" % serve_pid)) <= fds_before, 5,
                   "serve holds more fds after the requests (%d before)" % fds_before)


def main():
    run_tests(globals(), WORK)


if __name__ == "__main__":
    main()
