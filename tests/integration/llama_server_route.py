#!/usr/bin/env python3
"""llama_server_route: kvshare-serve --device hybrid with a real llama-server as the decoder
(LLAMA_SERVER=path; scripts/test.sh builds one from the pinned npm package) and
kvshare-prefill as the provider, through every fallback the fake decoder's suite covers.

Each case sends one chat request and checks what a user sees: the reply equals the reply
of the same llama-server behind --device cpu (greedy), the stderr line names the reason,
/metrics counts it, and the slot directory is empty afterwards. The provider's failures
are made by small wrapper scripts around kvshare-prefill, so everything else is real:
the model file, the tokenizer and template of llama-server, its restore and its refusals.

Also: serve learns the decoder's state-file version by saving its empty slot, and that is
the version llama-server's own save writes (3 for the pinned tree, 2 for d32676d).

usage: llama_server_route.py BIN_DIR   (exit 77 = skipped: LLAMA_SERVER is not set; in CI, where
                                        scripts/test.sh builds it, that never happens)
"""
import json
import os
import re
import stat
import struct
import subprocess
import sys

from hybrid_common import LlamaServer, Serve, check, run_tests, temp_dir

BIN = os.path.abspath(sys.argv[1])
LLAMA = os.environ.get("LLAMA_SERVER", "")
if not LLAMA or not os.access(LLAMA, os.X_OK):
    print("SKIP llama_server_route: set LLAMA_SERVER=path of a llama-server build "
          "(scripts/build-llama-server.sh makes one)")
    sys.exit(77)

SERVE = os.path.join(BIN, "kvshare-serve")
PREFILL = os.path.join(BIN, "kvshare-prefill")
WORK = temp_dir()
MODEL = os.path.join(WORK, "tiny.gguf")
# residual gain 3: replies depend on the whole prompt, so a wrong KV shows (docs/refmodel.md).
subprocess.run([os.path.join(BIN, "kvshare-mkmodel"), MODEL, "--seed", "11", "--residual-gain", "3"],
               check=True, timeout=120, capture_output=True)
SERVE_TMP = os.path.join(WORK, "serve-tmp")
os.makedirs(SERVE_TMP)
KV_FLAGS = ["-c", "1024", "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
# serve's lines are matched anywhere in a stderr line, not anchored at its start: llama-server's
# log shares the stream and writes a line's timestamp before its text, so serve's line can
# land after one (as in llama_server_kvshare).
FILE_LINE = re.compile(r"hybrid: (\d+) prompt tokens: prefill \d+\.\d{3} ms, restore \d+\.\d{3} ms, "
                       r"first byte \d+\.\d{3} ms$")
SHARED_THEN_FILE_LINE = re.compile(r"hybrid: (\d+) prompt tokens(?:, \d+ cached)?: prefill \d+\.\d{3} ms(?: of \d+ tokens)?, share 0\.000 ms, "
                                   r"restore \d+\.\d{3} ms, first byte \d+\.\d{3} ms$")
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def request(text=PROMPT):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}


def provider_script(name, body):
    """A provider: a shell script around kvshare-prefill (or none) in the work directory."""
    path = os.path.join(WORK, name)
    with open(path, "w") as out:
        out.write("#!/bin/sh\n" + body.replace("PREFILL", PREFILL) + "\n")
    os.chmod(path, stat.S_IRWXU)
    return path


def start(device, provider=None, args=None, env=None):
    full = ["-m", MODEL, "--device", device, "--port", "0", "--backend", LLAMA] + KV_FLAGS + (args or [])
    if provider:
        # Every prompt here is short: the test is of the handoff, which auto would skip.
        full += ["--prefill-provider", provider, "--handoff", "always"]
    full_env = {"TMPDIR": SERVE_TMP, "ONEBIT_HYBRID_PREFILL": "", "ONEBIT_KV_SHARE": None}
    full_env.update(env or {})
    return Serve(SERVE, full, full_env, timeout=120)


def reply_of(status, data):
    check(status == 200, "status %d: %s" % (status, data[:300]))
    body = json.loads(data)
    return body["choices"][0]["message"]["content"], body["timings"]["prompt_n"]


