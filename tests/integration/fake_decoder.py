#!/usr/bin/env python3
"""The fault-injecting decoder of kvshare-serve's tests: a llama-server double that, on demand,
fails or shortens restores, fails save, erase and adopt, refuses or breaks a share, stalls
a stream, dies mid-reply or mid-adopt, and logs every call so a test sees what serve sent.
A test that needs a working decoder runs the patched llama-server or kvshare-decoder.

It speaks only what the hybrid route uses (template, tokenize, slots, completions, /health,
and /props when FAKE_DECODER_SLOT_CTX is set).

Tokenizer: BOS (id 1), then each UTF-8 byte b of the text as id b + 10. The chat template
is ChatML. A reply's text is a function of the prompt's ids, so a test can tell a right
reply from a wrong one. The slot's cached tokens follow llama-server's rules: a restore
sets them to the file's tokens, the prompt-cache prefix search counts how many prompt
tokens are evaluated (timings.prompt_n), and a request leaves the prompt cached.

State files are read as llama.cpp writes them up to the token list: u32 magic 'ggsq',
u32 version, u32 n_token, i32 ids (the KV part is not looked at). Like llama.cpp it reads
one state version only (FAKE_DECODER_STATE_VERSION, default 3) and refuses any other with
llama-server's 400, which names neither version. ?action=save writes the slot's tokens in
that version.

Behaviour switches (environment, inherited from kvshare-serve):
  FAKE_DECODER_LOG=path        append one JSON object per event
  FAKE_DECODER_RESTORE=fail|short   refuse every restore (400) / restore one token less
  FAKE_DECODER_RESTORE_MS=x    the restore_ms it reports (default 1.25)
  FAKE_DECODER_IGNORE_CACHE=1  never reuse the slot (prompt_n = prompt length)
  FAKE_DECODER_EXIT_AFTER=n    exit with code 3 after n completion requests
  FAKE_DECODER_CHUNK_DELAY_MS  pause between SSE chunks (default 0)
  FAKE_DECODER_REFUSE_SHARE=1  answer ?action=share with 501 (a decoder that cannot export)
  FAKE_DECODER_SHARE_HEADER=path   the layout header it sends (one memfd per chunk);
                               else one chunk of FAKE_DECODER_SHARE_BYTES (default 65536)
  FAKE_DECODER_ADOPT=fail      refuse every adopt (400)
  FAKE_DECODER_UNSEALED=1      share memfds not sealed against shrinking (a broker refuses them)
  FAKE_DECODER_STATE_VERSION=n the state-file version it saves and restores (default 3)
  FAKE_DECODER_SAVE=fail|fail_first   answer every ?action=save / the first one with 500
  FAKE_DECODER_ERASE=fail      answer every erase with 500
  FAKE_DECODER_SHARE=noconnect|fewer_fds   answer share 200 but never connect / send one fd
                               less than the header's chunks
  FAKE_DECODER_SHARE=replay    put share_id 1 in every share message (the first share's
                               message replayed) while the reply names the new id
  FAKE_DECODER_SHARE=no_id     answer share 200 without a share_id
  FAKE_DECODER_SLOT_CTX=n       GET /props says each slot holds n cells (default_generation_settings.n_ctx),
                               as llama-server does after capping -c / -np at the training context;
                               unset, /props is 404
  FAKE_DECODER_DIE=adopt|completion   exit (code 9) in the middle of an adopt / after the
                               first chunk of a streamed reply

Stale cells, as a real cache has them: from a share until the adopt, a restore, an erase or a full
recompute, the shared region may hold bytes the slot's cached tokens do not describe. A
completion that reuses any cached token then (cache_n > 0) answers a WRONG reply
("stale cells ..."): the tests' proof that serve never lets that happen.
"""
import argparse
import fcntl
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse, parse_qs

BOS = 1
STATE_MAGIC = 0x67677371


def tokenize(text, add_special=True):
    ids = [BOS] if add_special else []
    return ids + [b + 10 for b in text.encode("utf-8")]


