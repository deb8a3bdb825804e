"""Seeing a run, checked by tools kiln did not write (CTest: report.*; docs/report.md).

- transformers loads `kiln export --format hf` with no missing or unexpected keys and gives kiln's
  logits to 1e-5; kiln starts from a transformers-saved GPT-2 (model.init_from; single file and
  sharded) with transformers' loss on the same batch to 1e-5, records the weight files' SHA-256 in
  the manifest, and names the first wrong tensor or config field.
- the tensorboard package reads every scalar kiln logged, at its step, with its value.
- Holistic Trace Analysis loads the traces of a 2-rank `kiln profile`.

Environment (set by tests/report/CMakeLists.txt): KILN_CLI, KILN_HF_FIXTURE, KILN_TORCHRUN,
KILN_REPORT_WORK (scratch directory). (report.html in Chromium: browser_test.py.)
"""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import unittest
from pathlib import Path

import torch
import torch.nn.functional as F

KILN = os.environ.get("KILN_CLI", "")
WORK = Path(os.environ.get("KILN_REPORT_WORK", "/tmp/kiln-report-test"))

torch.set_num_threads(2)

GPT_SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64, "vocab_size": 256}
# Llama: 4 query heads over 2 key/value heads, SwiGLU 48, untied head.
LLAMA_SHAPE = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 48,
               "block_size": 64, "vocab_size": 256}


def run(args, expect=0, env=None):
    """Runs a command; fails the test with its output when the exit status is not `expect`."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env)
    if done.returncode != expect:
        raise AssertionError(f"{' '.join(map(str, args))}: exit {done.returncode}, expected {expect}\n"
                             f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return done


def kiln(*args, expect=0):
    return run([KILN, *args], expect=expect)


def write_config(path, name, sections):
    """A TOML config from {section: {key: value}}, run.dir beside it (each test's fresh dir)."""
    sections = {"run": {"dir": str(path.parent / "runs"), "name": name, "progress": "off"},
                **sections}
    lines = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        for key, value in keys.items():
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def gpt_sections(**train):
    return {"model": {"name": "gpt", **GPT_SHAPE},
            "data": {"name": "text", "seq_len": 32, "num_workers": 0},
            "train": {"batch_size": 4, "eval_every": 0, "eval_batches": 1, **train}}


def llama_sections(**train):
    return {"model": {"name": "llama", **LLAMA_SHAPE},
            "data": {"name": "text", "seq_len": 32, "num_workers": 0},
            "train": {"batch_size": 4, "eval_every": 0, "eval_batches": 1, **train}}


def kiln_logits(work, source, tokens):
    """kiln's logits on `tokens` (kiln_hf_fixture): a run's newest checkpoint, or a config's model."""
    from safetensors.torch import load_file, save_file

    save_file({"input_ids": tokens}, str(work / "tokens.safetensors"))
    run([os.environ["KILN_HF_FIXTURE"], source, work / "tokens.safetensors",
         work / "kiln-logits.safetensors"])
    return load_file(str(work / "kiln-logits.safetensors"))["logits"]


def one_line(test, done, *needles):
    """A refusal: exit 2 (checked by the caller's run), one line on stderr naming each needle."""
    test.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr)
    for needle in needles:
        test.assertIn(needle, done.stderr)


def fresh(name):
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


