"""`kiln data prepare`: text files, directories and JSONL tokenized with a Hugging Face
tokenizer.json into llm.c-format .bin shards, a validation split and DIR/data.json.

Run by kiln (src/data/prepare.cpp) as a child process, before training and never in the step
loop:

    python -c <runner> <dir holding kiln_py> --spec spec.json --result result.json

The spec is written by kiln (the parsed command line); the result is one JSON object whose
"status" is "written", "up_to_date" or "error" (with a one-line "message" a user can act on:
kiln prints it and exits 2). Nothing but the progress bar (when the spec asks for one) goes to
the terminal.

Output, all in DIR:
  train_000000.bin ...   llm.c token files: a 256 x int32 header (magic, version, token count)
  val_000000.bin ...     then the tokens; uint16 (magic 20240520, version 1) when every id fits,
                         uint32 (magic 20240801, version 7, llm.c's Llama 3 files) otherwise
  data.json              what was prepared from what (see docs/data.md)

Writes are staged in hidden files in DIR and renamed into place only after every input has been
tokenized: a bad input leaves DIR as it was, and an interrupted run leaves no partial shard (a
stale data.json is removed before the first new shard is renamed in, so a reader never pairs a
data.json with shards it does not describe).
"""

import argparse
import fcntl
import hashlib
import json
import math
import os
import signal
import sys
import time
import traceback

import numpy as np

# Bumped when the same inputs would give different shards (the recipe, below, includes it).
PREPARE_VERSION = 1
HEADER_INTS = 256
LLMC_HEADERS = {2: (20240520, 1), 4: (20240801, 7)}  # bytes per token -> (magic, version)
SEPARATOR_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
CHUNK_BYTES = 1 << 20  # text files above SPLIT_BYTES are encoded in ~1 MiB pieces cut at newlines
SPLIT_BYTES = 8 << 20
BATCH_BYTES = 4 << 20  # text per encode_batch call (the tokenizer's threads share its documents)
BATCH_DOCUMENTS = 4096
STAGING_PREFIX = ".kiln-prepare-"


class UserError(Exception):
    """A problem with the input the user can fix: one line, exit 2."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT, or kiln gone: unwind, removing the staged files."""


PARENT = os.getppid()


def check_parent():
    """kiln killed (its child is re-parented): stop as if interrupted, between batches."""
    if os.getppid() != PARENT:
        raise Interrupted("the end of the kiln process that started it")


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- the tokenizer --------------------------------------------------------------------------


def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(
            f"the Python running kiln data prepare ({sys.executable}) has no `tokenizers` library; "
            "set KILN_PYTHON to kiln's .venv/bin/python (scripts/setup installs it) or "
            "pip install tokenizers")
    if not os.path.isfile(path):
        raise UserError(f"--tokenizer {path} does not exist; pass a Hugging Face tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the library raises plain Exception subclasses for every parse error
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"--tokenizer {path} is not a Hugging Face tokenizer.json ({detail}); pass the "
            "tokenizer.json of a model directory or one written by tokenizers' Tokenizer.save")
    return tokenizer


def resolve_separator(tokenizer, path, wanted):
    """The token appended after each document (nanoGPT's <|endoftext|>), or None."""
    if wanted == "none":
        return None
    if wanted == "auto":
        for token in SEPARATOR_CANDIDATES:
            token_id = tokenizer.token_to_id(token)
            if token_id is not None:
                return {"token": token, "id": token_id}
        return None
    token_id = tokenizer.token_to_id(wanted)
    if token_id is None:
        raise UserError(f"--separator {wanted!r} is not a token of {path}; name one of its "
                        "special tokens, or pass --separator none")
    return {"token": wanted, "id": token_id}


# ---- inputs ---------------------------------------------------------------------------------


def is_jsonl(path):
    return path.lower().endswith(JSONL_SUFFIXES)


def expand_inputs(paths, split, out_dir):
    """Files to read, in order: a directory's files (recursively, sorted by path; hidden files,
    symbolic links and binary files with NUL bytes skipped and listed), or a file itself."""
    files, skipped = [], []
    for raw in paths:
        path = os.path.abspath(raw)
        if not os.path.exists(path):
            raise UserError(f"input {raw} does not exist")
        if not os.path.isdir(path):
            files.append({"path": path, "split": split, "given": raw})
            continue
        found = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                             and os.path.abspath(os.path.join(root, d)) != out_dir)
            for name in sorted(names):
                full = os.path.join(root, name)
                if name.startswith(".") or os.path.islink(full) or not os.path.isfile(full):
                    continue
                with open(full, "rb") as f:
                    head = f.read(1 << 16)
                if b"\0" in head:
                    skipped.append({"path": full, "reason": "binary (NUL bytes)"})
                elif not head:
                    skipped.append({"path": full, "reason": "empty"})
                else:
                    found.append({"path": full, "split": split, "given": raw})
        if not found:
            raise UserError(f"input directory {raw} holds no text or JSONL files; point at the "
                            "files to tokenize")
        files.extend(found)
    return files, skipped


