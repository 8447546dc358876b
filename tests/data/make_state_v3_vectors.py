#!/usr/bin/env python3
"""Writes the state-version-3 golden vectors tests/data/state-v3-*.bin with a real
llama-server (the pinned tree, scripts/build-llama-server.sh), exactly as a user's
POST /slots/0?action=save would: the tiny qwen3 model `kvshare-mkmodel` makes by default
(the v2 vectors' model), the prompt "Hi there!" as the ids 39 72 106 105 0 (its /tokenize
with add_special), evaluated by a /completion with n_predict 0, then saved.

Run once when the pin moves to a new state version; the files are never edited afterwards.
Naming files writes only those. The f16 and q8_0 vectors came from the pin 80fb11ac; the
q4_0, q4_1, q5_0, q5_1, iq4_nl and f32 ones were added later from the pin de3ff815 by naming
them: make_state_v3_vectors.py LLAMA_SERVER BIN_DIR tests/data state-v3-dense-q4_0.bin
state-v3-dense-q4_1.bin state-v3-dense-q5_0.bin state-v3-dense-q5_1.bin
state-v3-dense-iq4_nl.bin state-v3-dense-f32.bin. de3ff815 has the same state version and
its q8_0 save is 80fb11ac's to the byte, but its f32 K/V differ from d32676d's in the last
bit of many values (layer 0 too) and its f16 save from 80fb11ac's in 152 bytes, so the
quantized vectors come with the f32 vector of their own generation, the rows they were
quantized from.

Every quantized cache is rotated by llama.cpp (Hadamard, group 64: head size 64), and a
quantized V needs -fa on. LLAMA_ATTN_ROT_DISABLE is unset for the server, as the tests that
compare our rotated rows with these files assume.

usage: make_state_v3_vectors.py LLAMA_SERVER BIN_DIR OUT_DIR [FILE...]
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
    ("state-v3-dense-q4_0.bin", "on", "q4_0"),
    ("state-v3-dense-q4_1.bin", "on", "q4_1"),
    ("state-v3-dense-q5_0.bin", "on", "q5_0"),
    ("state-v3-dense-q5_1.bin", "on", "q5_1"),
    ("state-v3-dense-iq4_nl.bin", "on", "iq4_nl"),
    ("state-v3-dense-f32.bin", "on", "f32"),
]


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__.split("\n\n")[-1].strip())
    llama, bin_dir, out_dir = sys.argv[1:4]
    names = [name for name, _, _ in VECTORS]
    wanted = sys.argv[4:] or names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise SystemExit("no vector is named %s; the vectors are %s" % (", ".join(unknown), ", ".join(names)))
    work = tempfile.mkdtemp(prefix="state-v3-")
    model = os.path.join(work, "tiny-qwen3.gguf")
    subprocess.run([os.path.join(bin_dir, "kvshare-mkmodel"), model], check=True, capture_output=True)
    for name, fa, cache in VECTORS:
        if name not in wanted:
            continue
        args = ["-m", model, "-c", "512", "-np", "1", "-t", "1", "-fa", fa, "-ctk", cache, "-ctv", cache,
                "--slot-save-path", work + "/"]
        with LlamaServer(llama, args, env={"LLAMA_ATTN_ROT_DISABLE": None}) as server:
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
