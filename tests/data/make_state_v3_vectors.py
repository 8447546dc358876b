#!/usr/bin/env python3
"""Writes the state-version-3 golden vectors tests/data/state-v3-*.bin with a real
llama-server (the pinned tree, scripts/build-llama-server.sh), exactly as a user's
POST /slots/0?action=save would: the tiny qwen3 model `kvshare-mkmodel` makes by default
(the v2 vectors' model), the prompt "Hi there!" as the ids 39 72 106 105 0 (its /tokenize
with add_special), evaluated by a /completion with n_predict 0, then saved.

Run once when the pin moves to a new state version; the files are never edited afterwards.

usage: make_state_v3_vectors.py LLAMA_SERVER BIN_DIR OUT_DIR
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from hybrid_common import LlamaServer  # noqa: E402

IDS = [39, 72, 106, 105, 0]
VECTORS = [  # file, -fa, -ctk/-ctv
    ("state-v3-dense-f16.bin", "on", "f16"),
    ("state-v3-dense-f16-vtrans.bin", "off", "f16"),
    ("state-v3-dense-q8_0.bin", "on", "q8_0"),
]


def main():
    llama, bin_dir, out_dir = sys.argv[1:4]
    work = tempfile.mkdtemp(prefix="state-v3-")
    model = os.path.join(work, "tiny-qwen3.gguf")
    subprocess.run([os.path.join(bin_dir, "kvshare-mkmodel"), model], check=True, capture_output=True)
    for name, fa, cache in VECTORS:
        args = ["-m", model, "-c", "512", "-np", "1", "-t", "1", "-fa", fa, "-ctk", cache, "-ctv", cache,
                "--slot-save-path", work + "/"]
        with LlamaServer(llama, args) as server:
            status, tokens = server.post("/tokenize", {"content": "Hi there!", "add_special": True, "parse_special": True})
            if tokens["tokens"] != IDS:
                raise SystemExit("the model tokenizes 'Hi there!' as %s, the vectors expect %s" % (tokens, IDS))
            server.post("/completion", {"prompt": IDS, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
            status, saved = server.post("/slots/0?action=save", {"filename": name})
            if status != 200:
                raise SystemExit("save: %d %s" % (status, saved))
            os.replace(os.path.join(work, name), os.path.join(out_dir, name))
            print("%s: %s" % (name, saved))


if __name__ == "__main__":
    main()
