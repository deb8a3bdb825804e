// safetensors I/O (https://github.com/huggingface/safetensors format): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
// {str: str}}, then the raw little-endian tensor bytes. Data-only: nothing read can execute code.
//
// The parser rejects, with a UserError naming the file: a header longer than the file, invalid
// JSON, an unknown dtype, a shape whose byte size disagrees with its offsets, offsets outside the
// data or overlapping each other, and gaps in the data region.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <torch/types.h>
#include <utility>
#include <vector>

namespace kiln {

struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data region
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;       // in file order (by begin offset)
  std::map<std::string, std::string> metadata;  // "__metadata__"
  uint64_t data_start = 0;                      // absolute offset of the data region
};

/// "F32", "BF16", ... for a dtype; throws UserError for dtypes safetensors cannot hold.
std::string safetensors_dtype(torch::ScalarType dtype);
/// Parses the header held in `prefix` (the file's first bytes, at least 8 + header length)
/// of a file of `file_size` bytes. Throws UserError naming `source`.
SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                           const std::string& source);
/// Reads and validates a file's header. Throws UserError.
SafetensorsHeader read_safetensors_header(const std::filesystem::path& path);

struct SafetensorsWriteResult {
  uint64_t size_bytes = 0;
  uint64_t xxh3 = 0;  // xxh3-64 of the whole file
};

/// Writes tensors (any device; copied to CPU contiguous) to `path` atomically: a temp file,
/// fsync, rename, fsync of the directory. Names must be unique. Throws UserError (e.g. ENOSPC);
/// an existing `path` is intact then.
SafetensorsWriteResult write_safetensors(const std::filesystem::path& path,
                                         const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                         const std::map<std::string, std::string>& metadata = {});
/// Reads every tensor as CPU tensors, in file order. Throws UserError.
std::vector<std::pair<std::string, torch::Tensor>> read_safetensors(const std::filesystem::path& path);

}  // namespace kiln
