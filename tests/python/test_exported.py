"""Hugging Face families beyond GPT-2 and Llama, imported with `kiln model import --hf` and trained
by kiln from C++ (model.name = "exported"), against PyTorch's own eager training of the same
transformers model on kiln's batches with kiln's initial weights (bench/peer/peer.py replays them):
20 steps of AdamW, losses within 1e-5 relative. Random tiny configs, written here."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import support
import transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64)
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **COMMON),
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=None,
                                                  **COMMON),
    "phi3": lambda: transformers.Phi3Config(num_key_value_heads=2, pad_token_id=0, **COMMON),
}
PEER = os.path.join(support.REPO, "bench", "peer", "peer.py")


class HuggingFaceFamilies(unittest.TestCase):
    def check(self, family, after_import=None, extra=()):
        with tempfile.TemporaryDirectory(prefix=f"kiln-exported-{family}-") as scratch:
            hf, package = os.path.join(scratch, "hf"), os.path.join(scratch, "package")
            model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
            model.save_pretrained(hf)
            subprocess.run([support.kiln_cli(), "model", "import", "--hf", hf, "--max-seq", "32",
                            "--out", package], check=True, stdout=subprocess.DEVNULL)
            with open(os.path.join(package, "package.json")) as f:
                units = json.load(f)["units"]
            # The decoder layers are the units (activation checkpointing and FSDP wrap each).
            self.assertEqual(units, {"prefix": "model.layers", "count": 2}, family)
            if after_import:
                after_import(hf)
            r = subprocess.run(
                [sys.executable, PEER, "--kiln", support.kiln_cli(),
                 "--config", os.path.join(support.REPO, "configs", "gpt-tiny.toml"),
                 "--steps", "20", "--tolerance", "1e-5", "--set", "model.name=exported",
                 "--set", f"model.package={package}", "--set", "train.batch_size=4",
                 "--set", "data.seq_len=32", "--set", "run.threads=1", *extra],
                capture_output=True, text=True, env=support.env_with_python_path())
            print(f"{family}: {r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ''}")
            return r

    def test_three_families_train_as_pytorch(self):
        for family in FAMILIES:
            with self.subTest(family=family):
                # Phi-3 (fused qkv and gate_up projections) trains with each decoder layer
                # recomputed in backward: still PyTorch's eager losses.
                extra = ("--set", "train.activation_checkpointing=block") if family == "phi3" \
                    else ()
                r = self.check(family, extra=extra)
                self.assertEqual(r.returncode, 0, r.stdout[-2000:] + r.stderr[-2000:])
                if extra:  # kiln's side ran with the recomputation installed
                    self.assertIn("2 units (model.layers.0 .. model.layers.1) recomputed",
                                  r.stdout + r.stderr)
                self.assertIn("AGREE", r.stdout)

    def test_another_function_disagrees(self):
        # Negative control: after the import, the Hugging Face directory's rotary base and norm
        # epsilon change, so the Python side (rebuilt from that directory) computes another
        # function than the graph kiln trains: the comparison must fail.
        def change_rope(hf):
            path = os.path.join(hf, "config.json")
            with open(path) as f:
                config = json.load(f)
            config["rope_theta"], config["rms_norm_eps"] = 50.0, 0.5
            with open(path, "w") as f:
                json.dump(config, f)

        r = self.check("qwen2", change_rope)
        self.assertNotEqual(r.returncode, 0, r.stdout[-2000:])
        self.assertIn("DISAGREE", r.stdout)


if __name__ == "__main__":
    unittest.main()
