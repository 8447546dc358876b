#!/usr/bin/env python3
"""llama_server_streams: the patched llama-server (LLAMA_SERVER_KVSHARE=path, from
scripts/build-llama-server.sh --with-kvshare; skipped, exit 77, without it) shares its KV
cache however -c, -np and -kvu split it into streams. Issue #27: with one stream per slot
the glue handed kvshare the cells of one stream as the context, so -c 1024 -np 2 degraded
to 501 (kvshare divided by -np again) and a provider, given the same number, built a cache
of half the decoder's size.

Per (-c, -np, -kvu), on kvshare-mkmodel's qwen3 and, for an iSWA pair, its gemma3, with the
server started directly (ONEBIT_KV_SHARE=1, no kvshare-serve, which runs one slot):
- llama.cpp logs the cells per stream tests/layout/memory_shape_test.cc expects, and no
  share_degrade;
- POST /slots/0?action=share to a listening socket answers 200, and the socket receives the
  share message with one fd per chunk, its header's caches [.., kv_size, n_stream];
- llama-kvshare-prefill (beside the server, or LLAMA_KVSHARE_PREFILL) places its context in
  those fds and prefills a prompt, the server adopts it, and a completion of that prompt
  on slot 0 evaluates its last token only and replies as the server does after its own
  prefill of it;
- except with -kvu and several slots: every slot's cells are in one stream, which kvshare
  (KVSHARE_1.4) does not hand over; share answers 501 naming the unified cache, and the
  caller falls back to the file route.

usage: llama_server_streams.py BIN_DIR
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

from hybrid_common import (LlamaServer, check, llama_kvshare_prefill, receive_share, run_tests, same_logprobs,
                           temp_dir, top_logprobs, wait_until)

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER_KVSHARE", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP llama_server_streams: set LLAMA_SERVER_KVSHARE=path of a llama-server built with "
          "scripts/build-llama-server.sh --with-kvshare")
    sys.exit(77)
PREFILL = llama_kvshare_prefill(LLAMA)
MKMODEL = os.path.join(BIN, "kvshare-mkmodel")
for needed in (PREFILL, MKMODEL):
    if not os.access(needed, os.X_OK):
        print("SKIP llama_server_streams: %s is not built" % needed)
        sys.exit(77)

WORK = temp_dir()
MODELS = {}
# 40 ids inside the generated vocabulary (134 tokens), longer than gemma3's window of 32.
PROMPT_IDS = [5 + (7 * i) % 120 for i in range(40)]
N_PREDICT = 6
# -lv 4: llama_context's and the glue's lines are info, which the default verbosity drops.
COMMON_ARGS = ["-fa", "on", "-ctk", "f16", "-ctv", "f16", "-t", "2", "--temp", "0", "-lv", "4"]
N_CTX_SEQ_LINE = re.compile(r"llama_context: n_ctx_seq\s+= (\d+)")
EXPORTED_LINE = re.compile(r"kvshare: KV cache in exported region, \d+ bytes in (\d+) chunk")


def model(arch):
    if arch not in MODELS:
        path = os.path.join(WORK, arch + ".gguf")
        # --residual-gain 3: replies depend on the whole prompt, so on every cell handed over.
        subprocess.run([MKMODEL, path, "--arch", arch, "--seed", "7", "--residual-gain", "3"], check=True, timeout=120,
                       capture_output=True)
        MODELS[arch] = path
    return MODELS[arch]


def completion(server, body):
    status, reply = server.post("/completion", dict({"prompt": PROMPT_IDS, "n_predict": N_PREDICT, "id_slot": 0,
                                                     "temperature": 0, "n_probs": 4}, **body))
    check(status == 200, "completion: %s %s" % (status, reply))
    return reply


def check_streams(arch, n_ctx, n_seq_max, unified, caches):
    """`caches`: [(kv_size, n_stream)] llama.cpp builds, the base then the SWA one for iSWA."""
    name = "%s-c%d-np%d%s" % (arch, n_ctx, n_seq_max, "-kvu" if unified else "")
    # --slot-save-path: llama-server answers every slot action 501 without one.
    args = ["-m", model(arch), "-c", str(n_ctx), "-np", str(n_seq_max), "-kvu" if unified else "-no-kvu",
            "--slot-save-path", WORK + "/"]
    log_path = os.path.join(WORK, name + ".log")
    with LlamaServer(LLAMA, args + COMMON_ARGS, log_path=log_path, env={"ONEBIT_KV_SHARE": "1"}) as server:
        wait_until(lambda: EXPORTED_LINE.search(server.log_text()) or "share_degrade" in server.log_text(), 30,
                   "%s: the log says neither that the cache was exported nor why not:\n%s" %
                   (name, server.log_text()[-3000:]))
        log = server.log_text()
        degraded = [line for line in log.splitlines() if "share_degrade" in line]
        check(not degraded, "%s: the cache was not exported:\n%s" % (name, "\n".join(degraded)))
        n_ctx_seq = N_CTX_SEQ_LINE.search(log)
        check(n_ctx_seq is not None and int(n_ctx_seq.group(1)) == caches[0][0],
              "%s: llama.cpp's n_ctx_seq is %s, the test expects %d" %
              (name, n_ctx_seq.group(1) if n_ctx_seq else "not in its log", caches[0][0]))

        sock_dir = tempfile.mkdtemp(dir=WORK)  # 0700: the server sends only to such a directory
        sock_path = os.path.join(sock_dir, "broker.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(sock_path)
        listener.listen(1)
        status, shared = server.post("/slots/0?action=share", {"socket": sock_path})
        if status != 200:
            listener.close()
        if unified and n_seq_max > 1:
            message = shared.get("error", {}).get("message", "") if isinstance(shared, dict) else ""
            check(status == 501 and "unified" in message, "%s: share of a unified cache of %d slots: %s %s" %
                  (name, n_seq_max, status, shared))
            print("  %s: exported, share refused (501): a unified cache of %d slots" % (name, n_seq_max), flush=True)
            return
        check(status == 200, "%s: share: %s %s" % (name, status, shared))
        message, fds = receive_share(listener)
        try:
            check(message["type"] == "share" and message["share_id"] == shared["share_id"],
                  "%s: message %s for share %s" % (name, {k: message.get(k) for k in ("type", "share_id")}, shared))
            check(len(fds) == shared["n_fds"] == len(message["header"]["chunks"]),
                  "%s: %d fds, n_fds %d, %d chunks" % (name, len(fds), shared["n_fds"],
                                                       len(message["header"]["chunks"])))
            header = message["header"]
            got = [(c["kv_size"], c["n_stream"]) for c in header["memory"]["kv_caches"]]
            check(got == caches, "%s: the header's caches are %s, llama.cpp's %s" % (name, got, caches))

            layout_path = os.path.join(WORK, name + "-layout.json")
            with open(layout_path, "w") as f:
                json.dump(header, f)
            ids_path = os.path.join(WORK, name + "-ids.json")
            with open(ids_path, "w") as f:
                json.dump(PROMPT_IDS, f)
            done = subprocess.run([PREFILL, "--tokens", ids_path, "--model", model(arch), "--layout", layout_path,
                                   "--fds", ",".join(str(fd) for fd in fds), "-t", "2"],
                                  pass_fds=fds, capture_output=True, text=True, timeout=120)
        finally:
            for fd in fds:
                os.close(fd)
        check(done.returncode == 0, "%s: llama-kvshare-prefill exit %d:\n%s" % (name, done.returncode, done.stderr))

        status, adopted = server.post("/slots/0?action=adopt", {"tokens": PROMPT_IDS, "share_id": shared["share_id"]})
        check(status == 200 and adopted["n_adopted"] == len(PROMPT_IDS), "%s: adopt: %s %s" % (name, status, adopted))
        handed = completion(server, {"cache_prompt": True})
        check(handed["timings"]["prompt_n"] == 1, "%s: after the handoff the server evaluated %s prompt tokens" %
              (name, handed["timings"]["prompt_n"]))

        status, body = server.post("/slots/0?action=erase", {})
        check(status == 200, "%s: erase: %s %s" % (name, status, body))
        own = completion(server, {"cache_prompt": False})
        check(own["timings"]["prompt_n"] == len(PROMPT_IDS), "%s: own prefill of %s tokens" %
              (name, own["timings"]["prompt_n"]))
        check(handed["content"] == own["content"] and handed["tokens_predicted"] == own["tokens_predicted"],
              "%s: after the handoff %r (%d tokens), after its own prefill %r (%d tokens)" %
              (name, handed["content"], handed["tokens_predicted"], own["content"], own["tokens_predicted"]))
        # The same llama.cpp computed both caches: the candidates agree to rounding.
        check(same_logprobs(top_logprobs(handed), top_logprobs(own)),
              "%s: after the handoff the candidates are %s, after its own prefill %s" %
              (name, top_logprobs(handed), top_logprobs(own)))
        print("  %s: %s, %d fd(s), reply %r" % (name, got, len(fds), own["content"]), flush=True)


# Cells per stream and streams as llama_context splits -c (memory_shape_test.cc's table).
def test_c512_np2_one_stream_per_slot():
    check_streams("qwen3", 512, 2, False, [(256, 2)])


def test_c1024_np2_one_stream_per_slot():
    check_streams("qwen3", 1024, 2, False, [(512, 2)])


def test_c2048_np2_one_stream_per_slot():
    check_streams("qwen3", 2048, 2, False, [(1024, 2)])


def test_c1024_np4_one_stream_per_slot():
    check_streams("qwen3", 1024, 4, False, [(256, 4)])


def test_c768_np3_one_stream_per_slot():
    check_streams("qwen3", 768, 3, False, [(256, 3)])


def test_c1000_np3_rounds_each_stream_up():
    check_streams("qwen3", 1000, 3, False, [(512, 3)])


def test_c1024_np2_unified():
    check_streams("qwen3", 1024, 2, True, [(1024, 1)])


# gemma3's SWA cache per stream: pad256(min(kv_size, 32 * (np if unified else 1) + 512)).
def test_gemma3_iswa_c2048_np2_one_stream_per_slot():
    check_streams("gemma3", 2048, 2, False, [(1024, 2), (768, 2)])


def test_gemma3_iswa_c1024_np2_unified():
    check_streams("gemma3", 1024, 2, True, [(1024, 1), (768, 1)])


run_tests(globals(), WORK)
