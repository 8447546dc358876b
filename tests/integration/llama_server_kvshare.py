#!/usr/bin/env python3
"""llama_server_kvshare: the shared route with the real decoder, a llama-server built with
the patch series of integrations/llama.cpp (LLAMA_SERVER_KVSHARE=path; skipped, exit 77,
without it). The provider is llama-kvshare-prefill from the same build (beside the server,
or LLAMA_KVSHARE_PREFILL=path) and, for the reference pair's provider, kvshare-prefill.

- ONEBIT_KV_SHARE=1, --device hybrid: the greedy reply equals --device cpu on the same
  server (flag unset), streamed and not; timings.prompt_n is 1; the log line has share Y ms;
  no fallback, no state file; with llama-kvshare-prefill the decoder's KV after the handoff
  equals its own prefill exactly (the same llama.cpp computed both);
- the flag unset: share answers 501 naming ONEBIT_KV_SHARE, and serve keeps the file route;
- the flag set but no export possible: the server starts, share answers 501 naming why;
- refusals on the real server: stale and reused share_id, too many tokens, an id outside
  the vocabulary (400), a share to nobody (500, its id not adoptable);
- kvshare-serve --api-key: clients without the key get 401 and start no handoff; with it
  the shared route runs (the server got the key through the environment); the server's
  share and adopt without the key are 401 and no broker is contacted;
- 32 concurrent requests through the shared route: every reply right, nothing left behind;
- the shared route's fallbacks with the real server: a provider that refuses the server's
  header (one field altered) and a provider that scribbles over the shared cache and dies
  are both forwarded to the erased slot (or with cache_prompt false): the reply is still
  --device cpu's, no adopt, and the provider's reason is on serve's stderr.

usage: llama_server_kvshare.py BIN_DIR
"""
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import hybrid_common
from hybrid_common import (DECODER_RE, SHARED_LINE, llama_kvshare_prefill, Serve, chat_reply_of, check, run_tests,
                           temp_dir, wait_until)

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP llama_server_kvshare: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
LLAMA_PREFILL = llama_kvshare_prefill(LLAMA)
TOOLS = {name: os.path.join(BIN, name) for name in ("kvshare-serve", "kvshare-prefill", "kvshare-mkmodel",
                                                    "kvshare-state")}
missing = [name for name, path in TOOLS.items() if not os.access(path, os.X_OK)]
if missing:
    print("SKIP llama_server_kvshare: %s not built" % ", ".join(missing))
    sys.exit(77)

WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
subprocess.run([TOOLS["kvshare-mkmodel"], MODEL, "--seed", "7", "--residual-gain", "3"], check=True, timeout=120,
               capture_output=True)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
KV_FLAGS = ["-c", "1024", "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
FILE_LINE = re.compile(r"hybrid: (\d+) prompt tokens: prefill \d+\.\d{3} ms, (share 0\.000 ms, )?restore "
                       r"\d+\.\d{3} ms, first byte \d+\.\d{3} ms$")
PROMPTS = ["Tell me about the sea.", "Write one line of code.",
           "A longer prompt, so that the handoff carries a few dozen tokens of KV: " + "words " * 20]
CPU_REPLIES = {}


def request(text, stream=False):
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
            "max_tokens": 8, "temperature": 0, "stream": stream}


def concurrency_prompts():
    return ["request number %d: %s" % (i, "go " * (i % 7)) for i in range(32)]


def start(device, kv_share=False, provider=None, extra_env=None, n_ctx=None, extra_args=None):
    kv_flags = KV_FLAGS if n_ctx is None else ["-c", str(n_ctx)] + KV_FLAGS[2:]
    args = ["-m", MODEL, "--device", device, "--port", "0", "--backend", LLAMA] + kv_flags
    env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": "1" if kv_share else None}
    if device == "hybrid":
        # Every prompt here is short: the test is of the handoff, which auto would skip.
        args += ["--prefill-provider", provider or TOOLS["kvshare-prefill"], "--handoff", "always"]
    args += extra_args or []  # last: may hold "--" and the decoder's own flags
    env.update(extra_env or {})
    return Serve(TOOLS["kvshare-serve"], args, env, timeout=180)


