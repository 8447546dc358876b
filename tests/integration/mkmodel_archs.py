#!/usr/bin/env python3
"""mkmodel_archs: every arch kvshare-mkmodel writes for a memory kind other than the plain
KV cache, served by the real llama-server (LLAMA_SERVER=path; scripts/test.sh builds it
from the pinned npm package).

Per arch: kvshare-mkmodel writes the model; llama-server loads it (it refuses a file with a
tensor missing or one too many) and builds the memory the arch stands for, which its log
names (llama_memory_recurrent, llama_kv_cache_iswa, or both halves of a hybrid, with the
layer counts of each); kvshare-layout-dump derives the same kind from the file; and a
greedy completion of 8 tokens comes back whole (not cut short by EOS) and non-empty, for a
prompt longer than gemma3's sliding window.

usage: mkmodel_archs.py BIN_DIR   (exit 77 = skipped: LLAMA_SERVER is not set; with CI=true
                                   that is a failure, since scripts/test.sh always sets it)
"""
import os
import re
import subprocess
import sys

from hybrid_common import LlamaServer, check, run_tests, temp_dir, wait_until

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    if os.environ.get("CI") == "true":
        print("FAIL mkmodel_archs: CI=true but LLAMA_SERVER is not an executable llama-server (%r)" % LLAMA)
        sys.exit(1)
    print("SKIP mkmodel_archs: set LLAMA_SERVER=path of a llama-server build "
          "(scripts/build-llama-server.sh makes one)")
    sys.exit(77)

MKMODEL = os.path.join(BIN, "kvshare-mkmodel")
LAYOUT_DUMP = os.path.join(BIN, "kvshare-layout-dump")
WORK = temp_dir()
SWA_WINDOW = 32
# Well over SWA_WINDOW + 2 tokens (most characters are a token of their own here), so gemma3's
# SWA layers really mask part of the prompt.
PROMPT = ("The quick brown fox jumps over the lazy dog, and then the dog wakes up and runs after "
          "the fox into the woods behind the old mill.")
# -lv 4: the memory constructors log at info level, which llama-server's default
# verbosity (3) drops.
SERVER_ARGS = ["-c", "1024", "-np", "1", "-t", "2", "--temp", "0", "-lv", "4"]
N_PREDICT = 8

# The memory line of each kind, as llama.cpp's constructors log it (llama-kv-cache.cpp,
# llama-memory-recurrent.cpp, llama-kv-cache-iswa.cpp).
KV_LINE = re.compile(r"llama_kv_cache: size = .*\(\s*\d+ cells,\s*(\d+) layers")
RECURRENT_LINE = re.compile(r"llama_memory_recurrent: size = .*\(\s*\d+ cells,\s*(\d+) layers")
ISWA_BASE_LINE = re.compile(r"llama_kv_cache_iswa: creating non-SWA KV cache, size = (\d+) cells")
ISWA_SWA_LINE = re.compile(r"llama_kv_cache_iswa: creating\s+SWA KV cache, size = (\d+) cells")


def generate(arch, args):
    path = os.path.join(WORK, arch + ".gguf")
    subprocess.run([MKMODEL, path, "--arch", arch] + args, check=True, timeout=120, capture_output=True)
    return path


def layout_memory_kind(model):
    """The memory kind kvshare's layout derives for the model under SERVER_ARGS."""
    done = subprocess.run([LAYOUT_DUMP, model, "-c", "1024", "-np", "1"], timeout=60, capture_output=True, text=True)
    check(done.returncode == 0, "kvshare-layout-dump %s: exit %d: %s" % (model, done.returncode, done.stderr))
    found = re.search(r"^memory: (\w+),", done.stdout, re.M)
    check(found is not None, "kvshare-layout-dump printed no memory line:\n" + done.stdout[:2000])
    return found.group(1)


def wait_for_log(server, patterns):
    """The log once every pattern is in it: llama-server's logger writes from its own thread."""
    wait_until(lambda: all(p.search(server.log_text()) for p in patterns), 30,
               "llama-server's log never showed %s; it reads:\n%s" %
               (", ".join(p.pattern for p in patterns), server.log_text()[-4000:]))
    return server.log_text()


