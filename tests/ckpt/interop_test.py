"""Interop with tools kiln did not write (CTest: ckpt_python_interop).

1. Python's `safetensors` loads every per-rank file of a two-rank kiln checkpoint and sees the
   tensors, dtypes, shapes and byte ranges index.json describes.
2. `kiln ckpt consolidate` writes one standard safetensors file; Python loads it and finds every
   logical tensor equal to the one reassembled from the per-rank files.
3. The consolidated GPT loads (strict) into a PyTorch GPT written here with kiln's parameter names
   and layout (nn.Linear [out, in], head tied to wte) and gives kiln's logits to 1e-5.
"""

import argparse
import json
import math
import struct
import subprocess
import sys
import unittest
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

# unittest's assertions (python -O strips bare assert statements), outside a test class.
check = unittest.TestCase()

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "U8": torch.uint8, "F64": torch.float64}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # [B, H, T, C/H]
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(n_embd, 4 * n_embd), "c_proj": nn.Linear(4 * n_embd, n_embd)})

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_size, n_embd),
            "wpe": nn.Embedding(block_size, n_embd),
            "h": nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            "ln_f": nn.LayerNorm(n_embd),
        })

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            x = block(x)
        return F.linear(t.ln_f(x), t.wte.weight)  # head tied to the token embedding


def header_of(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def reassemble(step_dir, index, name):
    info = index["tensors"][name]
    whole = torch.zeros(info["shape"], dtype=DTYPES[info["dtype"]])
    for chunk in info["chunks"]:
        with safe_open(step_dir / chunk["file"], framework="pt") as f:
            piece = f.get_tensor(chunk["name"])
        whole[tuple(slice(o, o + s) for o, s in zip(chunk["offsets"], chunk["sizes"]))] = piece
    return whole


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--fixture", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    work = Path(args.work)
    subprocess.run([args.fixture, str(work)], check=True)
    step_dir = work / "ckpt" / "step-3"
    index = json.loads((step_dir / "index.json").read_text())
    check.assertEqual(index["world_size"], 2)
    check.assertEqual(len(index["files"]), 2, index["files"])

    # 1. Every per-rank file, as Python's safetensors reads it.
    chunks_in = {}
    for info_name, info in index["tensors"].items():
        for chunk in info["chunks"]:
            chunks_in.setdefault(chunk["file"], []).append((info_name, info, chunk))
    checked = 0
    for file_info in index["files"]:
        path = step_dir / file_info["name"]
        check.assertEqual(path.stat().st_size, file_info["size_bytes"], path)
        header, data_start = header_of(path)
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            expected = {chunk["name"] for _, _, chunk in chunks_in.get(file_info["name"], [])}
            check.assertEqual(keys, expected, (path, keys ^ expected))
            for info_name, info, chunk in chunks_in[file_info["name"]]:
                t = f.get_tensor(chunk["name"])
                check.assertEqual(t.dtype, DTYPES[info["dtype"]], info_name)
                check.assertEqual(list(t.shape), chunk["sizes"], info_name)
                begin, end = header[chunk["name"]]["data_offsets"]
                check.assertEqual([data_start + begin, data_start + end], chunk["byte_range"],
                                  info_name)
                checked += 1
    check.assertEqual(len(chunks_in), 2, "both ranks hold tensors")
    print(f"per-rank files: {checked} chunks match index.json")

    # 2. The consolidated file holds every logical tensor, equal to the per-rank pieces.
    consolidated = work / "consolidated.safetensors"
    subprocess.run([args.kiln, "ckpt", "consolidate", str(step_dir), str(consolidated), "--optimizer"], check=True)
    whole = load_file(consolidated)
    for name in index["tensors"]:
        if name.startswith("rng/"):
            check.assertNotIn(name, whole)
            continue
        out_name = name[len("model/"):] if name.startswith("model/") else name
        check.assertIn(out_name, whole)
        check.assertTrue(torch.equal(whole[out_name], reassemble(step_dir, index, name)), name)
    check.assertTrue(torch.equal(whole["extra/sharded"],
                                 torch.arange(35, dtype=torch.float32).view(7, 5)))
    check.assertEqual(whole["extra/bf16"].dtype, torch.bfloat16)
    print(f"consolidated: {len(whole)} tensors equal to the reassembled per-rank pieces")

    # 3. The PyTorch GPT gives kiln's logits.
    cfg = json.loads((work / "model.json").read_text())
    model = GPT(cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["block_size"], cfg["vocab_size"])
    state = {k: v for k, v in whole.items() if not k.startswith(("optim/", "extra/"))}
    model.load_state_dict(state, strict=True)
    model.eval()
    expected = load_file(work / "expected.safetensors")
    with torch.no_grad():
        logits = model(expected["input_ids"])
    diff = (logits - expected["logits"]).abs().max().item()
    print(f"logits: max |PyTorch - kiln| = {diff:.3g}")
    check.assertTrue(math.isfinite(diff), diff)
    check.assertLessEqual(diff, 1e-5)
    print("interop ok")


if __name__ == "__main__":
    sys.exit(main())
