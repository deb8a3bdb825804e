// safetensors I/O (https://github.com/huggingface/safetensors format): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
// {str: str}}, then the raw little-endian tensor bytes. Data-only: nothing read can execute code.
//
// The parser rejects, with a UserError naming the file: a header longer than the file, invalid
// JSON, an unknown dtype, a shape whose byte size disagrees with its offsets, offsets outside the
// data or overlapping each other, and gaps in the data region.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln {

class FileDescriptor;  // src/core/files.h

struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data region
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;        // in file order (by begin offset)
  std::map<std::string, std::string> metadata;  // "__metadata__"
  uint64_t data_start = 0;                      // absolute offset of the data region
};

/// "F32", "BF16", ... for a dtype; throws UserError for dtypes safetensors cannot hold.
std::string safetensors_dtype(torch::ScalarType dtype);
/// The dtype a safetensors dtype name stands for; throws UserError ("unknown dtype") otherwise.
torch::ScalarType safetensors_dtype_from_name(std::string_view name);
/// Parses the header held in `prefix` (the file's first bytes, at least 8 + header length)
/// of a file of `file_size` bytes. Throws UserError naming `source`.
SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                           const std::string& source);
/// Reads and validates a file's header. Throws UserError.
SafetensorsHeader read_safetensors_header(const std::filesystem::path& path);

struct SafetensorsWriteResult {
  uint64_t size_bytes = 0;
  uint64_t xxh3 = 0;        // xxh3-64 of the whole file
  uint64_t data_start = 0;  // absolute offset of the data region
  /// Absolute byte range [begin, end) of each tensor in the file, in the order given to the writer.
  std::vector<std::pair<uint64_t, uint64_t>> tensor_byte_ranges;
};

/// Writes tensors (any device; copied to CPU contiguous) to `path` atomically: a temp file,
/// fsync, rename, fsync of the directory. Names must be unique. Throws UserError (e.g. ENOSPC);
/// an existing `path` is intact then.
SafetensorsWriteResult write_safetensors(
    const std::filesystem::path& path,
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata = {});
/// Reads every tensor as CPU tensors, in file order. Throws UserError.
std::vector<std::pair<std::string, torch::Tensor>> read_safetensors(
    const std::filesystem::path& path);

/// An open safetensors file with a validated header, for reading parts of it (a checkpoint loader
/// reads only the byte ranges it needs). Owns the file descriptor. The read methods use pread and
/// may be called from several threads at once. Throws UserError naming the file on any failure.
class SafetensorsReader {
 public:
  /// Opens `path` and validates its header (see parse_safetensors_header).
  explicit SafetensorsReader(const std::filesystem::path& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  /// The file's size when it was opened.
  uint64_t size_bytes() const { return size_bytes_; }
  /// The entry named `name`, or nullptr.
  const SafetensorsEntry* find(std::string_view name) const;
  /// Copies `bytes` bytes starting `offset` bytes into `entry`'s data to `out`. Throws UserError
  /// when the range lies outside the entry or the file ends early.
  void read(const SafetensorsEntry& entry, uint64_t offset, uint64_t bytes, void* out) const;
  /// Copies `bytes` raw bytes at absolute file offset `offset` to `out` (e.g. the header, to hash
  /// a file while streaming it). Throws UserError past the end of the file.
  void read_raw(uint64_t offset, uint64_t bytes, void* out) const;

 private:
  std::filesystem::path path_;
  std::unique_ptr<FileDescriptor> fd_;  // open for the object's whole life
  uint64_t size_bytes_ = 0;
  SafetensorsHeader header_;
};

}  // namespace kiln
