"""`kiln data prepare` throughput against the same tokenizer library driven by a plain Python loop.

Both sides tokenize the same files (the fortunes corpus by default: a directory's regular,
non-hidden, non-symlink, non-binary files, sorted, as kiln takes them) with the same
tokenizer.json (a byte-level BPE trained here with the `tokenizers` library: no download), append
the same separator after each document, and write the tokens to disk; each is timed as a whole
process (interpreter start included on both sides; kiln's own start, LibTorch loaded, too),
alternating, --repeats times; wall and CPU seconds and the load average are kept per repeat.
kiln writes to a fresh directory each time, so it tokenizes every time. The token streams are compared once.

    .venv/bin/python bench/data/run.py --kiln build/kiln --repeats 5 \
        --result bench/results/data-prepare-fortunes.json
"""

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

LOOP = r'''
import os, sys
import numpy as np
from tokenizers import Tokenizer
tokenizer_path, corpus, out = sys.argv[1:4]
tok = Tokenizer.from_file(tokenizer_path)
eot = tok.token_to_id("<|endoftext|>")
files = []
for root, dirs, names in os.walk(corpus):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for name in sorted(names):
        path = os.path.join(root, name)
        if name.startswith(".") or os.path.islink(path) or not os.path.isfile(path):
            continue
        data = open(path, "rb").read()
        if data and b"\0" not in data[:1 << 16]:
            files.append(data)
ids = []
for data in files:  # the plain loop: one encode() call per document
    ids.extend(tok.encode(data.decode("utf-8"), add_special_tokens=False).ids)
    ids.append(eot)
np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() <= 65536 else np.uint32).tofile(out)
print(len(ids))
'''


def train_tokenizer(corpus, vocab_size, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    files = sorted(os.path.join(corpus, n) for n in os.listdir(corpus)
                   if not n.startswith(".") and not os.path.islink(os.path.join(corpus, n))
                   and b"\0" not in open(os.path.join(corpus, n), "rb").read(1 << 16))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False))
    tok.save(path)


def timed(command, env=None, cpu=None):
    """Runs a command; returns its wall seconds and stdout, appending its CPU seconds (user +
    system, its children included) to `cpu`: a view of the work that the machine's load moves
    less than the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - begin
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if cpu is not None:
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        sys.exit(f"{command[0]} failed ({done.returncode}): {done.stderr.strip()}")
    return seconds, done.stdout


def kiln_tokens(out_dir):
    data = json.load(open(os.path.join(out_dir, "data.json")))
    streams = []
    for split in ("train", "val"):
        for shard in data["splits"].get(split, {}).get("shards", []):
            raw = np.fromfile(os.path.join(out_dir, shard["file"]),
                              dtype=np.uint16 if data["token_dtype"] == "uint16" else np.uint32)
            streams.append(raw[1024 // raw.itemsize:])
    return np.concatenate(streams), data


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kiln", default="build/kiln")
    parser.add_argument("--corpus", default="/usr/share/games/fortunes")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("a ratio needs --repeats 5 or more")

    scratch = tempfile.mkdtemp(prefix="kiln-bench-data-")
    try:
        tokenizer = os.path.join(scratch, "tokenizer.json")
        train_tokenizer(args.corpus, args.vocab_size, tokenizer)
        env = dict(os.environ, KILN_PYTHON=sys.executable)
        kiln_seconds, loop_seconds, load_averages = [], [], []
        kiln_cpu, loop_cpu = [], []
        tokens = None
        for repeat in range(args.repeats):
            load_averages.append({"before": os.getloadavg()})
            out = os.path.join(scratch, f"prepared-{repeat}")
            seconds, _ = timed([args.kiln, "data", "prepare", "--tokenizer", tokenizer, "--out", out,
                                args.corpus], env, kiln_cpu)
            kiln_seconds.append(seconds)
            loop_out = os.path.join(scratch, "loop.bin")
            seconds, printed = timed([sys.executable, "-c", LOOP, tokenizer, args.corpus, loop_out],
                                     cpu=loop_cpu)
            loop_seconds.append(seconds)
            if repeat == 0:
                kiln_stream, data = kiln_tokens(out)
                loop_stream = np.fromfile(loop_out, dtype=kiln_stream.dtype)
                same = bool(np.array_equal(kiln_stream, loop_stream))
                tokens = int(loop_stream.size)
                if not same:
                    sys.exit(f"the token streams differ: kiln {kiln_stream.size} tokens, "
                             f"loop {loop_stream.size}")
            shutil.rmtree(out)
            load_averages[-1]["after"] = os.getloadavg()
            print(f"repeat {repeat}: kiln {kiln_seconds[-1]:.2f} s ({kiln_cpu[-1]:.2f} s CPU), loop "
                  f"{loop_seconds[-1]:.2f} s ({loop_cpu[-1]:.2f} s CPU), "
                  f"load {load_averages[-1]['before'][0]:.1f} -> {load_averages[-1]['after'][0]:.1f}",
                  flush=True)
        kiln_median, loop_median = statistics.median(kiln_seconds), statistics.median(loop_seconds)
        result = {
            "benchmark": "kiln data prepare vs a plain Python loop over tokenizers' encode()",
            "corpus": args.corpus,
            "corpus_bytes": sum(f["size_bytes"] for f in data["inputs"]),
            "input_files": len(data["inputs"]),
            "tokenizer": f"byte-level BPE, {args.vocab_size} tokens, trained on the corpus",
            "tokens": tokens,
            "token_streams_equal": same,
            "repeats": args.repeats,
            "kiln_seconds": kiln_seconds,
            "python_loop_seconds": loop_seconds,
            "kiln_tokens_per_second": tokens / kiln_median,
            "python_loop_tokens_per_second": tokens / loop_median,
            "ratio_kiln_over_python": loop_median / kiln_median,
            "ratio_kiln_over_python_per_repeat": [p / k for k, p in zip(kiln_seconds, loop_seconds)],
            "kiln_cpu_seconds": kiln_cpu,
            "python_loop_cpu_seconds": loop_cpu,
            "cpu_ratio_python_over_kiln": statistics.median(loop_cpu) / statistics.median(kiln_cpu),
            "load_average_1_5_15_per_repeat": load_averages,
            "tokenizer_calls": "kiln: encode_batch_fast over batches of documents (the library's "
                               "threads); loop: one encode() per document",
            "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_seconds")}, indent=1))
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
