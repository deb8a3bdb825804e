"""Shared by the tests of the Python side (python/kiln_py): import path, kiln binary, tolerances."""
import os
import sys

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PYTHON_DIR = os.path.join(REPO, "python")
sys.path.insert(0, PYTHON_DIR)

# Small shapes keep the serial test time low (see tests/python/CMakeLists.txt).
MLP = {"name": "mlp", "input_dim": 12, "hidden_dim": 24, "num_classes": 5}
GPT = {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}


def kiln_cli():
    """The kiln binary CMake passes in KILN_CLI."""
    path = os.environ.get("KILN_CLI", "")
    if not path or not os.path.exists(path):
        raise RuntimeError(f"KILN_CLI={path!r}: run these tests through ctest, or set KILN_CLI to "
                           f"the built kiln binary")
    return path


def max_relative_difference(actual, expected):
    """max |actual - expected| / max |expected| (a tensor's scale, so near-zero entries are fine)."""
    scale = expected.abs().max().clamp_min(1e-12)
    return ((actual - expected).abs().max() / scale).item()


def env_with_python_path():
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


torch.set_num_threads(2)