def describe_inputs(files):
    """Size and content hash of every input; an empty or binary file given by name is refused."""
    for entry in files:
        path = entry["path"]
        entry["size_bytes"] = os.path.getsize(path)
        if entry["size_bytes"] == 0:
            raise UserError(f"input {entry['given']} is empty; remove it or give a file with text")
        entry["sha256"] = sha256_file(path)
        entry["kind"] = "jsonl" if is_jsonl(path) else "text"


def read_text(path):
    with open(path, "rb") as f:
        data = f.read()
    nul = data.find(b"\0")
    if nul >= 0:
        raise UserError(f"input {path} is binary (NUL byte at offset {nul}); give text or JSONL "
                        "files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"input {path} is not UTF-8 text (invalid byte at offset {e.start}); "
                        "convert it (iconv -t UTF-8) or leave it out")


def documents(entry, field):
    """(text, ends_document) pieces of one input, in order. JSONL: one document per line's
    `field`; text: the whole file, encoded in pieces cut at newlines when it is large."""
    path = entry["path"]
    if entry["kind"] == "jsonl":
        records = 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise UserError(f"{where}: not a JSON object ({e}); fix the line or remove it")
                if not isinstance(record, dict) or field not in record:
                    keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                    raise UserError(f"{where}: no field \"{field}\" (it has: {keys}); set --field "
                                    "to the key that holds the text")
                text = record[field]
                if not isinstance(text, str):
                    raise UserError(f"{where}: field \"{field}\" is {type(text).__name__}, not "
                                    "text; set --field to the key that holds the text")
                records += 1
                yield text, True
        if records == 0:
            raise UserError(f"input {path} holds no JSON lines; it is empty")
        return
    text = read_text(path)
    if len(text) <= SPLIT_BYTES:
        yield text, True
        return
    start = 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_BYTES)
        end = len(text) if end < 0 else end + 1
        yield text[start:end], end == len(text)
        start = end


# ---- the recipe: what the output depends on -------------------------------------------------


def recipe_of(spec, tokenizer_sha256, files, separator):
    return {
        "prepare_version": PREPARE_VERSION,
        "prepare_py_sha256": sha256_file(os.path.abspath(__file__)),
        "tokenizer_sha256": tokenizer_sha256,
        "inputs": [[f["path"], f["split"], f["size_bytes"], f["sha256"]] for f in files],
        "field": spec["field"],
        "val_fraction": spec["val_fraction"] if not spec["val_inputs"] else None,
        "shard_tokens": spec["shard_tokens"],
        "separator": separator,
    }


def revision_of(recipe):
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def up_to_date(out_dir, revision):
    """data.json describes this very recipe and every shard it lists is there, whole."""
    try:
        with open(os.path.join(out_dir, "data.json")) as f:
            existing = json.load(f)
    except (OSError, ValueError):
        return None
    if existing.get("revision") != revision:
        return None
    for split in existing.get("splits", {}).values():
        for shard in split.get("shards", []):
            path = os.path.join(out_dir, shard["file"])
            if not os.path.isfile(path) or os.path.getsize(path) != shard["size_bytes"]:
                return None
    return existing


# ---- writing --------------------------------------------------------------------------------