def replies(serve, prompts, stream=False):
    return [chat_reply_of(*serve.post("/v1/chat/completions", request(p, stream), timeout=180), stream) for p in prompts]


def decoder_port(serve):
    return int(DECODER_RE.search(serve.wait_line(DECODER_RE, timeout=60)).group(1))


def decoder_post(port, path, body, timeout=60, key=None):
    """Talks to the llama-server child directly (serve's own API has no slot actions)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    conn.request("POST", path, body=body if isinstance(body, str) else json.dumps(body), headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data) if data.startswith(b"{") else data


def save_slot(serve, name):
    status, body = decoder_post(decoder_port(serve), "/slots/0?action=save", {"filename": name})
    check(status == 200, "save: %s" % body)
    slot_dirs = [d for d in os.listdir(SERVE_TMP) if d.startswith("kvshare-serve-slots")]
    check(len(slot_dirs) == 1, "slot dirs %s" % slot_dirs)
    out = os.path.join(WORK, name)
    shutil.move(os.path.join(SERVE_TMP, slot_dirs[0], name), out)
    return out


def baseline():
    serve = start("cpu")
    try:
        out = {p: replies(serve, [p])[0][0] for p in PROMPTS + concurrency_prompts()}
        replies(serve, PROMPTS[:1])
        save_slot(serve, "cpu-own-prefill.state")
        return out
    finally:
        serve.stop()


def check_shared_route(provider, kv_tolerance):
    serve = start("hybrid", kv_share=True, provider=provider)
    try:
        for stream in (False, True):
            for prompt, (text, prompt_n) in zip(PROMPTS, replies(serve, PROMPTS, stream)):
                check(text == CPU_REPLIES[prompt], "shared reply %r differs from --device cpu %r (stream=%s)" %
                      (text, CPU_REPLIES[prompt], stream))
                check(prompt_n == 1, "prompt_n %s, expected 1 (stream=%s)" % (prompt_n, stream))
        # The strong check: after the handoff and the reply, the cache equals the cache the
        # server holds after prefilling the same prompt itself.
        replies(serve, PROMPTS[:1])
        handed = save_slot(serve, "shared-handoff.state")
        result = subprocess.run([TOOLS["kvshare-state"], "diff", handed, os.path.join(WORK, "cpu-own-prefill.state"),
                                 "--tolerance", str(kv_tolerance)], capture_output=True, text=True, timeout=60)
        check(result.returncode == 0, "the handed-over KV differs from llama-server's own prefill:\n%s%s" %
              (result.stdout, result.stderr))
        lines = serve.wait_count(SHARED_LINE, 2 * len(PROMPTS) + 1)
        check(len(lines) == 2 * len(PROMPTS) + 1, "shared handoff lines:\n%s" % "\n".join(serve.lines))
        check(not [line for line in serve.lines if "hybrid: fallback" in line or "shared route not taken" in line],
              "fallbacks:\n%s" % "\n".join(serve.lines))
        for line in lines:
            print("  " + line)
    finally:
        code = serve.stop()
    check(code == 0, "serve exit code %d" % code)
    check(os.listdir(SERVE_TMP) == [], "left behind in TMPDIR: %s" % os.listdir(SERVE_TMP))
    return list(serve.lines)


def test_shared_route_with_llama_kvshare_prefill_hands_over_the_decoders_own_kv():
    if not os.access(LLAMA_PREFILL, os.X_OK):
        print("SKIP: no llama-kvshare-prefill at %s (set LLAMA_KVSHARE_PREFILL)" % LLAMA_PREFILL)
        return
    lines = check_shared_route(LLAMA_PREFILL, 0)
    # Each prefill mapped in the cells it wrote before decoding (llama_kvshare_provider_prepare),
    # instead of faulting in one 4 KiB page at a time through its fresh mapping.
    mapped = [line for line in lines if re.search(r"llama-kvshare-prefill: shared route, \d+ tokens, \d+\.\d MiB of "
                                                  r"the decoder's cells mapped in before the prefill", line)]
    provider_lines = [line for line in lines if "llama-kvshare-prefill: " in line]
    check(mapped and len(mapped) == len([line for line in provider_lines if "shared route" in line]),
          "not every shared prefill mapped in its cells:\n%s" % "\n".join(provider_lines))


def test_shared_route_with_the_reference_provider_matches_cpu():
    # kvshare-prefill computes on refmodel: the same function, f16 rounding apart.
    check_shared_route(TOOLS["kvshare-prefill"], 0.01)


def test_without_the_flag_share_is_501_and_the_file_route_is_taken():
    serve = start("hybrid", kv_share=False)
    try:
        status, body = decoder_post(decoder_port(serve), "/slots/0?action=share", {"socket": "/nonexistent.sock"})
        check(status == 501, "share without the flag: %s %s" % (status, body))
        check("ONEBIT_KV_SHARE" in body["error"]["message"] and body["error"]["type"] == "not_supported_error",
              "501 body %s" % body)
        for prompt, (text, prompt_n) in zip(PROMPTS, replies(serve, PROMPTS)):
            check(text == CPU_REPLIES[prompt] and prompt_n == 1, "file route: %r prompt_n %s" % (text, prompt_n))
        check(len(serve.wait_count(FILE_LINE, len(PROMPTS))) == len(PROMPTS), "\n".join(serve.lines))
    finally:
        serve.stop()


def test_a_cache_that_cannot_be_exported_degrades_to_501_and_the_file_route():
    # KVSHARE_EXPORT names no backend: kvshare cannot export, the server must start anyway.
    serve = start("hybrid", kv_share=True, extra_env={"KVSHARE_EXPORT": "nonesuch"})
    try:
        status, body = decoder_post(decoder_port(serve), "/slots/0?action=share", {"socket": "/nonexistent.sock"})
        check(status == 501, "share with no export: %s %s" % (status, body))
        check("KVSHARE_EXPORT" in body["error"]["message"], "501 names the cause: %s" % body)
        for prompt, (text, prompt_n) in zip(PROMPTS, replies(serve, PROMPTS)):
            check(text == CPU_REPLIES[prompt] and prompt_n == 1, "after the degrade: %r prompt_n %s" % (text, prompt_n))
    finally:
        serve.stop()


def broker_socket(name):
    """A listening AF_UNIX socket in a fresh directory of WORK, standing in for a broker: the
    socket and its path."""
    sock_path = os.path.join(tempfile.mkdtemp(dir=WORK), name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(1)
    return listener, sock_path


def receive_the_share(listener, n_fds):
    """Takes the one share message the server sends to `listener` (then closed), checks it
    carries the `n_fds` descriptors the share reply announced, and closes them."""
    conn, _ = listener.accept()
    _, fds, _, _ = socket.recv_fds(conn, 1 << 20, 16)
    conn.close()
    listener.close()
    check(len(fds) == n_fds, "%d fds for n_fds %d" % (len(fds), n_fds))
    for fd in fds:
        os.close(fd)


def test_the_real_server_refuses_what_kvshare_decoder_refuses():
    serve = start("hybrid", kv_share=True)
    try:
        port = decoder_port(serve)
        status, body = decoder_post(port, "/slots/0?action=share", "not json")
        check(status == 400, "share with a body that is not JSON: %s %s" % (status, body))
        status, body = decoder_post(port, "/slots/0?action=share", {"socket": ""})
        check(status == 400 and "socket" in body["error"]["message"], "share without a socket: %s %s" % (status, body))
        status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1, 2]})
        check(status == 400 and "share_id" in body["error"]["message"], "adopt without share_id: %s" % body)

        # A share that reaches a broker: listen, share, take the message, then adopt.
        listener, sock_path = broker_socket("broker.sock")
        status, shared = decoder_post(port, "/slots/0?action=share", {"socket": sock_path})
        check(status == 200, "share: %s %s" % (status, shared))
        check(list(shared) == ["id_slot", "share_id", "stream", "backend", "n_fds", "region_bytes", "n_cached", "timings"],
              "share reply keys %s" % list(shared))
        receive_the_share(listener, shared["n_fds"])
        share_id = shared["share_id"]
        status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1, 2, 3], "share_id": share_id + 1})
        check(status == 400, "adopt of a share_id never given: %s %s" % (status, body))
        status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1] * 1024, "share_id": share_id})
        check(status == 400 and "do not fit" in body["error"]["message"], "too many tokens: %s %s" % (status, body))
        status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [10 ** 6], "share_id": share_id})
        check(status == 400 and "vocabulary" in body["error"]["message"], "id outside the vocabulary: %s" % body)
        status, adopted = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1, 2, 3], "share_id": share_id})
        check(status == 200 and adopted["n_adopted"] == 3, "adopt: %s %s" % (status, adopted))
        check(list(adopted) == ["id_slot", "share_id", "n_adopted", "timings"], "adopt reply keys %s" % list(adopted))
        status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1, 2, 3], "share_id": share_id})
        check(status == 400 and "already adopted" in body["error"]["message"], "reused share_id: %s" % body)

        # A share nobody receives: 500 naming the socket, and its id is not adoptable.
        status, body = decoder_post(port, "/slots/0?action=share", {"socket": os.path.join(WORK, "nobody.sock")})
        check(status == 500 and "nobody.sock" in body["error"]["message"], "share to nobody: %s %s" % (status, body))
        status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1, 2, 3], "share_id": share_id + 1})
        check(status == 400, "adopt of a share that never reached a broker: %s %s" % (status, body))
    finally:
        serve.stop()


def test_serves_api_key_guards_its_clients_and_the_real_servers_share():
    """kvshare-serve --api-key: a client without the key is refused (401) before any
    handoff; with it the shared route runs, so the patched llama-server got the key (through
    LLAMA_API_KEY, never its command line) and serve sent it with share and adopt; the
    server's own share and adopt refuse a caller without it, and no broker hears of it."""
    key = "serve-key-14"
    serve = start("hybrid", kv_share=True, extra_args=["--api-key", key])
    try:
        port = decoder_port(serve)
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(request(PROMPTS[0])),
                         headers=dict(headers, **{"Content-Type": "application/json"}))
            response = conn.getresponse()
            data = response.read()
            conn.close()
            check(response.status == 401 and b"Invalid API Key" in data,
                  "serve without the key (%s): %s %s" % (headers, response.status, data[:200]))
        check(not serve.wait_count(SHARED_LINE, 1, timeout=0.5), "a handoff ran for a client without the key")

        conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=180)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(request(PROMPTS[0])),
                     headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
        response = conn.getresponse()
        text, prompt_n = chat_reply_of(response.status, response.read(), False)
        conn.close()
        check(text == CPU_REPLIES[PROMPTS[0]] and prompt_n == 1, "keyed reply %r prompt_n %s" % (text, prompt_n))
        check(len(serve.wait_count(SHARED_LINE, 1)) == 1, "no shared handoff with the key:\n%s" % "\n".join(serve.lines))

        listener, sock_path = broker_socket("broker.sock")
        listener.settimeout(0.5)
        for key_given in (None, "wrong"):
            status, body = decoder_post(port, "/slots/0?action=share", {"socket": sock_path}, key=key_given)
            check(status == 401 and body["error"]["type"] == "authentication_error",
                  "share with key %r: %s %s" % (key_given, status, body))
            status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1, 2], "share_id": 1}, key=key_given)
            check(status == 401, "adopt with key %r: %s %s" % (key_given, status, body))
        try:
            listener.accept()
            check(False, "the server connected to the broker for a share without the key")
        except socket.timeout:
            pass
        status, body = decoder_post(port, "/slots/0?action=share", {"socket": sock_path}, key=key)
        check(status == 200, "share with the key: %s %s" % (status, body))
        listener.settimeout(10)
        receive_the_share(listener, body["n_fds"])
    finally:
        code = serve.stop()
    check(code == 0, "serve exit code %d" % code)