class HuggingFace(unittest.TestCase):
    def test_export_loads_in_transformers(self):
        from safetensors.torch import load_file, save_file
        from transformers import GPT2LMHeadModel

        work = fresh("export")
        config = write_config(work / "hf.toml", "hf", {**gpt_sections(steps=3),
                                                      "checkpoint": {"every_steps": 3}})
        kiln("train", config)
        run_dir = work / "runs" / "hf"
        out = work / "hf-out"
        done = kiln("export", run_dir, "--format", "hf", out)
        self.assertIn("exported", done.stdout)
        self.assertEqual(sorted(p.name for p in out.iterdir()),
                         ["config.json", "generation_config.json", "model.safetensors"])
        hf_config = json.loads((out / "config.json").read_text())
        # Bytes have no end-of-document token: null, not transformers' GPT-2 default 50256.
        self.assertIn("no tokenizer and no end token", done.stdout)
        for name in ("config.json", "generation_config.json"):
            ids = json.loads((out / name).read_text())
            self.assertIsNone(ids["eos_token_id"], name)
            self.assertIsNone(ids["bos_token_id"], name)
        for key, value in {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64,
                           "vocab_size": 256, "activation_function": "gelu_new",
                           "layer_norm_epsilon": 1e-5, "model_type": "gpt2"}.items():
            self.assertEqual(hf_config[key], value, key)

        model, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            self.assertEqual(list(info.get(kind, [])), [], kind)
        self.assertIs(model.lm_head.weight, model.transformer.wte.weight)  # tied head
        model.eval()

        tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
        save_file({"input_ids": tokens}, str(work / "tokens.safetensors"))
        run([os.environ["KILN_HF_FIXTURE"], run_dir, work / "tokens.safetensors",
             work / "kiln-logits.safetensors"])
        kiln_logits = load_file(str(work / "kiln-logits.safetensors"))["logits"]
        with torch.no_grad():
            hf_logits = model(tokens).logits
        self.assertEqual(tuple(hf_logits.shape), (2, 24, 256))
        self.assertLess((hf_logits - kiln_logits).abs().max().item(), 1e-5)

        # A non-empty directory is refused (one line, exit 2) unless --force.
        refused = kiln("export", run_dir, "--format", "hf", out, expect=2)
        self.assertIn("not empty", refused.stderr)
        self.assertIn("--force", refused.stderr)
        self.assertEqual(len(refused.stderr.strip().splitlines()), 1, refused.stderr)
        kiln("export", run_dir, "--format", "hf", out, "--force")
        # A checkpoint directory works as the source too, and gives the same tensors.
        again = work / "from-ckpt"
        kiln("export", run_dir / "checkpoints", "--format", "hf", again)
        a, b = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
        self.assertEqual(sorted(a), sorted(b))
        for name in a:
            self.assertTrue(torch.equal(a[name], b[name]), name)

    def test_init_from_transformers(self):
        from safetensors.torch import load_file, save_file
        from transformers import GPT2Config, GPT2LMHeadModel

        work = fresh("init-from")
        torch.manual_seed(0)
        hf_config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=256,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(hf_config)
        with torch.no_grad():  # no zero biases or unit LayerNorms: every tensor's layout matters
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.eval()
        single, sharded = work / "gpt2", work / "gpt2-sharded"
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="60KB")
        self.assertTrue((single / "model.safetensors").exists())
        self.assertTrue((sharded / "model.safetensors.index.json").exists())
        shards = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())
                            ["weight_map"].values()))
        self.assertGreater(len(shards), 1)

        config = write_config(work / "init.toml", "init", gpt_sections(steps=1))
        for directory in (single, sharded):
            peer = work / ("peer-" + directory.name)
            kiln("peer", "export", config, "--set", f"model.init_from={directory}", "--steps", "1",
                 "--out", peer)
            kiln_loss = json.loads((peer / "kiln.json").read_text())["loss"][0]
            batch = load_file(str(peer / "batches.safetensors"))
            inputs, targets = batch["step0.micro0.inputs"], batch["step0.micro0.targets"]
            with torch.no_grad():
                logits = model(inputs).logits
            hf_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).item()
            self.assertLess(abs(kiln_loss - hf_loss), 1e-5, directory.name)

            # The manifest records the weight files' SHA-256 as the model revision.
            if directory == single:
                continue  # (one train for time: the sharded directory has several files)
            kiln("train", config, "--set", f"model.init_from={directory}",
                 "--set", "checkpoint.every_steps=1")
            # Its export carries the source's end token and generation_config.json.
            exported = work / "init-export"
            said = kiln("export", work / "runs" / "init", "--format", "hf", exported).stdout
            self.assertIn(f"from model.init_from {directory.resolve()}", said)
            for name in ("config.json", "generation_config.json"):
                ids = json.loads((exported / name).read_text())
                self.assertEqual(ids["eos_token_id"], hf_config.eos_token_id, name)
            manifest = json.loads((work / "runs" / "init" / "manifest.json").read_text())
            revision = manifest["model"]["init_from"]
            self.assertEqual(revision["path"], str(directory.resolve()))
            files = {f["file"]: f["sha256"] for f in revision["files"]}
            self.assertEqual(sorted(files), shards)
            for name, digest in files.items():
                self.assertEqual(digest, hashlib.sha256((directory / name).read_bytes()).hexdigest())
            self.assertEqual(revision["config_sha256"],
                             hashlib.sha256((directory / "config.json").read_bytes()).hexdigest())

        # Wrong shapes: the first mismatching tensor is named (kiln's parameter order).
        bad = work / "gpt2-bad"
        shutil.copytree(single, bad)
        tensors = load_file(str(bad / "model.safetensors"))
        tensors["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(32, 96)
        tensors["transformer.h.1.mlp.c_proj.weight"] = torch.zeros(96, 32)
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        refused = kiln("train", config, "--set", f"model.init_from={bad}", "--set", "run.name=bad",
                       expect=2)
        self.assertIn("transformer.h.1.mlp.c_fc.weight", refused.stderr)
        self.assertNotIn("c_proj", refused.stderr)
        self.assertEqual(len(refused.stderr.strip().splitlines()), 1, refused.stderr)
        # A config that does not match the model.* keys: validate names the field and the key.
        refused = kiln("config", "validate", config, "--set", f"model.init_from={single}",
                       "--set", "model.n_embd=64", expect=2)
        self.assertIn("n_embd", refused.stderr)
        self.assertIn("model.n_embd = 32", refused.stderr)

    def test_export_carries_the_corpus_tokenizer(self):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import AutoTokenizer, GenerationConfig, GPT2LMHeadModel

        work = fresh("export-tokenizer")
        vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{f"w{k}": k for k in range(2, 200)}}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(work / "tokenizer.json"))
        text = work / "docs.txt"
        text.write_text("\n\n".join(" ".join(f"w{(d * 7 + k) % 198 + 2}" for k in range(40))
                                     for d in range(40)) + "\n")
        kiln("data", "prepare", "--tokenizer", work / "tokenizer.json", "--out", work / "tokens",
             text, "--val-fraction", "0.1")
        sections = gpt_sections(steps=2)
        sections["data"] = {"name": "tokens", "path": str(work / "tokens"), "seq_len": 16,
                            "num_workers": 0}
        config = write_config(work / "tok.toml", "tok", {**sections,
                                                        "checkpoint": {"every_steps": 2}})
        kiln("train", config)
        out = work / "hf-tok"
        said = kiln("export", work / "runs" / "tok", "--format", "hf", out).stdout
        self.assertIn("end token 1 from the corpus", said)
        self.assertEqual(json.loads((out / "config.json").read_text())["eos_token_id"], 1)
        self.assertEqual(GenerationConfig.from_pretrained(out).eos_token_id, 1)
        loaded = AutoTokenizer.from_pretrained(out)
        self.assertEqual(loaded.eos_token, "<|endoftext|>")
        self.assertEqual(loaded("w5 w9")["input_ids"], [5, 9])
        model = GPT2LMHeadModel.from_pretrained(out)
        generated = model.generate(torch.tensor([[5, 9]]), max_new_tokens=4, do_sample=False)
        self.assertEqual(tuple(generated.shape[:1]), (1,))

        # A tokenizer changed since the corpus was made is not carried, and the export says so.
        tokenizer.add_special_tokens(["<pad>"])
        tokenizer.save(str(work / "tokenizer.json"))
        changed = kiln("export", work / "runs" / "tok", "--format", "hf", out, "--force")
        self.assertIn("changed since the data was prepared", changed.stderr)
        self.assertFalse((out / "tokenizer.json").exists())
        self.assertEqual(json.loads((out / "config.json").read_text())["eos_token_id"], 1)

    def test_llama_export_loads_in_transformers(self):
        from transformers import LlamaForCausalLM

        work = fresh("llama-export")
        config = write_config(work / "llama.toml", "llama", {**llama_sections(steps=3),
                                                            "checkpoint": {"every_steps": 3}})
        kiln("train", config)
        run_dir, out = work / "runs" / "llama", work / "hf-llama"
        self.assertIn("LlamaForCausalLM", kiln("export", run_dir, "--format", "hf", out).stdout)
        hf_config = json.loads((out / "config.json").read_text())
        for key, value in {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
                           "num_attention_heads": 4, "num_key_value_heads": 2,
                           "intermediate_size": 48, "max_position_embeddings": 64,
                           "tie_word_embeddings": False, "rope_theta": 10000.0}.items():
            self.assertEqual(hf_config[key], value, key)
        model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            self.assertEqual(list(info.get(kind, [])), [], kind)
        model.eval()
        tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
        ours = kiln_logits(work, run_dir, tokens)
        with torch.no_grad():
            theirs = model(tokens).logits
        self.assertEqual(tuple(theirs.shape), (2, 24, 256))
        self.assertLess((theirs - ours).abs().max().item(), 1e-5)

    def test_llama_init_from_transformers(self):
        from safetensors.torch import load_file, save_file
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        work = fresh("llama-init-from")
        torch.manual_seed(0)
        # transformers' own defaults where kiln has others (rms_norm_eps 1e-6, theta 10000): the
        # shape and constants come from config.json, the kiln config names only the model.
        for tied in (False, True):
            hf_config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, vocab_size=256,
                                    rope_theta=20000.0, tie_word_embeddings=tied)
            model = LlamaForCausalLM(hf_config)
            with torch.no_grad():  # no unit norms: every tensor's place matters
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            model.eval()
            single, sharded = work / f"llama-{tied}", work / f"llama-{tied}-sharded"
            model.save_pretrained(single)
            model.save_pretrained(sharded, max_shard_size="40KB")
            self.assertGreater(len(set(json.loads((sharded / "model.safetensors.index.json")
                                                  .read_text())["weight_map"].values())), 1)
            tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
            with torch.no_grad():
                theirs = model(tokens).logits
            for directory in (single, sharded):
                config = write_config(work / "init.toml", "init", {
                    "model": {"name": "llama", "init_from": str(directory)},
                    "data": {"name": "text", "seq_len": 32}})
                ours = kiln_logits(work, config, tokens)
                self.assertLess((theirs - ours).abs().max().item(), 1e-5, directory.name)

        # A shape key set to another value than config.json's: one line naming both values.
        config = write_config(work / "init.toml", "init", {
            "model": {"name": "llama", "init_from": str(single), "n_layer": 3},
            "data": {"name": "text", "seq_len": 32}})
        one_line(self, kiln("config", "validate", config, expect=2),
                 "num_hidden_layers = 2", "model.n_layer = 3")
        # Wrong shapes: the first mismatching tensor is named, nothing else.
        bad = work / "llama-bad"
        shutil.copytree(single, bad)
        tensors = load_file(str(bad / "model.safetensors"))
        tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(40, 32)
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        config = write_config(work / "bad.toml", "bad", {
            "model": {"name": "llama", "init_from": str(bad)},
            "data": {"name": "text", "seq_len": 32}, "train": {"steps": 1}})
        one_line(self, kiln("train", config, expect=2), "model.layers.1.mlp.up_proj.weight",
                 "[40, 32]")
        # A directory of another architecture: one line with the model.name to set.
        gpt2 = work / "gpt2"
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=64,
                                   vocab_size=256)).save_pretrained(gpt2)
        config = write_config(work / "arch.toml", "arch", {
            "model": {"name": "llama", "init_from": str(gpt2)},
            "data": {"name": "text", "seq_len": 32}})
        one_line(self, kiln("config", "validate", config, expect=2), 'set model.name = "gpt"')