class Progress:
    """A byte-count progress bar on stderr (tqdm when installed), or nothing."""

    def __init__(self, total, enabled):
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing",
                            file=sys.stderr, leave=False, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def update(self, count):
        if self.bar is not None:
            self.bar.update(count)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def tokenize_to_staging(files, tokenizer, field, separator, dtype, staging, progress):
    """Encodes every input into one raw token file per split (staging[split]), in order; sets
    each input's token and document counts. Documents are encoded in batches that span inputs,
    so the tokenizer's threads always have several documents to share."""
    sinks = {split: open(path, "wb") for split, path in staging.items()}
    separator_ids = (np.asarray([separator["id"]], dtype=dtype) if separator is not None
                     else None)
    for entry in files:
        entry["tokens"] = 0
        entry["documents"] = 0
    batch, batch_bytes = [], 0
    # encode_batch_fast (newer tokenizers releases) gives the same ids without computing each
    # token's character offsets, which kiln never reads: half the CPU time of encode_batch on the
    # fortunes corpus (bench/data). Older releases have only encode_batch.
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def write(entry, pieces):
        if pieces:
            tokens = np.concatenate(pieces)
            tokens.tofile(sinks[entry["split"]])
            entry["tokens"] += int(tokens.size)

    def flush():
        encodings = encode_batch([text for _, text, _ in batch], add_special_tokens=False)
        current, pieces = None, []
        for (entry, _, ends), encoding in zip(batch, encodings):
            if entry is not current:
                if current is not None:
                    write(current, pieces)
                current, pieces = entry, []
            pieces.append(np.asarray(encoding.ids, dtype=dtype))
            if ends:
                entry["documents"] += 1
                if separator_ids is not None:
                    pieces.append(separator_ids)
        write(current, pieces)
        progress.update(batch_bytes)
        check_parent()

    try:
        for entry in files:
            for text, ends in documents(entry, field):
                batch.append((entry, text, ends))
                batch_bytes += len(text)
                if batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_DOCUMENTS:
                    flush()
                    batch, batch_bytes = [], 0
        if batch:
            flush()
    finally:
        for sink in sinks.values():
            sink.close()