def layer_counts(pattern, log):
    return [int(m.group(1)) for m in pattern.finditer(log)]


def complete(server):
    """A greedy completion; checks it is N_PREDICT tokens long and not empty, returns it."""
    status, body = server.post("/completion", {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0,
                                               "cache_prompt": False})
    check(status == 200, "status %d: %s" % (status, body))
    check(body.get("tokens_predicted") == N_PREDICT,
          "the reply stopped after %s of %d tokens (%s): %r" %
          (body.get("tokens_predicted"), N_PREDICT, body.get("stop_type"), body.get("content")))
    check(body.get("content", "") != "", "empty reply: %s" % body)
    check(body.get("tokens_evaluated", 0) > SWA_WINDOW + 2,
          "the prompt was %s tokens, not longer than the window" % body.get("tokens_evaluated"))
    print("  %d prompt tokens, reply %r" % (body["tokens_evaluated"], body["content"]), flush=True)
    return body["content"]


def serve(arch, args):
    model = generate(arch, args)
    return model, LlamaServer(LLAMA, ["-m", model] + SERVER_ARGS, log_path=os.path.join(WORK, arch + ".log"))


def test_mamba2_is_recurrent_memory():
    model, server = serve("mamba2", [])
    with server:
        log = wait_for_log(server, [RECURRENT_LINE])
        check(layer_counts(RECURRENT_LINE, log) == [2], "recurrent layers: %s" % layer_counts(RECURRENT_LINE, log))
        check(not KV_LINE.search(log), "a recurrent model got a KV cache:\n" + log[-3000:])
        complete(server)
    check(layout_memory_kind(model) == "recurrent", "kvshare's layout disagrees")


def test_lfm2_is_hybrid_with_conv_and_attention_layers():
    model, server = serve("lfm2", ["--layers", "4"])
    with server:
        log = wait_for_log(server, [KV_LINE, RECURRENT_LINE])
        # conv, attention, conv, attention: the KV cache holds 2 layers, the recurrent
        # memory counts every layer (it allocates only for the conv ones).
        check(layer_counts(KV_LINE, log) == [2], "KV cache layers: %s" % layer_counts(KV_LINE, log))
        check(layer_counts(RECURRENT_LINE, log) == [4], "recurrent layers: %s" % layer_counts(RECURRENT_LINE, log))
        check("llama_kv_cache_iswa" not in log, "lfm2 without sliding_window got an iSWA cache")
        complete(server)
    check(layout_memory_kind(model) == "hybrid", "kvshare's layout disagrees")


def test_gemma3_is_iswa_with_a_small_window():
    model, server = serve("gemma3", ["--swa-window", str(SWA_WINDOW)])
    with server:
        log = wait_for_log(server, [ISWA_BASE_LINE, ISWA_SWA_LINE])
        base = int(ISWA_BASE_LINE.search(log).group(1))
        swa = int(ISWA_SWA_LINE.search(log).group(1))
        check(swa < base, "the SWA cache (%d cells) is not smaller than the base one (%d)" % (swa, base))
        # Layer 0 is SWA, layer 1 full (sliding_window_pattern 2): one layer in each cache.
        check(layer_counts(KV_LINE, log) == [1, 1], "KV cache layers: %s" % layer_counts(KV_LINE, log))
        check(not RECURRENT_LINE.search(log), "gemma3 got recurrent memory")
        complete(server)
    check(layout_memory_kind(model) == "kv_iswa", "kvshare's layout disagrees")


def test_qwen35_is_hybrid_with_gated_deltanet_and_attention_layers():
    model, server = serve("qwen35", [])
    with server:
        log = wait_for_log(server, [KV_LINE, RECURRENT_LINE])
        # 3 GDN layers and 1 attention layer (full_attention_interval 4).
        check(layer_counts(KV_LINE, log) == [1], "KV cache layers: %s" % layer_counts(KV_LINE, log))
        check(layer_counts(RECURRENT_LINE, log) == [4], "recurrent layers: %s" % layer_counts(RECURRENT_LINE, log))
        complete(server)
    check(layout_memory_kind(model) == "hybrid", "kvshare's layout disagrees")


run_tests(globals(), WORK)