def slot_dir_files():
    out = []
    for d in os.listdir(SERVE_TMP):
        if d.startswith("kvshare-serve-slots"):
            out += os.listdir(os.path.join(SERVE_TMP, d))
    return out


CPU = {}


def cpu_reply(text=PROMPT):
    if text not in CPU:
        serve = start("cpu")
        try:
            CPU[text] = reply_of(*serve.post("/v1/chat/completions", request(text), timeout=120))[0]
        finally:
            serve.stop()
    return CPU[text]


def metric(serve, name):
    status, _, data = serve.request("GET", "/metrics")
    check(status == 200, "/metrics %d" % status)
    return data.decode()


def handed_off(provider, line_re=FILE_LINE, env=None):
    """A handoff that works: the reply equals --device cpu and llama-server evaluated one token."""
    serve = start("hybrid", provider, env=env)
    try:
        text, prompt_n = reply_of(*serve.post("/v1/chat/completions", request(), timeout=120))
        check(text == cpu_reply(), "after the handoff llama-server said %r, on its own %r" % (text, cpu_reply()))
        check(prompt_n == 1, "llama-server evaluated %s prompt tokens after the handoff, expected 1" % prompt_n)
        serve.wait_line(line_re, 10)
        check(not [line for line in serve.lines if "hybrid: fallback" in line], "\n".join(serve.lines))
        return serve.lines
    finally:
        serve.stop()
        check(slot_dir_files() == [], "left in the slot directory: %s" % slot_dir_files())


def fell_back(reason, provider, body=None, args=None, env=None, endpoint="/v1/chat/completions", expect=None):
    """A handoff that fails `reason`'s way: said on stderr, counted, and the reply is still
    llama-server's own (it prefilled the prompt itself)."""
    serve = start("hybrid", provider, args=args, env=env)
    try:
        status, data = serve.post(endpoint, body or request(), timeout=120)
        check(status == 200, "status %d: %s" % (status, data[:300]))
        if expect is None:
            text, prompt_n = reply_of(status, data)
            check(text == cpu_reply(), "after a fallback (%s) the reply was %r, --device cpu says %r" %
                  (reason, text, cpu_reply()))
            check(prompt_n > 1, "prompt_n %d: the decoder did not prefill the prompt itself" % prompt_n)
        else:
            expect(data)
        line = serve.wait_line(r"hybrid: fallback \(%s\): " % re.escape(reason), 10)
        check("forwarding the request as it came" in line, line)
        check(('kvshare_fallbacks_total{reason="%s"} 1' % reason) in metric(serve, "fallbacks"),
              "no fallback counted for %s" % reason)
        return line
    finally:
        serve.stop()
        check(slot_dir_files() == [], "left in the slot directory: %s" % slot_dir_files())


