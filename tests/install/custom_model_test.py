"""examples/custom_model, built against an installed kiln (tests/install/CMakeLists.txt builds it):
its own model and dataset train through the library, the loss falls, a run resumed from a
checkpoint continues bitwise as an uninterrupted one, and the ladder's rungs pass on it.

  custom_model_test.py --program BUILD/custom_model --config examples/custom_model/shells.toml
                       --scratch DIR
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import unittest

ARGS = None
HALF = 20  # steps before the save; the resumed run trains as many again


def step_losses(run_dir):
    """{step: loss} from a run's metrics.jsonl (the training records, not the evaluations)."""
    losses = {}
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            if "loss" in record:
                losses[record["step"]] = record["loss"]
    return losses


def checkpoint_tensors(step_dir):
    """{name: (dtype, shape, bytes)} of every tensor in a checkpoint's safetensors files."""
    tensors = {}
    for file_name in sorted(os.listdir(step_dir)):
        if not file_name.endswith(".safetensors"):
            continue
        with open(os.path.join(step_dir, file_name), "rb") as f:
            header_size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(header_size))
            data = f.read()
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            tensors[name] = (entry["dtype"], tuple(entry["shape"]), data[begin:end])
    return tensors


class CustomModel(unittest.TestCase):
    def run_program(self, *args):
        return subprocess.run([ARGS.program, *args], capture_output=True, text=True, timeout=300,
                              check=False)

    def train(self, name, steps, *extra):
        """`custom_model train` into <scratch>/<name>, saving every `steps` steps."""
        result = self.run_program(
            "train", ARGS.config, "--set", "run.dir=" + ARGS.scratch, "--set", "run.name=" + name,
            "--set", "train.steps=%d" % steps, "--set", "train.eval_every=0",
            "--set", "checkpoint.every_steps=%d" % steps, *extra)
        self.assertEqual(result.returncode, 0,
                         "custom_model train (%s) exited %d:\n%s" % (name, result.returncode,
                                                                     result.stderr[-3000:]))
        return os.path.join(ARGS.scratch, name)

    def test_loss_falls_and_a_resumed_run_is_bitwise_the_uninterrupted_one(self):
        whole = self.train("whole", 2 * HALF)
        half = self.train("half", HALF)
        resumed = self.train("resumed", 2 * HALF, "--resume",
                             os.path.join(half, "checkpoints", "step-%d" % HALF))

        losses = step_losses(whole)
        self.assertEqual(sorted(losses), list(range(1, 2 * HALF + 1)))
        first = sum(losses[s] for s in range(1, 6)) / 5
        last = sum(losses[s] for s in range(2 * HALF - 4, 2 * HALF + 1)) / 5
        self.assertLess(last, 0.8 * first, "the loss did not fall: %s" % losses)

        # The resumed process continues where the saved one stopped: the same losses, bit for bit
        # (JSON keeps a double's every bit), and the same final weights, optimizer state and RNG.
        continued = step_losses(resumed)
        self.assertEqual(sorted(continued), list(range(HALF + 1, 2 * HALF + 1)))
        for step in range(HALF + 1, 2 * HALF + 1):
            self.assertEqual(continued[step], losses[step], "step %d's loss differs" % step)
        ours = checkpoint_tensors(os.path.join(resumed, "checkpoints", "step-%d" % (2 * HALF)))
        reference = checkpoint_tensors(os.path.join(whole, "checkpoints", "step-%d" % (2 * HALF)))
        self.assertEqual(sorted(ours), sorted(reference))
        self.assertTrue(any(n.startswith("model/blocks.1.") for n in ours), sorted(ours))
        self.assertTrue(any(n.startswith("optim/") for n in ours), sorted(ours))
        differing = [n for n in reference if ours[n] != reference[n]]
        self.assertEqual(differing, [], "tensors differ after the resume")

        # The manifest names the program's own model and dataset.
        with open(os.path.join(whole, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        self.assertEqual(manifest["model"]["architecture"], "resmlp")
        self.assertEqual(manifest["data"]["kind"], "shells")

    def test_the_ladder_passes_on_the_program_s_own_model(self):
        result = self.run_program("ladder", ARGS.config, "--set", "run.dir=" + ARGS.scratch,
                                  "--set", "run.name=ladder")
        self.assertEqual(result.returncode, 0,
                         "custom_model ladder exited %d:\n%s\n%s" % (
                             result.returncode, result.stdout[-3000:], result.stderr[-3000:]))
        run_dir = os.path.join(ARGS.scratch, "ladder")
        numbers = {}
        for rung in ("baseline", "profile", "checkpoint", "pilot"):
            with open(os.path.join(run_dir, rung + ".json"), encoding="utf-8") as f:
                numbers[rung] = json.load(f)
            self.assertTrue(numbers[rung]["passed"], "%s: %s" % (rung, numbers[rung]))
        # The drill and the pilot restored in fresh processes of this program (the `kiln` CLI
        # knows no resmlp): bitwise.
        self.assertTrue(numbers["checkpoint"]["parameters_bitwise_equal"])
        self.assertTrue(numbers["checkpoint"]["optimizer_state_bitwise_equal"])
        self.assertTrue(numbers["pilot"]["restore"]["loss_bitwise_equal"])
        self.assertEqual(numbers["pilot"]["restore"]["differing_tensors"], [])
        # The memory estimate from the program's ModelSpec::math activation figures, with
        # activation checkpointing (shells.toml): within 10% of the measured peak, at the
        # pilot's default gate.
        memory = numbers["pilot"]["memory"]
        self.assertAlmostEqual(memory["measured_over_estimate"], 1.0, delta=0.1, msg=memory)
        self.assertIn("unit 0's recomputation and backward", memory["estimate"]["peak_at"])

    def test_the_dataset_s_own_keys_and_rules_are_in_the_schema(self):
        # data.dim is the dataset's key (DatasetSpec::keys); its rule ties it to the model.
        result = self.run_program("train", ARGS.config, "--set", "data.dim=3",
                                  "--set", "run.dir=" + ARGS.scratch)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("data.dim = 3 but model.input_dim = 8; set them equal", result.stderr)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
        # The control: a key no one declared is refused as unknown.
        result = self.run_program("train", ARGS.config, "--set", "data.dimm=3",
                                  "--set", "run.dir=" + ARGS.scratch)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("unknown key data.dimm", result.stderr)

    def test_an_unknown_dataset_lists_the_registered_one(self):
        result = self.run_program("train", ARGS.config, "--set", "data.name=nonexistent",
                                  "--set", "run.dir=" + ARGS.scratch)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("the known ones: shells, synthetic, text, tokens", result.stderr)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--program", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--scratch", required=True)
    ARGS, rest = parser.parse_known_args()
    ARGS.scratch = os.path.abspath(ARGS.scratch)
    unittest.main(argv=[sys.argv[0]] + rest)
