"""kiln training an exported Hugging Face model from C++ (the graph run node by node through the
dispatcher) against PyTorch eager training the same transformers model, in one run.

A random Qwen2 of the given shape is written with save_pretrained, imported with `kiln model
import --hf`, and bench/peer/peer.py --timing replays kiln's batches on the transformers model with
kiln's initial weights: losses compared step by step, median step times alternated kiln/Python
--repeats times (same threads, batches preloaded on both sides). Both sides eager: the ratio is
what the graph runner costs (or saves) against PyTorch's own Python modules. The compiled step's
gain over the graph runner is the compile rung's figure (docs/compile.md).

    .venv/bin/python bench/exported/run.py --kiln build/kiln --repeats 5 \
        --result bench/results/exported-qwen2-tiny.json
"""
import argparse
import os
import subprocess
import sys
import tempfile

import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kiln", required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--result")
    args = parser.parse_args()
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max(64, args.seq))
    with tempfile.TemporaryDirectory(prefix="kiln-bench-exported-") as scratch:
        hf, package = os.path.join(scratch, "hf"), os.path.join(scratch, "package")
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf)
        subprocess.run([args.kiln, "model", "import", "--hf", hf, "--max-seq", str(args.seq),
                        "--out", package], check=True)
        command = [sys.executable, os.path.join(REPO, "bench", "peer", "peer.py"),
                   "--kiln", args.kiln, "--config", os.path.join(REPO, "configs", "gpt-tiny.toml"),
                   "--steps", str(args.steps), "--timing", "--repeats", str(args.repeats),
                   "--tolerance", "1e-5",
                   "--set", "model.name=exported", "--set", f"model.package={package}",
                   "--set", f"train.batch_size={args.batch}", "--set", f"data.seq_len={args.seq}",
                   "--set", f"run.threads={args.threads}"]
        if args.result:
            command += ["--result", args.result]
        sys.exit(subprocess.run(command).returncode)


if __name__ == "__main__":
    main()