def apply_template(messages):
    out = ""
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        out += "<|im_start|>%s\n%s<|im_end|>\n" % (message.get("role", "user"), content)
    return out + "<|im_start|>assistant\n"


def reply_words(ids):
    """The reply a prompt gets: a pure function of its ids."""
    digest = zlib.crc32(bytes(i & 0xFF for i in ids))
    return ["reply", "to", "%d" % len(ids), "tokens", "%08x" % digest]


class Slot:
    def __init__(self):
        self.lock = threading.Lock()  # held while a task runs: restores and requests wait
        self.tokens = []
        self.share_id = 0
        self.share_regions = []  # (memfd, size) per chunk of the latest share
        self.cells_may_be_stale = False  # shared and neither adopted, erased nor recomputed since


class State:
    args = None
    slot = Slot()
    log_lock = threading.Lock()
    completions = 0
    completions_lock = threading.Lock()
    n_saves = 0  # under the slot's lock


def log(event, **fields):
    path = os.environ.get("FAKE_DECODER_LOG")
    if not path:
        return
    fields["event"] = event
    fields["t"] = time.monotonic()
    with State.log_lock, open(path, "a") as out:
        out.write(json.dumps(fields) + "\n")


def state_version():
    return int(os.environ.get("FAKE_DECODER_STATE_VERSION", "3"))