def write_shards(tokens, name, out_dir, shard_tokens, dtype, pid, written):
    """Staged llm.c shards of `tokens` (a memory map): [(final name, staged path, record)]."""
    magic, version = LLMC_HEADERS[np.dtype(dtype).itemsize]
    shards = []
    for index, start in enumerate(range(0, len(tokens), shard_tokens)):
        check_parent()
        piece = tokens[start:start + shard_tokens]
        header = np.zeros(HEADER_INTS, dtype=np.int32)
        header[:3] = (magic, version, len(piece))
        final = f"{name}_{index:06d}.bin"
        staged = os.path.join(out_dir, f"{STAGING_PREFIX}{pid}-{final}")
        written.append(staged)
        digest = hashlib.sha256()
        with open(staged, "wb") as f:
            for block in (header.tobytes(), np.ascontiguousarray(piece).tobytes()):
                f.write(block)
                digest.update(block)
            f.flush()
            os.fsync(f.fileno())
        shards.append((final, staged, {
            "file": final,
            "tokens": int(len(piece)),
            "size_bytes": os.path.getsize(staged),
            "sha256": digest.hexdigest(),
            "max_token_id": int(piece.max()) if len(piece) else None,
        }))
    return shards


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_staging(out_dir):
    """Staged files of an earlier run that was killed (its process is gone)."""
    for name in os.listdir(out_dir):
        if not name.startswith(STAGING_PREFIX):
            continue
        pid = name[len(STAGING_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and pid != str(os.getpid()):
            try:
                os.kill(int(pid), 0)
                continue  # still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        try:
            os.remove(os.path.join(out_dir, name))
        except OSError:
            pass


def prepare(spec):
    begin = time.monotonic()
    out_dir = os.path.abspath(spec["out"])
    tokenizer_path = os.path.abspath(spec["tokenizer"])
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {spec['out']} is a file; name a directory for the shards")
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer_sha256 = sha256_file(tokenizer_path)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    separator = resolve_separator(tokenizer, tokenizer_path, spec["separator"])
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32

    files, skipped = expand_inputs(spec["inputs"], "train", out_dir)
    val_files, val_skipped = expand_inputs(spec["val_inputs"], "val", out_dir)
    files += val_files
    skipped += val_skipped
    describe_inputs(files)
    recipe = recipe_of(spec, tokenizer_sha256, files, separator)
    revision = revision_of(recipe)

    existing = up_to_date(out_dir, revision)
    if existing is not None:
        return {"status": "up_to_date", "dir": out_dir, "data_json": existing,
                "seconds": time.monotonic() - begin}

    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    dir_fd = os.open(out_dir, os.O_RDONLY)
    written = []
    published = False
    try:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another kiln data prepare is writing {out_dir}; wait for it or "
                            "choose another --out")
        remove_stale_staging(out_dir)
        pid = os.getpid()
        staging = {split: os.path.join(out_dir, f"{STAGING_PREFIX}{pid}-{split}.tokens")
                   for split in ("train", "val")}
        written.extend(staging.values())
        progress = Progress(sum(f["size_bytes"] for f in files), spec.get("progress", False))
        try:
            tokenize_to_staging(files, tokenizer, spec["field"], separator, dtype, staging,
                                progress)
        finally:
            progress.close()

        itemsize = np.dtype(dtype).itemsize
        streams = {}
        for split, path in staging.items():
            count = os.path.getsize(path) // itemsize
            streams[split] = (np.memmap(path, dtype=dtype, mode="r", shape=(count,))
                              if count else np.zeros(0, dtype=dtype))
        train, val = streams["train"], streams["val"]
        if len(train) == 0:
            raise UserError("the training inputs tokenize to no tokens; give text to tokenize")
        if not spec["val_inputs"]:
            val_count = int(math.floor(spec["val_fraction"] * len(train) + 0.5))
            train, val = train[:len(train) - val_count], train[len(train) - val_count:]
            if len(train) == 0:
                raise UserError(f"--val-fraction {spec['val_fraction']} leaves no training tokens")
        elif len(val) == 0:
            raise UserError("the --val inputs tokenize to no tokens; give text to tokenize")

        shards = {name: write_shards(tokens, name, out_dir, spec["shard_tokens"], dtype, pid,
                                     written)
                  for name, tokens in (("train", train), ("val", val)) if len(tokens)}
        max_token_id = max(r["max_token_id"] for s in shards.values() for _, _, r in s)
        data_json = {
            "format": "kiln tokenized corpus",
            "format_version": 1,
            "revision": revision,
            "kiln_version": spec["kiln_version"],
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tokenizer": {"path": tokenizer_path, "sha256": tokenizer_sha256,
                          "vocab_size": vocab_size, "separator": separator},
            "token_dtype": np.dtype(dtype).name,
            "llmc_header": dict(zip(("magic", "version"), LLMC_HEADERS[np.dtype(dtype).itemsize])),
            "max_token_id": max_token_id,
            "options": {"field": spec["field"], "val_fraction": recipe["val_fraction"],
                        "shard_tokens": spec["shard_tokens"], "separator": spec["separator"]},
            "inputs": [{"path": f["path"], "split": f["split"], "kind": f["kind"],
                        "size_bytes": f["size_bytes"], "sha256": f["sha256"],
                        "documents": f["documents"], "tokens": f["tokens"]} for f in files],
            "skipped": skipped,
            "splits": {name: {"tokens": sum(r["tokens"] for _, _, r in s),
                              "shards": [r for _, _, r in s]} for name, s in shards.items()},
            "recipe": recipe,
        }
        staged_json = os.path.join(out_dir, f"{STAGING_PREFIX}{pid}-data.json")
        written.append(staged_json)
        with open(staged_json, "w") as f:
            json.dump(data_json, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        del train, val, streams

        # Publish: no data.json while the shards change, then the shards, then data.json.
        published = True
        try:
            os.remove(os.path.join(out_dir, "data.json"))
        except FileNotFoundError:
            pass
        fsync_dir(out_dir)
        keep = {"data.json"}
        for entries in shards.values():
            for final, staged, _ in entries:
                os.replace(staged, os.path.join(out_dir, final))
                keep.add(final)
        fsync_dir(out_dir)
        os.replace(staged_json, os.path.join(out_dir, "data.json"))
        fsync_dir(out_dir)
        for name in os.listdir(out_dir):  # shards of an earlier, larger preparation
            if name not in keep and name.endswith(".bin") and name.startswith(("train_", "val_")):
                os.remove(os.path.join(out_dir, name))
        seconds = time.monotonic() - begin
        return {"status": "written", "dir": out_dir, "data_json": data_json, "seconds": seconds}
    finally:
        for path in written:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        os.close(dir_fd)
        if created and not published:
            try:
                os.rmdir(out_dir)  # nothing of ours is left in it
            except OSError:
                pass


def main(argv=None):
    parser = argparse.ArgumentParser(prog="kiln_py.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)

    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    with open(args.spec) as f:
        spec = json.load(f)
    try:
        result = prepare(spec)
    except UserError as e:
        result = {"status": "error", "message": str(e)}
    except Interrupted as e:
        result = {"status": "error", "message": f"interrupted by {e}; {spec['out']} keeps no "
                  "partial shard (run again to prepare it)"}
    except Exception as e:  # a bug: one line for the user, the traceback beside the result
        log = args.result + ".traceback"
        with open(log, "w") as f:
            traceback.print_exc(file=f)
        result = {"status": "internal", "message": f"{type(e).__name__}: {e}", "traceback": log}
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
