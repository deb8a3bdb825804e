// `kiln data prepare`: text files, directories and JSONL tokenized with a Hugging Face
// tokenizer.json into llm.c .bin shards, a validation split and DIR/data.json, by the project's
// Python (python/kiln_py/prepare.py, a child process) before training, never in the step loop.
// The format and data.json: docs/data.md. (The data component's; the CLI calls it.)
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln {

struct PrepareOptions {
  std::filesystem::path tokenizer;                // a Hugging Face tokenizer.json
  std::filesystem::path out;                      // the directory of shards and data.json
  std::vector<std::filesystem::path> inputs;      // files or directories: text, or JSONL
  std::vector<std::filesystem::path> val_inputs;  // the validation split (else val_fraction)
  std::string field = "text";                     // JSONL: the key holding each document
  double val_fraction = 0.1;                      // the tail of the training tokens held out
  int64_t shard_tokens = 100'000'000;             // tokens per .bin shard (llm.c's size)
  std::string separator = "auto";                 // appended after each document: auto | none
                                                  // | a token (auto: <|endoftext|>, </s>, ...)
  bool progress = false;                          // a progress bar on stderr
  std::string python;                             // the Python with `tokenizers` (required)
};

struct PrepareResult {
  bool up_to_date = false;  // the directory already held this preparation: nothing written
  double seconds = 0;
  nlohmann::json data_json;  // DIR/data.json as written (or as found)
};

/// Runs the preparation in `options.python` (one child process; its progress bar goes to this
/// process's stderr). Bad input (a tokenizer that does not parse, a missing or empty input, a
/// JSONL line without the field, ...) is a UserError with one line naming the file (and line),
/// and leaves `out` as it was. Any thread; blocks until the child exits.
PrepareResult prepare_corpus(const PrepareOptions& options);

}  // namespace kiln
