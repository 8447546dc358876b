#!/usr/bin/env python3
"""Writes tests/data/remote-state-v1.bin, the worked example of docs/remote.md's remote state
payload, byte by byte from the format's table (not with kvshare's encoder, so the encoder and
the reader cannot share a mistake): the envelope around tests/data/state-v3-dense-f16.bin (a
llama-server save of the ids 39 72 106 105 0, -fa on, f16 K and V, state version 3).

The model and tokenizer hashes are example values: the vector pins the encoding, not a model.
Run once; the file is never edited afterwards (a new format version gets a new vector).

usage: make_remote_state_vector.py DATA_DIR
"""
import json
import os
import struct
import sys

IDS = [39, 72, 106, 105, 0]


def fnv1a64_ids(ids):
    h = 0xcbf29ce484222325
    for i in ids:
        for b in struct.pack("<i", i):
            h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def main():
    data = sys.argv[1]
    state = open(os.path.join(data, "state-v3-dense-f16.bin"), "rb").read()
    binding = {  # the key order is the format's
        "model": "0x4d6f64656c2d6670",
        "tokenizer": "0x546f6b656e697a72",
        "state_version": 3,
        "n_tokens": len(IDS),
        "tokens_hash": "0x%016x" % fnv1a64_ids(IDS),
        "cache_type_k": "f16",
        "cache_type_v": "f16",
        "v_trans": False,
    }
    text = json.dumps(binding, separators=(",", ":")).encode()
    header = b"KVSP" + struct.pack("<HHIQ", 1, 0, len(text), len(state))
    with open(os.path.join(data, "remote-state-v1.bin"), "wb") as out:
        out.write(header + text + state)


if __name__ == "__main__":
    main()