class TensorBoard(unittest.TestCase):
    def test_tensorboard_reads_every_scalar(self):
        import numpy as np
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        work = fresh("tensorboard")
        # A peak for the CPU: kiln train has a forecast and writes plan records (docs/plan.md)
        # into metrics.jsonl beside the step records; they are not TensorBoard scalars.
        config = write_config(work / "tb.toml", "tb", {
            "model": {"name": "mlp"},
            "data": {"num_samples": 512, "val_samples": 128, "num_workers": 0},
            "train": {"steps": 12, "batch_size": 16, "eval_every": 5, "eval_batches": 2},
            "baseline": {"peak_flops_per_second": 1e12}})
        kiln("train", config)
        run_dir = work / "runs" / "tb"
        files = glob.glob(str(run_dir / "events.out.tfevents.*"))
        self.assertEqual(len(files), 1, files)
        self.assertRegex(os.path.basename(files[0]), r"^events\.out\.tfevents\.\d+\.[^/]+$")

        # The framing, checked with tensorboard's own CRC-32C: length, masked CRC, data, masked CRC.
        raw = Path(files[0]).read_bytes()
        offset, records = 0, 0
        while offset < len(raw):
            header = raw[offset:offset + 8]
            length = int.from_bytes(header, "little")
            self.assertEqual(int.from_bytes(raw[offset + 8:offset + 12], "little"), masked_crc32c(header))
            data = raw[offset + 12:offset + 12 + length]
            self.assertEqual(int.from_bytes(raw[offset + 12 + length:offset + 16 + length], "little"),
                             masked_crc32c(data))
            offset += 16 + length
            records += 1
        self.assertEqual(offset, len(raw))

        events = list(LegacyEventFileLoader(files[0]).Load())
        self.assertEqual(len(events), records)
        self.assertEqual(events[0].file_version, "brain.Event:2")
        got = {}
        for event in events[1:]:
            for value in event.summary.value:
                self.assertNotIn((value.tag, event.step), got)
                got[(value.tag, event.step)] = value.simple_value

        expected = {}
        plans = []
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            step = record["step"]
            if "plan" in record:  # progress against the forecast: no loss, no scalar
                plans.append(record)
                continue
            if "val_loss" in record:
                expected[("val/loss", step)] = record["val_loss"]
                expected[("val/accuracy", step)] = record["val_accuracy"]
                continue
            for key in ("loss", "lr", "grad_norm", "step_seconds", "samples_per_second"):
                expected[("train/" + key, step)] = record[key]
            expected[("train/data_wait_share", step)] = record["data_wait_seconds"] / record["step_seconds"]
        self.assertEqual(sum(1 for tag, _ in expected if tag == "train/loss"), 12)
        self.assertEqual(sum(1 for tag, _ in expected if tag == "val/loss"), 3)  # steps 5, 10, end
        # Every step (train.metrics_every = 1) and the final one.
        self.assertEqual(len(plans), 13)
        self.assertTrue(plans[-1]["plan"]["final"])
        peaks = {k: v for k, v in got.items() if k[0] == "memory/peak_resident_bytes"}
        self.assertEqual(sorted(step for _, step in peaks), list(range(1, 13)))
        self.assertTrue(all(v > 1e6 for v in peaks.values()))
        self.assertEqual(sorted(k for k in got if k[0] != "memory/peak_resident_bytes"), sorted(expected))
        for key, value in expected.items():
            self.assertEqual(np.float32(got[key]), np.float32(value), key)