def wrapped_provider(name, body, real=None):
    """`body` in front of the real provider (kvshare-prefill unless `real`)."""
    return hybrid_common.wrapped_provider(WORK, name, body, real or TOOLS["kvshare-prefill"])


def check_forwarded_after_share(serve, reason, said_on_stderr):
    """The request went to the decoder after a share: slot erased, prompt prefilled by the
    decoder, the reply still --device cpu's."""
    for prompt in PROMPTS[:2]:
        text, prompt_n = replies(serve, [prompt])[0]
        check(text == CPU_REPLIES[prompt], "after %s: %r, --device cpu said %r" % (reason, text, CPU_REPLIES[prompt]))
        check(prompt_n > 1, "after %s the decoder evaluated %s prompt token(s): it used the shared cells" %
              (reason, prompt_n))
    lines = serve.wait_count(r"hybrid: fallback \(%s\)" % reason, 2)
    # Erased, the slot is forwarded to as the request came; unerased, with cache_prompt false.
    check(len(lines) == 2 and all("as it came" in line or "cache_prompt false" in line for line in lines),
          "fallback lines:\n%s" % "\n".join(serve.lines))
    for said in said_on_stderr:
        check(any(said in line for line in serve.lines), "serve's stderr does not say %r:\n%s" %
              (said, "\n".join(serve.lines)))
    check(not [line for line in serve.lines if "restore" in line and "hybrid:" in line and "first byte" in line],
          "took the file route after the provider had the cache:\n%s" % "\n".join(serve.lines))
    check(not [line for line in serve.lines if SHARED_LINE.search(line)], "a shared handoff was reported")


