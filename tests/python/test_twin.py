"""The Python twins (python/kiln_py/models.py) against kiln's C++ models: from kiln's initial
weights, on kiln's first-step batches, the same loss and the same gradients (kiln peer export
writes them: kiln.json and grads.safetensors)."""
import json
import os
import subprocess
import tempfile
import tomllib
import unittest

import support  # noqa: F401  (import path)
import torch
from safetensors.torch import load_file

from kiln_py import models

TOLERANCE = 1e-5


class TwinMatchesKiln(unittest.TestCase):
    def export(self, config, overrides, out):
        cmd = [support.kiln_cli(), "peer", "export", os.path.join(support.REPO, config),
               "--steps", "1", "--out", out, "--set", "run.threads=2"]
        for o in overrides:
            cmd += ["--set", o]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "kiln.json")) as f:
            return json.load(f)

    def check(self, config, overrides, accum):
        with tempfile.TemporaryDirectory(prefix="kiln-twin-") as out:
            kiln = self.export(config, overrides, out)
            with open(os.path.join(out, "config.toml"), "rb") as f:
                cfg = tomllib.load(f)
            self.assertEqual(cfg["train"]["grad_accum_steps"], accum)
            twin = models.WithLoss(models.from_config(cfg["model"]))
            twin.load_state_dict(load_file(os.path.join(out, "init.safetensors")), strict=True)
            batches = load_file(os.path.join(out, "batches.safetensors"))
            kiln_grads = load_file(os.path.join(out, "grads.safetensors"))

        names = [n for n, _ in twin.named_parameters()]
        self.assertEqual(sorted(kiln_grads), sorted(names), "grads.safetensors names every parameter")
        params = list(twin.parameters())
        total, grads = 0.0, [torch.zeros_like(p) for p in params]
        for m in range(accum):
            loss = twin(batches[f"step0.micro{m}.inputs"], batches[f"step0.micro{m}.targets"]) / accum
            for g, d in zip(grads, torch.autograd.grad(loss, params)):
                g += d
            total += loss.item()
        self.assertLessEqual(abs(total - kiln["loss"][0]) / abs(kiln["loss"][0]), TOLERANCE,
                             f"loss: twin {total}, kiln {kiln['loss'][0]}")
        # kiln's compile step binds the twin's parameters by name (torch.export swaps them in
        # through getattr from the WithLoss, as functional_call does): the same loss that way.
        inputs, targets = batches["step0.micro0.inputs"], batches["step0.micro0.targets"]
        with torch.no_grad():
            self.assertEqual(
                torch.func.functional_call(twin, dict(twin.named_parameters()), (inputs, targets)).item(),
                twin(inputs, targets).item())
        for name, g in zip(names, grads):
            self.assertGreater(kiln_grads[name].abs().max().item(), 0, f"{name}: kiln's gradient is zero")
            diff = support.max_relative_difference(g, kiln_grads[name])
            self.assertLessEqual(diff, TOLERANCE, f"{name}: gradient differs by {diff:.2e}")

    def test_mlp(self):
        self.check("configs/mlp.toml", ["model.input_dim=12", "model.hidden_dim=24",
                                        "model.num_classes=5", "train.batch_size=8"], accum=1)

    def test_gpt_one_layer_with_accumulation(self):
        # The byte-level text data needs a vocabulary of 256.
        self.check("configs/gpt-tiny.toml",
                   ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
                    "model.vocab_size=256", "data.seq_len=16", "train.batch_size=8",
                    "train.grad_accum_steps=2"], accum=2)

    def test_llama_grouped_query_with_accumulation(self):
        # 2 layers, 4 query heads over 2 key/value heads, untied head; then tied (no lm_head).
        shape = ["model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
                 "model.intermediate_size=48", "data.seq_len=16", "train.batch_size=8"]
        self.check("configs/llama-tiny.toml", shape + ["train.grad_accum_steps=2"], accum=2)
        self.check("configs/llama-tiny.toml",
                   shape + ["model.tie_embeddings=true", "model.rope_theta=500000"], accum=1)


if __name__ == "__main__":
    unittest.main()
