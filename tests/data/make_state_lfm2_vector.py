#!/usr/bin/env python3
"""Writes tests/data/state-v3-lfm2-hybrid.bin, the worked example of a hybrid (attention KV
block, then recurrent block) sequence-state file in docs/state-file.md ("Worked example: an
LFM2 file"), field by field from that page and llama.cpp's state_write functions
(llama_kv_cache::state_write_data, llama_memory_recurrent::state_write_data at de3ff815),
with nothing of kvshare, so our reader and writer cannot share a mistake with it.

The model: LFM2-shaped, 4 trunk layers; layers 0 and 2 are short-conv layers (recurrent:
n_embd 64, shortconv.l_cache 3, so n_embd_r = 64 * 2 = 128 f32 = 512 bytes, n_embd_s = 0),
layers 1 and 3 attention (1 KV head of 64: n_embd_k_gqa = n_embd_v_gqa = 64, f16 rows of
128 bytes, -fa on so v_trans 0). The prompt is 6 tokens; the file holds the first 5 (ids
1..5, positions 0..4), as llama-server's hybrid restore of prompt-1 tokens wants, so the
recurrent cell's pos is 4 = N-2.

Run once; the file is never edited afterwards (a change is a new vector).

usage: make_state_lfm2_vector.py OUT_FILE
"""
import struct
import sys

N_TOKEN = 5
IDS = [1, 2, 3, 4, 5]
N_LAYER = 4
ATTN_LAYERS = [1, 3]
RECR_LAYERS = [0, 2]
N_EMBD_KV = 64     # f16 elements per K or V row
N_EMBD_R = 128     # f32 elements per R row
N_EMBD_S = 0       # LFM2 has no S state
GGML_F32, GGML_F16 = 0, 1


def k_value(il, cell, j):
    # Exactly representable in f16: multiples of 1/32 between -0.5 and 0.6.
    return (j % 16 - 8) / 16 + cell / 32 + il / 64


def r_value(il, j):
    return (j % 32 - 16) / 32 + il / 8


def build():
    out = bytearray()
    u32 = lambda v: out.extend(struct.pack("<I", v))
    i32 = lambda v: out.extend(struct.pack("<i", v))
    u64 = lambda v: out.extend(struct.pack("<Q", v))

    # Header: magic "ggsq", version 3, n_token, the ids.
    u32(0x67677371)
    u32(3)
    u32(N_TOKEN)
    for t in IDS:
        i32(t)
    assert len(out) == 32

    # KV block of the attention layers (llama_kv_cache::state_write).
    u32(1)            # n_stream
    u32(N_TOKEN)      # cell_count
    for pos in range(N_TOKEN):
        i32(pos)      # pos
        u32(1)        # n_seq_id
        i32(0)        # seq_id
    assert len(out) == 100
    u32(0)            # v_trans
    u32(len(ATTN_LAYERS))  # n_layer: layers this cache owns
    for sign in (1, -1):   # K of every owned layer, then V
        for il in ATTN_LAYERS:
            i32(GGML_F16)
            u64(2 * N_EMBD_KV)
            for cell in range(N_TOKEN):
                for j in range(N_EMBD_KV):
                    out.extend(struct.pack("<e", sign * k_value(il, cell, j)))
    assert len(out) == 2716

    # Recurrent block (llama_memory_recurrent::state_write).
    u32(1)            # cell_count
    i32(N_TOKEN - 1)  # pos of the last token folded into the state
    u32(0)            # n_seq_id: 0 in a sequence save
    u32(0)            # s_trans
    u32(N_LAYER)      # n_layer = hparams.n_layer(): every trunk layer
    assert len(out) == 2736
    for il in RECR_LAYERS:  # R of each recurrent layer only
        i32(GGML_F32)
        u64(4 * N_EMBD_R)
        for j in range(N_EMBD_R):
            out.extend(struct.pack("<f", r_value(il, j)))
    assert len(out) == 3784
    for il in RECR_LAYERS:  # S headers: row size 0, no row bytes
        i32(GGML_F32)
        u64(4 * N_EMBD_S)
    assert len(out) == 3808
    return bytes(out)


def main():
    with open(sys.argv[1], "wb") as f:
        f.write(build())


if __name__ == "__main__":
    main()