ALTER_HEADER = """
layout = args[args.index("--layout") + 1]
header = json.load(open(layout))
header["params"]["type_k"] = "q8_0"
altered = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "altered-%d.json" % os.getpid())
json.dump(header, open(altered, "w"))
args[args.index("--layout") + 1] = altered
"""


def test_a_provider_that_refuses_the_servers_header_is_forwarded_with_the_slot_erased():
    # The real server's header, one field altered: each provider must refuse it by name.
    providers = [("kvshare-prefill", TOOLS["kvshare-prefill"])]
    if os.access(LLAMA_PREFILL, os.X_OK):
        providers.append(("llama-kvshare-prefill", LLAMA_PREFILL))
    for name, real in providers:
        serve = start("hybrid", kv_share=True, provider=wrapped_provider(name + "-altered-header", ALTER_HEADER, real))
        try:
            # A provider takes the params from the header and refuses the chunks they
            # contradict, naming the field and both values.
            check_forwarded_after_share(serve, "provider_failed",
                                        ["%s: model " % name, "size_bytes\" is 1048576, this provider uses"])
        finally:
            serve.stop()


def test_a_provider_that_scribbles_over_the_cache_and_dies_corrupts_no_reply():
    provider = wrapped_provider("provider-scribbles-and-dies", """
if "--fds" in args:
    for fd in args[args.index("--fds") + 1].split(","):
        size = os.fstat(int(fd)).st_size
        with mmap.mmap(int(fd), size) as region:
            region[:] = b"\\x7b" * size
    sys.stderr.write("provider-scribbles-and-dies: wrote over the whole cache, now failing\\n")
    sys.exit(3)
""")
    serve = start("hybrid", kv_share=True, provider=provider)
    try:
        check_forwarded_after_share(serve, "provider_failed", ["wrote over the whole cache"])
    finally:
        serve.stop()