def read_state_tokens(path):
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12:
            raise ValueError("truncated header")
        magic, version, n_token = struct.unpack("<III", head)
        if magic != STATE_MAGIC or version != state_version():
            raise ValueError("unknown (magic, version) for sequence state file: %08x, %08x" % (magic, version))
        data = f.read(4 * n_token)
        if len(data) != 4 * n_token:
            raise ValueError("truncated tokens")
        return list(struct.unpack("<%di" % n_token, data))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt, *args):
        pass

    def send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_error_json(self, status, message, kind):
        self.send_json(status, {"error": {"code": status, "message": message, "type": kind}})

    def do_GET(self):
        path = urlparse(self.path).path
        log("get", path=path)
        if path == "/health":
            self.send_json(200, {"status": "ok"})
        elif path == "/props" and os.environ.get("FAKE_DECODER_SLOT_CTX"):
            self.send_json(200, {"default_generation_settings": {"n_ctx": int(os.environ["FAKE_DECODER_SLOT_CTX"])}})
        else:
            self.send_error_json(404, "File Not Found", "not_found_error")

    def read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return raw

    def do_POST(self):
        url = urlparse(self.path)
        raw = self.read_body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            self.send_error_json(500, "bad json", "server_error")
            return
        query = parse_qs(url.query)
        log("post", path=url.path, query={k: v[0] for k, v in query.items()}, body=body)
        if url.path == "/apply-template":
            self.send_json(200, {"prompt": apply_template(body.get("messages", []))})
        elif url.path == "/tokenize":
            self.send_json(200, {"tokens": tokenize(body.get("content", ""), body.get("add_special", False))})
        elif url.path.startswith("/slots/"):
            self.slot_action(url.path, query.get("action", [""])[0], body)
        elif url.path in ("/v1/chat/completions", "/v1/completions", "/completion"):
            self.complete(url.path, body)
        else:
            self.send_error_json(404, "File Not Found", "not_found_error")

    def slot_action(self, path, action, body):
        slot = State.slot
        if action == "restore":
            filename = body.get("filename", "")
            full = os.path.join(State.args.slot_save_path, filename)
            # Whether a completion was still running when the restore arrived (it would land
            # under a decode on a real server that does not defer it).
            log("restore_requested", filename=filename, slot_busy=slot.lock.locked())
            with slot.lock:
                exists = os.path.isfile(full)
                log("restore", filename=filename, exists=exists, in_slot_dir=os.path.dirname(full) ==
                    State.args.slot_save_path.rstrip("/"), body=body)
                mode = os.environ.get("FAKE_DECODER_RESTORE", "")
                try:
                    if mode == "fail":
                        raise ValueError("refused on demand")
                    tokens = read_state_tokens(full)
                except (OSError, ValueError) as error:
                    slot.tokens = []
                    log("restore_failed", reason=str(error))
                    self.send_error_json(400, "Unable to restore slot, no available space in KV cache or invalid "
                                         "slot save file", "invalid_request_error")
                    return
                if mode == "short":
                    tokens = tokens[:-1]
                slot.tokens = tokens
                slot.cells_may_be_stale = False  # the restore wrote the cells of every token it set
                restore_ms = float(os.environ.get("FAKE_DECODER_RESTORE_MS", "1.25"))
                self.send_json(200, {"id_slot": 0, "filename": filename, "n_restored": len(tokens),
                                     "n_read": os.path.getsize(full), "timings": {"restore_ms": restore_ms}})
        elif action == "save":
            filename = body.get("filename", "")
            full = os.path.join(State.args.slot_save_path, filename)
            with slot.lock:
                log("save", filename=filename, n_tokens=len(slot.tokens))
                save_mode = os.environ.get("FAKE_DECODER_SAVE", "")
                State.n_saves += 1
                if save_mode == "fail" or (save_mode == "fail_first" and State.n_saves == 1):
                    self.send_error_json(500, "Unable to save slot", "server_error")
                    return
                with open(full, "wb") as out:
                    out.write(struct.pack("<III", STATE_MAGIC, state_version(), len(slot.tokens)))
                    out.write(struct.pack("<%di" % len(slot.tokens), *slot.tokens))
                self.send_json(200, {"id_slot": 0, "filename": filename, "n_saved": len(slot.tokens),
                                     "n_written": os.path.getsize(full), "timings": {"save_ms": 0.5}})
        elif action == "erase":
            if os.environ.get("FAKE_DECODER_ERASE") == "fail":
                log("erase_failed")
                self.send_error_json(500, "erase failed on demand", "server_error")
                return
            with slot.lock:
                n = len(slot.tokens)
                slot.tokens = []
                slot.cells_may_be_stale = False
                self.send_json(200, {"id_slot": 0, "n_erased": n})
        elif action == "share":
            self.share(body)
        elif action == "adopt":
            self.adopt(body)
        else:
            self.send_error_json(400, "Invalid action", "invalid_request_error")

    def share(self, body):
        slot = State.slot
        if not os.environ.get("ONEBIT_KV_SHARE") or os.environ.get("FAKE_DECODER_REFUSE_SHARE"):
            log("share_refused")
            self.send_error_json(501, "share refused: ONEBIT_KV_SHARE is not set in the decoder, or its KV "
                                 "backend cannot export its memory", "not_supported_error")
            return
        with slot.lock:
            slot.share_id += 1
            header_path = os.environ.get("FAKE_DECODER_SHARE_HEADER")
            header = json.load(open(header_path)) if header_path else {}
            chunks = header.get("chunks") or [{"size_bytes": int(os.environ.get("FAKE_DECODER_SHARE_BYTES", "65536")),
                                               "layout_hash": "0x%016x" % 0}]
            mode = os.environ.get("FAKE_DECODER_SHARE", "")
            if mode == "noconnect":
                log("share_not_connecting")
                self.send_json(200, {"id_slot": 0, "share_id": slot.share_id, "n_fds": len(chunks),
                                     "backend": "memfd", "region_bytes": 0, "timings": {"share_ms": 0.5}})
                return
            tokens = body.get("tokens")
            if tokens is not None and (not isinstance(tokens, list) or
                                       not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens)):
                self.send_error_json(400, 'share: "tokens" must be an array of token ids', "invalid_request_error")
                return
            # The region is the cache's own memory, exported once: the cells it holds
            # outlive a share, as a real decoder's do.
            if [size for _, size in slot.share_regions] != [c["size_bytes"] for c in chunks]:
                for fd, _ in slot.share_regions:
                    os.close(fd)
                slot.share_regions = []
                for chunk in chunks:
                    fd = os.memfd_create("kvshare-fake-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                    os.ftruncate(fd, chunk["size_bytes"])
                    # As a real exporter does: a peer's mapping can never lose its pages under it.
                    if not os.environ.get("FAKE_DECODER_UNSEALED"):
                        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
                    slot.share_regions.append((fd, chunk["size_bytes"]))
                write_cells(slot)
            # The prefix of the ids whose cells the slot holds (stale cells hold nothing).
            n_cached = 0
            if tokens is not None and not slot.cells_may_be_stale:
                while n_cached < min(len(tokens), len(slot.tokens)) and tokens[n_cached] == slot.tokens[n_cached]:
                    n_cached += 1
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            try:
                sock.connect(body["socket"])
                log("share_connected", socket=body["socket"], share_id=slot.share_id,
                    socket_dir_mode=oct(os.stat(os.path.dirname(body["socket"])).st_mode & 0o777))
                frame = share_frame(1 if mode == "replay" else slot.share_id, chunks, header)
                fds = [fd for fd, _ in slot.share_regions]
                if mode == "fewer_fds":
                    fds = fds[:-1]
                socket.send_fds(sock, [frame], fds)
                # A provider may write the regions from now on.
                slot.cells_may_be_stale = mode != "fewer_fds"
                log("share_sent", share_id=slot.share_id, n_fds=len(chunks))
            except OSError as error:
                log("share_failed", reason=str(error))
                self.send_error_json(500, "Unable to share the KV cache: %s" % error, "server_error")
                return
            finally:
                sock.close()
            reply = {"id_slot": 0, "share_id": slot.share_id, "n_fds": len(chunks), "backend": "memfd",
                     "region_bytes": sum(size for _, size in slot.share_regions), "timings": {"share_ms": 0.5},
                     "n_cached": n_cached}
            log("share_reply", n_cached=reply.get("n_cached"), n_tokens=None if tokens is None else len(tokens))
            if mode == "no_id":
                del reply["share_id"]
            self.send_json(200, reply)

    def adopt(self, body):
        slot = State.slot
        with slot.lock:
            tokens = body.get("tokens", [])
            share_id = body.get("share_id")
            written = None
            if slot.share_regions:
                fd, size = slot.share_regions[0]
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as region:
                    n = struct.unpack_from("<I", region, 0)[0]
                    if 0 < n <= (size - 4) // 4:
                        written = list(struct.unpack_from("<%di" % n, region, 4))
            log("adopt", share_id=share_id, n_tokens=len(tokens), region_holds_tokens=(written == tokens), body=body)
            if os.environ.get("FAKE_DECODER_DIE") == "adopt":
                log("exiting", code=9)
                os._exit(9)
            if os.environ.get("FAKE_DECODER_ADOPT") == "fail":
                self.send_error_json(400, "adopt refused on demand", "invalid_request_error")
                return
            if share_id != slot.share_id:
                self.send_error_json(400, "stale share_id %s (latest %d)" % (share_id, slot.share_id),
                                     "invalid_request_error")
                return
            n_cached = body.get("n_cached", 0)
            if tokens[:n_cached] != slot.tokens[:n_cached]:
                self.send_error_json(400, "adopt: n_cached %d: the slot no longer holds them" % n_cached,
                                     "invalid_request_error")
                return
            if written != tokens:
                self.send_error_json(400, "the region does not hold the tokens", "invalid_request_error")
                return
            slot.tokens = list(tokens)
            slot.cells_may_be_stale = False
            self.send_json(200, {"id_slot": 0, "share_id": share_id, "n_adopted": len(tokens),
                                 "timings": {"adopt_ms": 0.25}})

    def complete(self, path, body):
        if path == "/v1/chat/completions":
            ids = tokenize(apply_template(body.get("messages", [])))
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
                ids = list(prompt)
            else:
                if isinstance(prompt, list):
                    prompt = "".join(p for p in prompt if isinstance(p, str))
                ids = tokenize(prompt)
        slot = State.slot
        with slot.lock:
            cache_n = 0
            if body.get("cache_prompt", True) and not os.environ.get("FAKE_DECODER_IGNORE_CACHE"):
                while cache_n < min(len(ids), len(slot.tokens)) and ids[cache_n] == slot.tokens[cache_n]:
                    cache_n += 1
                cache_n = min(cache_n, len(ids) - 1)
            prompt_n = len(ids) - cache_n
            stale = slot.cells_may_be_stale and cache_n > 0
            slot.tokens = list(ids)
            slot.cells_may_be_stale = stale  # a full recompute overwrote every cell
            if not stale:
                write_cells(slot)  # the decoder's own evaluation fills its cells
            log("completion", path=path, n_prompt=len(ids), cache_n=cache_n, prompt_n=prompt_n, body=body,
                used_stale_cells=stale)
            words = reply_words(ids) if not stale else ["stale", "cells", "reused", "wrong", "reply"]
            timings = {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 1.0, "predicted_n": len(words),
                       "predicted_ms": 1.0}
            if body.get("stream"):
                self.stream_reply(path, words, timings)
            else:
                text = " ".join(words)
                if path == "/v1/chat/completions":
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": "stop"}
                self.send_json(200, {"choices": [choice], "timings": timings,
                                     "usage": {"prompt_tokens": len(ids), "completion_tokens": len(words)}})
        with State.completions_lock:
            State.completions += 1
            exit_after = int(os.environ.get("FAKE_DECODER_EXIT_AFTER") or 0)
            if exit_after and State.completions >= exit_after:
                log("exiting", code=3)
                threading.Timer(0.05, lambda: os._exit(3)).start()

    def stream_reply(self, path, words, timings):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        delay = float(os.environ.get("FAKE_DECODER_CHUNK_DELAY_MS", "0")) / 1000.0
        for chunk in sse_chunks(path, words, timings):
            self.wfile.write(chunk)
            self.wfile.flush()
            if os.environ.get("FAKE_DECODER_DIE") == "completion":
                log("exiting", code=9)
                os._exit(9)
            if delay:
                time.sleep(delay)


def write_cells(slot):
    """The fake's cells: the first chunk holds u32 n, then n token ids (what a provider
    writes there too)."""
    if not slot.share_regions:
        return
    fd, size = slot.share_regions[0]
    n = min(len(slot.tokens), (size - 4) // 4)
    with mmap.mmap(fd, size) as region:
        struct.pack_into("<I", region, 0, n)
        if n:
            struct.pack_into("<%di" % n, region, 4, *slot.tokens[:n])


def share_frame(share_id, chunks, header):
    """One handshake frame as docs/protocol.md defines it: u32 length (little-endian), then
    the JSON message; the fds ride with it in SCM_RIGHTS."""
    message = {"kvshare_handshake": 1, "type": "share", "share_id": share_id,
               "fds": [{"chunk": i, "kind": "memfd", "offset": 0, "size_bytes": c["size_bytes"],
                        "layout_hash": c["layout_hash"]} for i, c in enumerate(chunks)],
               "header": header}
    text = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack("<I", len(text)) + text


def sse_chunks(path, words, timings):
    """The exact bytes of a streamed reply (the tests rebuild them to compare)."""
    chunks = []
    for i, word in enumerate(words):
        text = word if i == 0 else " " + word
        if path == "/v1/chat/completions":
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None}
        chunks.append(("data: %s\n\n" % json.dumps({"choices": [choice]})).encode())
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "timings": timings}
    chunks.append(("data: %s\n\n" % json.dumps(final)).encode())
    chunks.append(b"data: [DONE]\n\n")
    return chunks


def main():
    # llama-server's other flags (-m, -np, -c, -fa, -ctk, -ctv...) are logged, not used.
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--slot-save-path", default="")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args, extra = parser.parse_known_args()
    State.args = args
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    log("start", argv=sys.argv[1:], extra=extra, pid=os.getpid(), slot_dir=args.slot_save_path,
        slot_dir_mode=oct(os.stat(args.slot_save_path).st_mode & 0o777) if args.slot_save_path else None,
        kv_share=os.environ.get("ONEBIT_KV_SHARE"))
    # llama-server's accept queue is deep; the stdlib default of 5 would reset a burst.
    ThreadingHTTPServer.request_queue_size = 128
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