def own_save_version():
    """Starts llama-server directly, prefills, saves slot 0 and reads the file's version and tokens."""
    slots = os.path.join(WORK, "own-save")
    os.makedirs(slots, exist_ok=True)
    with LlamaServer(LLAMA, ["-m", MODEL, "-np", "1", "--slot-save-path", slots + "/"] + KV_FLAGS) as server:
        status, tokenized = server.post("/tokenize", {"content": "Hi there, how are you?", "add_special": True})
        ids = tokenized["tokens"]
        status, _ = server.post("/completion", {"prompt": ids, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
        check(status == 200, "completion %d" % status)
        status, saved = server.post("/slots/0?action=save", {"filename": "own.state"})
        check(status == 200, "save %d: %s" % (status, saved))
    with open(os.path.join(slots, "own.state"), "rb") as f:
        magic, version, n_token = struct.unpack("<III", f.read(12))
    inspect = subprocess.run([os.path.join(BIN, "kvshare-state"), "inspect", os.path.join(slots, "own.state"),
                              "--json"], capture_output=True, text=True, timeout=60)
    check(inspect.returncode == 0, "kvshare-state inspect of llama-server's save: %s" % inspect.stderr)
    return version, n_token, ids, json.loads(inspect.stdout)


def test_serve_learns_the_version_llama_servers_own_save_writes():
    version, n_token, ids, inspected = own_save_version()
    check(inspected["version"] == version and inspected["tokens"] == ids,
          "kvshare-state read version %s tokens %s; the file says %s, llama-server tokenized %s" %
          (inspected["version"], inspected["tokens"], version, ids))
    if version >= 3:
        # server_tokens::serialize: -1, packing version, count, ids, no media
        check(n_token == len(ids) + 4 and inspected["token_form"] == "server_packed",
              "n_token %d for %d ids, form %s" % (n_token, len(ids), inspected["token_form"]))
    lines = handed_off(PREFILL)
    said = [l for l in lines if "kvshare-serve: the decoder restores state files of version" in l]
    check(said and ("version %d " % version) in said[0], "serve's probe line %s, llama-server saves %d" % (said, version))


def test_file_route_with_kvshare_prefill():
    handed_off(PREFILL)


def test_shared_route_refused_by_a_stock_decoder_takes_the_file_route():
    # A llama-server without the kvshare patch answers ?action=share 400 "Invalid action".
    lines = handed_off(PREFILL, SHARED_THEN_FILE_LINE, env={"ONEBIT_KV_SHARE": "1"})
    check(any("shared route not taken (share_refused)" in l for l in lines), "\n".join(lines))


def test_fallback_provider_fails():
    fell_back("provider_failed", provider_script("fails.sh", "echo 'no NPU' >&2; exit 3"))


def test_fallback_provider_times_out():
    fell_back("provider_timeout", provider_script("hangs.sh", "exec sleep 60"), args=["--provider-timeout", "1"])


def test_fallback_provider_writes_no_file():
    fell_back("no_state_file", provider_script("nofile.sh", "exit 0"))


def test_fallback_restore_refuses_a_corrupt_file():
    # The right header and version (the one serve passes on: 3 for the pin, 2 for d32676d),
    # then garbage: llama-server's restore answers 400.
    body = ('while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
            'printf "qsgg\\00${ONEBIT_HYBRID_STATE_VERSION:-3}\\000\\000\\000\\005\\000\\000\\000garbage" > "$out"')
    line = fell_back("restore_failed", provider_script("corrupt.sh", body))
    check("answered 400" in line, line)


def test_fallback_restore_short():
    # The provider prefills one token fewer than it was given: llama-server restores them all,
    # serve sees the count is short, erases the slot and forwards.
    script = os.path.join(WORK, "short.py")
    with open(script, "w") as out:
        out.write("""#!/usr/bin/env python3
import os, subprocess, sys
args = sys.argv[1:]
at = args.index("--tokens") + 1
short = args[at] + ".short"
with open(args[at]) as ids, open(short, "w") as out:
    out.write("\\n".join(ids.read().split()[:-1]) + "\\n")
args[at] = short
status = subprocess.call([%r] + args)
os.remove(short)
sys.exit(status)
""" % PREFILL)
    os.chmod(script, stat.S_IRWXU)
    fell_back("restore_short", script)


def test_fallback_state_version_mismatch():
    # A provider pinned to the other generation: serve reads its header and does not restore.
    other = 2 if own_save_version()[0] == 3 else 3
    line = fell_back("state_version_mismatch",
                     provider_script("other_version.sh", 'exec PREFILL "$@" --state-version %d' % other))
    check(("wrote state version %d" % other) in line, line)


def test_fallback_state_file_of_an_unknown_version():
    # A file whose header says version 99: serve reads it and sends no restore (fault_matrix's
    # bad_version row, here with the real decoder).
    body = ('while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
            'printf "qsgg\\143\\000\\000\\000\\005\\000\\000\\000garbage" > "$out"')
    line = fell_back("bad_state_file", provider_script("version99.sh", body))
    check("version 99 is unknown" in line, line)


def test_fallback_no_text_prompt():
    def expect(data):
        body = json.loads(data)
        check(body["choices"][0]["text"] is not None, data)
    fell_back("no_text_prompt", PREFILL, body={"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0},
              endpoint="/v1/completions", expect=expect)


def test_fallback_prompt_too_short():
    def expect(data):
        check("choices" in json.loads(data), data)
    fell_back("prompt_too_short", PREFILL, body={"prompt": "", "max_tokens": 4, "temperature": 0},
              endpoint="/v1/completions", expect=expect)


if __name__ == "__main__":
    run_tests(globals(), WORK)
