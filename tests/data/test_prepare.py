"""python/kiln_py/prepare.py when it is interrupted: while tokenizing, while publishing, and after
being killed outright. The shards a training run reads (those data.json lists) are never partial.

Run by ctest (tests/data/CMakeLists.txt) with PYTHONPATH=<source>/python.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from tokenizers import Tokenizer, models, pre_tokenizers

from kiln_py import prepare


def word_tokenizer(path):
    vocab = {"[UNK]": 0, "<|endoftext|>": 1}
    vocab.update({f"w{k}": k for k in range(2, 300)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(path)


def snapshot(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


class PrepareInterrupted(unittest.TestCase):
    def setUp(self):
        self.scratch = tempfile.TemporaryDirectory(prefix="kiln-prepare-test-")
        self.dir = self.scratch.name
        self.tokenizer = os.path.join(self.dir, "tokenizer.json")
        word_tokenizer(self.tokenizer)
        self.out = os.path.join(self.dir, "out")
        self.first = self.text("first.txt", 3000)
        self.second = self.text("second.txt", 5000)

    def tearDown(self):
        self.scratch.cleanup()

    def text(self, name, words):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(" ".join(f"w{2 + (k * 7 + len(name)) % 290}" for k in range(words)) + "\n")
        return path

    def spec(self, *inputs):
        return {"tokenizer": self.tokenizer, "out": self.out, "inputs": list(inputs),
                "val_inputs": [], "field": "text", "val_fraction": 0.1, "shard_tokens": 1024,
                "separator": "auto", "progress": False, "kiln_version": "test"}

    def test_interrupted_while_tokenizing_leaves_the_directory_as_it_was(self):
        self.assertEqual(prepare.prepare(self.spec(self.first))["status"], "written")
        before = snapshot(self.out)
        with mock.patch.object(prepare, "write_shards", side_effect=prepare.Interrupted("SIGTERM")):
            with self.assertRaises(prepare.Interrupted):
                prepare.prepare(self.spec(self.first, self.second))
        self.assertEqual(snapshot(self.out), before)
        # A fresh directory that never got a shard is removed again.
        fresh = dict(self.spec(self.second), out=os.path.join(self.dir, "fresh"))
        with mock.patch.object(prepare, "write_shards", side_effect=prepare.Interrupted("SIGINT")):
            with self.assertRaises(prepare.Interrupted):
                prepare.prepare(fresh)
        self.assertFalse(os.path.exists(fresh["out"]))

    def test_interrupted_while_publishing_leaves_no_data_json_and_no_partial_shard(self):
        self.assertEqual(prepare.prepare(self.spec(self.first))["status"], "written")
        replace = os.replace
        calls = []

        def replace_then_stop(source, target):
            calls.append(target)
            if len(calls) == 3:
                raise prepare.Interrupted("SIGTERM")
            replace(source, target)

        with mock.patch.object(prepare.os, "replace", side_effect=replace_then_stop):
            with self.assertRaises(prepare.Interrupted):
                prepare.prepare(self.spec(self.first, self.second))
        names = os.listdir(self.out)
        self.assertNotIn("data.json", names)  # a training run refuses the directory
        self.assertFalse([n for n in names if n.startswith(prepare.STAGING_PREFIX)], names)
        for name in names:  # every shard there is whole: its header's count matches its size
            with open(os.path.join(self.out, name), "rb") as f:
                header = f.read(12)
            count = int.from_bytes(header[8:12], "little")
            self.assertEqual(os.path.getsize(os.path.join(self.out, name)), 1024 + 2 * count)
        # The next run prepares it whole.
        result = prepare.prepare(self.spec(self.first, self.second))
        self.assertEqual(result["status"], "written")
        with open(os.path.join(self.out, "data.json")) as f:
            listed = {s["file"] for split in json.load(f)["splits"].values()
                      for s in split["shards"]}
        self.assertEqual(set(os.listdir(self.out)), listed | {"data.json"})

    def test_files_staged_by_a_killed_run_are_removed_by_the_next(self):
        os.makedirs(self.out)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        stale = os.path.join(self.out, f"{prepare.STAGING_PREFIX}{dead.pid}-train.tokens")
        with open(stale, "wb") as f:
            f.write(b"\0" * 100)
        self.assertEqual(prepare.prepare(self.spec(self.first))["status"], "written")
        self.assertFalse(os.path.exists(stale))


if __name__ == "__main__":
    unittest.main()
