"""What kvshare-serve's integration tests share: start serve on a free loopback port, read
its stderr as it comes, send requests with timeouts, read the fakes' logs, and stop
everything. Nothing here waits without a deadline."""
import array
import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_DECODER = os.path.join(HERE, "fake_decoder.py")
FAKE_PROVIDER = os.path.join(HERE, "fake_provider.py")
LISTEN_RE = re.compile(r"kvshare-serve: listening on http://([\d.]+):(\d+)")

sys.path.insert(0, HERE)
import fake_decoder  # noqa: E402  (tokenizer, template and replies, to compute expectations)


# serve's per-request lines and its startup line naming the decoder child. Not anchored at
# the line start: llama-server's log shares serve's stderr and writes a line's timestamp
# before its text, so serve's own line can land after one.
SHARED_LINE = re.compile(r"hybrid: (\d+) prompt tokens(?:, \d+ cached)?: prefill \d+\.\d{3} ms(?: of \d+ tokens)?, "
                         r"share (\d+\.\d{3}) ms, first byte \d+\.\d{3} ms$")
DECODER_RE = re.compile(r"decoder \S+ on 127\.0\.0\.1:(\d+)")


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


class Serve:
    """One kvshare-serve process. stderr lines are collected by a thread."""

    def __init__(self, serve_bin, args, env=None, expect_listen=True, timeout=30):
        self.env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                self.env.pop(key, None)  # None unsets an inherited variable
            else:
                self.env[key] = value
        self.proc = subprocess.Popen([serve_bin] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=self.env, start_new_session=True)
        self.lines = []
        self.lock = threading.Condition()
        self.out = b""
        self.stderr_closed = False
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.port = None
        if expect_listen:
            line = self.wait_line(LISTEN_RE, timeout)
            self.port = int(LISTEN_RE.search(line).group(2))

    def _read_stderr(self):
        for raw in self.proc.stderr:
            with self.lock:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self.lock.notify_all()
        with self.lock:
            self.stderr_closed = True
            self.lock.notify_all()

    def _read_stdout(self):
        self.out = self.proc.stdout.read()

    def wait_line(self, pattern, timeout=10, start=0):
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                for line in self.lines[start:]:
                    if pattern.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.stderr_closed:
                    raise Failure("no stderr line matching %r within %ss; stderr:\n%s" %
                                  (pattern.pattern, timeout, "\n".join(self.lines)))
                self.lock.wait(min(left, 0.1))

    def wait_count(self, pattern, count, timeout=10):
        """The stderr lines matching `pattern` once there are `count` of them (lines reach us
        through a pipe, a moment after the reply that follows them)."""
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                matching = [line for line in self.lines if pattern.search(line)]
                if len(matching) >= count or time.monotonic() > deadline or self.stderr_closed:
                    return matching
                self.lock.wait(0.05)

    def stderr_lines(self, prefix=""):
        with self.lock:
            return [line for line in self.lines if line.startswith(prefix)]

    def request(self, method, path, body=None, timeout=30):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        payload = json.dumps(body) if isinstance(body, (dict, list)) else body
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, response.getheader("Content-Type", ""), data

    def post(self, path, body, timeout=30):
        status, _, data = self.request("POST", path, body, timeout)
        return status, data

    def stop(self, sig=signal.SIGTERM, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
            raise Failure("kvshare-serve did not stop within %ss after %s" % (timeout, sig))

    def wait_exit(self, timeout=15):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise Failure("kvshare-serve did not exit within %ss" % timeout)

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def events(path, kind):
    return [e for e in read_log(path) if e.get("event") == kind]


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def descendants(root):
    """The live (non-zombie) processes below `root`, at any depth."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
        except (OSError, IndexError):
            pass
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def wait_until(predicate, timeout, message):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise Failure(message)


def chat(text):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8}


def expected_chat_ids(text):
    return fake_decoder.tokenize(fake_decoder.apply_template([{"role": "user", "content": text}]))


def expected_reply(ids):
    return " ".join(fake_decoder.reply_words(ids))


def chat_reply_of(status, data, stream):
    """(content, timings.prompt_n) of a chat completion, JSON or SSE."""
    check(status == 200, "status %d: %s" % (status, data[:300]))
    if not stream:
        body = json.loads(data)
        return body["choices"][0]["message"]["content"], body["timings"]["prompt_n"]
    text, prompt_n = "", None
    for event in data.decode().split("\n\n"):
        if event.startswith("data: {"):
            chunk = json.loads(event[6:])
            for choice in chunk.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
            if "timings" in chunk:
                prompt_n = chunk["timings"]["prompt_n"]
    return text, prompt_n


def state_file_bytes(ids, version=3):
    import struct
    return struct.pack("<III", fake_decoder.STATE_MAGIC, version, len(ids)) + struct.pack("<%di" % len(ids), *ids)


class Runner:
    """Runs named test functions, prints PASS/FAIL per test, exits non-zero on any failure."""

    def __init__(self):
        self.failed = []

    def run(self, name, function):
        start = time.monotonic()
        try:
            function()
            print("PASS %s (%.2fs)" % (name, time.monotonic() - start), flush=True)
        except Exception as error:  # noqa: BLE001 - a test harness reports every failure
            import traceback
            self.failed.append(name)
            print("FAIL %s: %s" % (name, error), flush=True)
            traceback.print_exc()

    def finish(self):
        if self.failed:
            print("%d failed: %s" % (len(self.failed), ", ".join(self.failed)))
            sys.exit(1)
        print("all passed")


def run_tests(namespace, work_dir):
    """Runs every test_* function of a script's globals(), in name order, then removes its
    work directory and exits non-zero if any failed."""
    runner = Runner()
    # KVSHARE_TEST_ONLY=REGEX runs only the matching cases (a developer's re-run of one).
    only = re.compile(os.environ.get("KVSHARE_TEST_ONLY", ""))
    for name, function in sorted(namespace.items()):
        if name.startswith("test_") and callable(function) and only.search(name):
            runner.run(name, function)
    shutil.rmtree(work_dir, ignore_errors=True)
    runner.finish()


def llama_kvshare_prefill(llama_server):
    """The provider of a patched llama.cpp build: LLAMA_KVSHARE_PREFILL, else
    llama-kvshare-prefill beside its llama-server."""
    return os.environ.get("LLAMA_KVSHARE_PREFILL") or os.path.join(os.path.dirname(llama_server),
                                                                     "llama-kvshare-prefill")


def wrapped_provider(work, name, body, real):
    """A provider command in `work` that runs `body` (Python, with `args` the argv it was
    given) in front of the provider `real`, as kvshare-serve starts it."""
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write("#!%s\nimport json, mmap, os, subprocess, sys\nargs = sys.argv[1:]\nREAL = %r\n%s\n"
                "os.execv(REAL, [REAL] + args)\n" % (sys.executable, real, body))
    os.chmod(path, 0o700)
    return path


# The GPU decoder (issue #42) on a Vulkan device: in CI lavapipe, Mesa's Vulkan 1.3 device on
# the CPU, which llama.cpp takes only when GGML_VK_VISIBLE_DEVICES names it (without it the
# same patched build is the CPU decoder every other test runs).
VULKAN_ENV = {"GGML_VK_VISIBLE_DEVICES": "0"}
VULKAN_DEVICE_RE = re.compile(r"^\s*(Vulkan\d+): (.+)$", re.M)


def vulkan_device(llama_server, test):
    """'Vulkan0: <description>' as the patched `llama_server` lists it under VULKAN_ENV. With
    none the script exits: skipped (77) on a developer's machine, failed under CI=true, where
    scripts/install-deps.sh installs lavapipe and the build always has the Vulkan backend."""
    listed = subprocess.run([llama_server, "--list-devices"], env=dict(os.environ, **VULKAN_ENV),
                            capture_output=True, text=True, timeout=300)
    found = VULKAN_DEVICE_RE.search(listed.stdout + listed.stderr)
    if found:
        return "%s: %s" % (found.group(1), found.group(2).strip())
    why = ("%s lists no Vulkan device with GGML_VK_VISIBLE_DEVICES=0 (a build without the Vulkan backend, "
           "KVSHARE_LLAMA_VULKAN=0, or no Vulkan driver: Debian's mesa-vulkan-drivers is lavapipe)" % llama_server)
    if os.environ.get("CI") == "true":
        print("FAIL %s: %s" % (test, why))
        sys.exit(1)
    print("SKIP %s: %s" % (test, why))
    sys.exit(77)


def temp_dir():
    return tempfile.mkdtemp(prefix="kvshare-serve-test-")


# The broker side of a llama-server share, as the slot tests play it (issue #27).
def share_listener(work, name):
    """A listening AF_UNIX socket in a fresh 0700 directory of `work`: (listener, path)."""
    sock_dir = tempfile.mkdtemp(dir=work)  # 0700: the server sends only to such a directory
    path = os.path.join(sock_dir, name + ".sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    return listener, path


def receive_share(listener):
    """The one share message the server sends to `listener` (then closed): (message, fds)."""
    listener.settimeout(30)
    conn, _ = listener.accept()
    conn.settimeout(30)
    fds = array.array("i")
    try:
        data, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(16 * fds.itemsize))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            more = conn.recv(1 << 20)
            check(more, "the share frame ended after %d bytes" % len(data))
            data += more
    finally:
        conn.close()
        listener.close()
    length = struct.unpack("<I", data[:4])[0]
    return json.loads(data[4:4 + length]), list(fds)


def top_logprobs(reply):
    """Per generated token: [(id, logprob)] of its likeliest candidates."""
    return [[(t["id"], t["logprob"]) for t in step["top_logprobs"]] for step in reply["completion_probabilities"]]


def same_logprobs(a, b, tolerance=1e-3):
    return len(a) == len(b) and all(len(x) == len(y) and all(i == j and abs(p - q) <= tolerance
                                                             for (i, p), (j, q) in zip(x, y)) for x, y in zip(a, b))


def timed(call):
    start = time.monotonic()
    result = call()
    return result, (start, time.monotonic())



class LlamaServer:
    """A llama-server started directly (no kvshare-serve in between) on a free loopback port,
    ready when constructed (its /health answers 200), stopped by stop() or `with`. With
    `log_path` its stdout and stderr go to that file (read it with log_text()); `env` is laid
    over this process's environment (a None value unsets a variable)."""

    def __init__(self, binary, args, timeout=120, log_path=None, env=None):
        import socket
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.log_path = log_path
        child_env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                child_env.pop(key, None)
            else:
                child_env[key] = value
        log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(self.port)] + args,
                                         stdout=log, stderr=subprocess.STDOUT if log_path else log, env=child_env)
        finally:
            if log_path:
                log.close()  # the child has its own copy
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise Failure("llama-server %s did not come up on port %d%s" %
                              (" ".join(args), self.port, "; its log ends:\n" + self.log_text()[-3000:]
                               if log_path else ""))
            time.sleep(0.1)

    def log_text(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def post(self, path, body):
        """POSTs JSON; returns (status, parsed body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
