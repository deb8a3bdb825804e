// Token memory, token windows and token files (the data component's own; not public API).
//
// datasets.cpp builds the text dataset on a heap buffer of bytes; tokens.cpp maps token files
// (nanoGPT raw uint16, llm.c uint16 and uint32) and directories written by `kiln data prepare`.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace kiln {

class Config;
class Dataset;
struct Datasets;
struct DataSource;

/// Read-only token memory: a heap buffer (text) or a file mapping (token files).
struct TokenBuffer {
  std::shared_ptr<const void> owner;
  const uint8_t* data = nullptr;  // first token
  int64_t count = 0;              // tokens
  int element_bytes = 1;          // 1 (bytes), 2 (uint16) or 4 (uint32)
  std::string source;             // for error messages

  int64_t at(int64_t k) const {
    if (element_bytes == 1) return data[k];
    if (element_bytes == 2) {
      uint16_t v;
      std::memcpy(&v, data + 2 * k, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, data + 4 * k, 4);
    return v;
  }
};

/// Tokens [first, first + count) of a buffer.
struct TokenSpan {
  TokenBuffer buffer;
  int64_t first = 0;
  int64_t count = 0;
};

/// Sample windows over spans, in order: a span of n tokens holds (n - 1) / seq_len samples;
/// sample i of a span is its window [i*T, i*T + T + 1): inputs are the first T tokens, targets
/// the last T (shifted by one). No window crosses spans. `what` ("train", "validation") names
/// the split in the UserError thrown when no span holds seq_len + 1 tokens.
std::shared_ptr<const Dataset> make_windows(std::vector<TokenSpan> spans, int64_t seq_len,
                                            const std::string& what);

/// data.name = "tokens": a .bin file (data.path, data.val_path) or a directory written by
/// `kiln data prepare` (its data.json). Every file's token range is checked against
/// `vocab_limit` (> 0) when it is opened. Throws UserError naming the file.
Datasets make_tokens(const DataSource& source, int64_t vocab_limit);

/// A directory written by `kiln data prepare` whose tokenizer's vocabulary exceeds `vocab_limit`
/// (> 0): the UserError make_tokens would throw, from data.json alone (no token file read).
void check_prepared_vocabulary(const std::filesystem::path& dir, int64_t vocab_limit);

}  // namespace kiln