class HolisticTraceAnalysis(unittest.TestCase):
    def test_hta_loads_two_rank_profile(self):
        from hta.trace_analysis import TraceAnalysis

        work = fresh("hta")
        config = write_config(work / "hta.toml", "hta", {
            "model": {"name": "mlp"},
            "data": {"num_samples": 512, "val_samples": 128, "num_workers": 0},
            "train": {"batch_size": 16, "eval_every": 0, "eval_batches": 1},
            "profile": {"wait": 0, "warmup": 1, "active": 2, "skip_first": 1}})
        run([os.environ["KILN_TORCHRUN"], "--standalone", "--nproc-per-node=2", "--no-python",
             KILN, "profile", config])
        traces = sorted((work / "runs" / "hta" / "traces").glob("*.pt.trace.json*"))
        self.assertEqual(len(traces), 2, traces)
        analysis = TraceAnalysis(trace_dir=str(work / "runs" / "hta" / "traces"))
        self.assertEqual(sorted(analysis.t.get_ranks()), [0, 1])
        for rank in (0, 1):
            frame = analysis.t.get_trace(rank)
            names = set(analysis.t.symbol_table.sym_table[i] for i in frame["name"].unique())
            self.assertIn("aten::addmm", names, rank)


if __name__ == "__main__":
    unittest.main()