def test_a_cache_of_two_chunks_is_placed_and_handed_over_through_both():
    # 1.2 M cells of this model's four cache tensors are 1.23 GB: past share_layout's 1 GiB
    # chunk limit, so the region is two chunks (cache_v_l1 alone in the second) and both
    # sides must place every tensor at its chunk and offset.
    provider = LLAMA_PREFILL if os.access(LLAMA_PREFILL, os.X_OK) else None
    serve = start("hybrid", kv_share=True, provider=provider, n_ctx=1200000)
    try:
        for prompt, (text, prompt_n) in zip(PROMPTS, replies(serve, PROMPTS)):
            check(text == CPU_REPLIES[prompt], "two chunks: %r, --device cpu said %r" % (text, CPU_REPLIES[prompt]))
            check(prompt_n == 1, "two chunks: prompt_n %s" % prompt_n)
        check(len(serve.wait_count(SHARED_LINE, len(PROMPTS))) == len(PROMPTS), "\n".join(serve.lines))
        # What the decoder exports: two fds.
        listener, sock_path = broker_socket("b.sock")
        status, shared = decoder_post(decoder_port(serve), "/slots/0?action=share", {"socket": sock_path})
        check(status == 200 and shared["n_fds"] == 2, "share: %s %s" % (status, shared))
        conn, _ = listener.accept()
        _, fds, _, _ = socket.recv_fds(conn, 1 << 20, 16)
        conn.close()
        listener.close()
        sizes = [os.fstat(fd).st_size for fd in fds]
        for fd in fds:
            os.close(fd)
        check(len(sizes) == 2 and max(sizes) <= 1 << 30 and sum(sizes) == shared["region_bytes"],
              "chunk sizes %s for region_bytes %s" % (sizes, shared["region_bytes"]))
    finally:
        serve.stop()


