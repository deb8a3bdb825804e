"""Tokenizers for the `kiln data prepare` tests, made here with the `tokenizers` library (no
downloads), and the expected token ids they give (plain Tokenizer.encode: the oracle kiln's
batched, sharded preparation is checked against).

    make_tokenizers.py OUT_DIR CORPUS_FILE...

writes OUT_DIR/bpe.json (byte-level BPE, 512 tokens, <|endoftext|> special, trained on the
corpus files), OUT_DIR/wide.json (a word-level vocabulary of 70,000 tokens: ids beyond uint16)
and OUT_DIR/expected.json ({"bpe_first_file": ids of the first corpus file's text}).
"""

import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def bpe(files, vocab_size):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train(files, trainer)
    return tokenizer


def wide(size):
    vocab = {"[UNK]": 0}
    vocab.update({f"w{k}": k for k in range(1, size - 1)})
    vocab["<|endoftext|>"] = size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def main():
    out, corpus = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    tokenizer = bpe(corpus, 512)
    tokenizer.save(os.path.join(out, "bpe.json"))
    wide(70000).save(os.path.join(out, "wide.json"))
    with open(corpus[0], encoding="utf-8") as f:
        first = tokenizer.encode(f.read(), add_special_tokens=False).ids
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"bpe_first_file": first}, f)


if __name__ == "__main__":
    main()
