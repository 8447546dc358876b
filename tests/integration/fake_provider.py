#!/usr/bin/env python3
"""A stand-in prefill provider for kvshare-serve's tests, both forms of the contract:

  fake_provider.py --tokens IDS --out STATE --model M [--elfs DIR]          (file route)
  fake_provider.py --tokens IDS --model M --layout HEADER --fds n[,n...]    (shared route)

File route: writes a state file whose token section is the ids (u32 'ggsq', u32 version,
u32 n, i32 ids), or copies FAKE_PROVIDER_COPY=path (a prepared state file). The version is
FAKE_PROVIDER_STATE_VERSION, else ONEBIT_HYBRID_STATE_VERSION (serve's word on what the
decoder reads), else 2 (a provider that predates version 3).
Shared route: checks what it inherited (each --fds number open, a memfd, as large as the
header's chunk, and no other descriptor but 0-2), then writes u32 n + i32 ids at the start
of the first region: the fake decoder checks those bytes at adopt.
Prints {"prefill_ms": FAKE_PROVIDER_PREFILL_MS} (default 12.5; "none": prints nothing) last.

FAKE_PROVIDER_MODE: ok (default) | fail (exit 3) | exit130 (exit 130, not a signal) | hang
(sleep past any timeout, with a grandchild in its group) | nofile (exit 0, write nothing) |
slow (FAKE_PROVIDER_SLEEP_MS then ok) | garbage (binary junk on stdout, no summary line,
then ok) | short (a state file cut in its token list) | badversion (state-file version 99)
| wrongcount (one token less than asked) | killed (writes half, then SIGKILL to itself).
FAKE_PROVIDER_MODE_FILE=path: the mode is read from this file at each run (when it exists),
so one serve can see a provider that works, then one that fails.
FAKE_PROVIDER_LOG=path: one JSON line per run.
"""
import argparse
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import time

STATE_MAGIC = 0x67677371


def read_ids(path):
    text = open(path).read().strip()
    if text.startswith("["):
        return json.loads(text)
    return [int(line) for line in text.split()]


def log(record):
    path = os.environ.get("FAKE_PROVIDER_LOG")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def inherited_fds():
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink("/proc/self/fd/" + name)
        except OSError:
            pass  # the listing's own descriptor, gone by now
    return fds


def main():
    fds_at_start = inherited_fds()
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out")
    parser.add_argument("--model", required=True)
    parser.add_argument("--elfs")
    parser.add_argument("--layout")
    parser.add_argument("--fds")
    parser.add_argument("-c")
    parser.add_argument("-fa")
    parser.add_argument("-ctk")
    parser.add_argument("-ctv")
    # FAKE_PROVIDER_NO_CACHED=1: a provider from before --cached (argparse exits 2 on it).
    if not os.environ.get("FAKE_PROVIDER_NO_CACHED"):
        parser.add_argument("--cached", type=int, default=0)
    args = parser.parse_args()
    cached = getattr(args, "cached", 0)
    mode = os.environ.get("FAKE_PROVIDER_MODE", "ok")
    mode_file = os.environ.get("FAKE_PROVIDER_MODE_FILE")
    if mode_file and os.path.exists(mode_file):
        mode = open(mode_file).read().strip() or mode
    ids = read_ids(args.tokens)
    record = {"argv": sys.argv[1:], "pid": os.getpid(), "pgid": os.getpgid(0), "mode": mode, "n_ids": len(ids),
              "ids": ids, "fds_at_start": {str(k): v for k, v in fds_at_start.items()}, "t_start": time.monotonic(),
              "state_version_env": os.environ.get("ONEBIT_HYBRID_STATE_VERSION")}

    if mode == "fail":
        log(record)
        print("fake provider: failing on demand", file=sys.stderr)
        sys.exit(3)
    if mode == "exit130":
        log(record)
        print("fake provider: exiting 130 on demand", file=sys.stderr)
        sys.exit(130)
    if mode == "wrongcount":
        ids = ids[:-1]
    if mode == "hang":
        child = subprocess.Popen(["sleep", "60"])
        record["grandchild_pid"] = child.pid
        log(record)
        time.sleep(60)
        sys.exit(0)
    if mode == "slow":
        time.sleep(float(os.environ.get("FAKE_PROVIDER_SLEEP_MS", "1000")) / 1000.0)

    if args.fds is not None:
        numbers = [int(n) for n in args.fds.split(",")]
        header = json.load(open(args.layout))
        record["layout_header"] = header
        checks = {}
        for n in numbers:
            target = fds_at_start.get(n, "")
            checks[str(n)] = {"open": n in fds_at_start, "memfd": target.startswith("/memfd:"),
                              "size": os.fstat(n).st_size if n in fds_at_start else -1}
        record["fd_checks"] = checks
        record["other_fds"] = sorted(k for k in fds_at_start if k > 2 and k not in numbers)
        if not all(c["open"] and c["memfd"] for c in checks.values()) or record["other_fds"]:
            log(record)
            print("fake provider: unexpected descriptors %s" % record, file=sys.stderr)
            sys.exit(4)
        size = os.fstat(numbers[0]).st_size
        with mmap.mmap(numbers[0], size) as region:
            # --cached P: cells 0..P-1 are the decoder's and must hold the first P ids; only
            # cells P.. are written (docs/provider.md).
            record["cached"] = cached
            if cached:
                held_n = struct.unpack_from("<I", region, 0)[0]
                held = list(struct.unpack_from("<%di" % min(cached, held_n), region, 4)) if held_n else []
                if held != ids[:cached]:
                    record["cached_cells_wrong"] = held
                    log(record)
                    print("fake provider: cells 0..%d do not hold the cached ids" % (cached - 1), file=sys.stderr)
                    sys.exit(5)
            struct.pack_into("<I", region, 0, len(ids))
            if mode == "killed":
                record["killed_mid_write"] = True
                log(record)
                os.kill(os.getpid(), 9)
            if len(ids) > cached:
                struct.pack_into("<%di" % (len(ids) - cached), region, 4 + 4 * cached, *ids[cached:])
        record["wrote_region"] = True
        record["wrote_cells"] = [cached, len(ids)]
    elif mode != "nofile":
        copy = os.environ.get("FAKE_PROVIDER_COPY")
        if copy:
            shutil.copyfile(copy, args.out)
        else:
            version = int(os.environ.get("FAKE_PROVIDER_STATE_VERSION") or
                          os.environ.get("ONEBIT_HYBRID_STATE_VERSION") or 2)
            data = struct.pack("<III", STATE_MAGIC, 99 if mode == "badversion" else version, len(ids))
            data += struct.pack("<%di" % len(ids), *ids)
            if mode == "short":
                data = data[:len(data) - 6]
            with open(args.out, "wb") as out:
                if mode == "killed":
                    out.write(data[:len(data) // 2])
                    out.flush()
                    record["killed_mid_write"] = True
                    log(record)
                    os.kill(os.getpid(), 9)
                out.write(data)
        record["wrote"] = args.out
    record["t_end"] = time.monotonic()
    log(record)
    if mode == "garbage":
        sys.stdout.buffer.write(bytes(range(256)) * 4 + b"\n{not json\n")
        sys.stdout.flush()
        return
    prefill = os.environ.get("FAKE_PROVIDER_PREFILL_MS", "12.5")
    print("fake provider: prefilled %d tokens" % len(ids))
    if prefill != "none":
        print(json.dumps({"prefill_ms": float(prefill)}))


if __name__ == "__main__":
    main()