def test_after_an_idle_sleep_the_resumed_cache_is_placed_and_shared_again():
    # --sleep-idle-seconds frees the context when idle and builds a new one on the next task:
    # the new cache must live in the exported region again (not in a private buffer while
    # share keeps handing over the region), and a share sent before the sleep is stale.
    provider = LLAMA_PREFILL if os.access(LLAMA_PREFILL, os.X_OK) else None
    serve = start("hybrid", kv_share=True, provider=provider, extra_args=["--", "--sleep-idle-seconds", "1"])
    try:
        port = decoder_port(serve)
        listener, sock_path = broker_socket("before-sleep.sock")
        status, shared = decoder_post(port, "/slots/0?action=share", {"socket": sock_path})
        check(status == 200, "share before the sleep: %s %s" % (status, shared))
        receive_the_share(listener, shared["n_fds"])
        serve.wait_line(r"server is entering sleeping state", timeout=120)
        status, body = decoder_post(port, "/slots/0?action=adopt", {"tokens": [1, 2, 3], "share_id": shared["share_id"]})
        check(status == 400 and "share again" in body["error"]["message"],
              "a share sent before the sleep was adopted into the new cache: %s %s" % (status, body))
        for rounds in range(2):
            if rounds == 1:  # a second sleep and resume
                serve.wait_line(r"server is entering sleeping state", timeout=120, start=len(serve.lines))
            for prompt, (text, prompt_n) in zip(PROMPTS, replies(serve, PROMPTS)):
                check(text == CPU_REPLIES[prompt], "after a resume: %r, --device cpu said %r" % (text, CPU_REPLIES[prompt]))
                check(prompt_n == 1, "after a resume: prompt_n %s" % prompt_n)
        check(len(serve.wait_count(SHARED_LINE, 2 * len(PROMPTS))) == 2 * len(PROMPTS), "\n".join(serve.lines))
        # (a cache left private would answer adopt 500 and every handoff would fall back)
        fallbacks = [line for line in serve.lines if "hybrid: fallback" in line or "shared route not taken" in line]
        check(not fallbacks, "after a resume the cache was not re-placed:\n%s" % "\n".join(fallbacks))
        check(len([line for line in serve.lines if "server is exiting sleeping state" in line]) >= 2,
              "fewer than two resumes:\n%s" % "\n".join(serve.lines))
    finally:
        serve.stop()


def test_32_concurrent_requests_through_the_shared_route():
    prompts = concurrency_prompts()
    serve = start("hybrid", kv_share=True, provider=LLAMA_PREFILL if os.access(LLAMA_PREFILL, os.X_OK) else None)
    try:
        pid = serve.proc.pid
        fds_before = sorted(os.listdir("/proc/%d/fd" % pid))

        def one(i):
            return chat_reply_of(*serve.post("/v1/chat/completions", request(prompts[i], i % 2 == 1), timeout=600),
                              i % 2 == 1)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        for i, (text, prompt_n) in enumerate(results):
            check(text == CPU_REPLIES[prompts[i]], "request %d: %r, --device cpu said %r" %
                  (i, text, CPU_REPLIES[prompts[i]]))
        check(len(serve.wait_count(SHARED_LINE, 32)) == 32, "\n".join(serve.lines))
        wait_until(lambda: len(os.listdir("/proc/%d/fd" % pid)) <= len(fds_before), 10,
                   "serve holds more fds than before the requests")
        check([e for e in os.listdir(SERVE_TMP) if not e.startswith("kvshare-serve-slots")] == [],
              "sockets or their directories left: %s" % os.listdir(SERVE_TMP))
    finally:
        serve.stop()
    check(os.listdir(SERVE_TMP) == [], "left behind after stop: %s" % os.listdir(SERVE_TMP))


def main():
    CPU_REPLIES.update(baseline())
    run_tests(globals(), WORK)


if __name__ == "__main__":
    main()
