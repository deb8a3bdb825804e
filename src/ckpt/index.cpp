// index.json: parsing, validation, verification, and the checkpoint directory listing.
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <map>
#include <set>

#include "ckpt/internal.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/safetensors.h"

namespace kiln {
namespace ckpt {

std::string step_dir_name(int64_t step) {
  return "step-" + std::to_string(step);
}
std::string tmp_dir_name(int64_t step) {
  return step_dir_name(step) + ".tmp";
}
std::string rank_file_name(int rank) {
  return "rank-" + std::to_string(rank) + ".safetensors";
}

void agree(Communicator& comm, const std::string& local_error) {
  const std::vector<std::string> all = comm.all_gather_bytes(local_error);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    throw UserError(all.size() > 1 ? "rank " + std::to_string(r) + ": " + all[r] : all[r]);
  }
}

std::string index_text_with_checksum(nlohmann::json index) {
  index.erase("index_xxh3");
  const std::string body = index.dump();
  index["index_xxh3"] = hex64(XXH3_64bits(body.data(), body.size()));
  return index.dump(1) + "\n";
}

uint64_t element_count(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace ckpt

std::filesystem::path checkpoint_step_dir(const std::filesystem::path& dir, int64_t step) {
  return dir / ckpt::step_dir_name(step);
}

bool checkpoint_committed(const std::filesystem::path& step_dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(step_dir / ckpt::kIndexFile, ec);
}

namespace {

using nlohmann::json;

// Chunks per tensor beyond this are rejected (the tiling check is quadratic in them).
constexpr size_t kMaxChunksPerTensor = 4096;
constexpr int kMaxWorldSize = 1 << 20;
constexpr int64_t kMaxDims = 64;

class Fields {
 public:
  explicit Fields(std::string source) : source_(std::move(source)) {}
  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    throw UserError(source_ + ": " + where + " " + what + "; the index is corrupt (or not kiln's)");
  }
  const json& member(const json& object, const char* key, const std::string& where) const {
    if (!object.is_object()) fail(where, "is not an object");
    auto it = object.find(key);
    if (it == object.end()) fail(where, std::string("has no \"") + key + "\"");
    return *it;
  }
  uint64_t u64(const json& value, const std::string& where) const {
    if (!value.is_number_unsigned()) fail(where, "is not a non-negative integer");
    return value.get<uint64_t>();
  }
  int64_t i64(const json& value, const std::string& where, uint64_t max = uint64_t{1} << 62) const {
    uint64_t v = u64(value, where);
    if (v > max) fail(where, "is too large (" + std::to_string(v) + ")");
    return static_cast<int64_t>(v);
  }
  const std::string& str(const json& value, const std::string& where) const {
    if (!value.is_string()) fail(where, "is not a string");
    return value.get_ref<const std::string&>();
  }
  std::vector<int64_t> dims(const json& value, const std::string& where) const {
    if (!value.is_array() || static_cast<int64_t>(value.size()) > kMaxDims)
      fail(where, "is not an array of at most 64 integers");
    std::vector<int64_t> out;
    for (size_t k = 0; k < value.size(); ++k)
      out.push_back(i64(value[k], where + "[" + std::to_string(k) + "]", uint64_t{1} << 40));
    return out;
  }

 private:
  std::string source_;
};

// A file name the index may refer to: a plain name inside the checkpoint directory.
bool plain_file_name(const std::string& name) {
  if (name.empty() || name.size() > 255 || name == "." || name == "..") return false;
  if (name.find("..") != std::string::npos) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

bool boxes_overlap(const ChunkInfo& a, const ChunkInfo& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] || b.offsets[d] >= a.offsets[d] + a.sizes[d])
      return false;
  }
  return true;
}

uint64_t parse_hex64(const std::string& text, const Fields& f, const std::string& where) {
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (text.size() != 16 || ec != std::errc() || ptr != text.data() + text.size()) {
    f.fail(where, "is not 16 hex digits");
  }
  return value;
}

}  // namespace

uint64_t TensorInfo::bytes() const {
  return ckpt::element_count(shape) * c10::elementSize(dtype);
}

const TensorInfo* CheckpointIndex::find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

uint64_t CheckpointIndex::total_file_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files) total += f.size_bytes;
  return total;
}

CheckpointIndex parse_checkpoint_index(std::string_view json_text, const std::string& source) {
  const Fields f(source);
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw UserError(source + ": not valid JSON (" + std::string(e.what()) +
                    "); the index is corrupt");
  }
  if (!root.is_object()) f.fail("the top level", "is not an object");
  if (f.str(f.member(root, "format", "the index"), "format") != ckpt::kFormatName) {
    f.fail("format", "is not \"kiln-checkpoint\"");
  }
  CheckpointIndex index;
  const int64_t version =
      f.i64(f.member(root, "format_version", "the index"), "format_version", 1 << 20);
  if (version != kCheckpointFormatVersion) {
    throw UserError(source + ": format_version " + std::to_string(version) +
                    " is not supported (this kiln reads " +
                    std::to_string(kCheckpointFormatVersion) + "); use the kiln that wrote it");
  }
  index.format_version = static_cast<int>(version);
  {
    const std::string& stored = f.str(f.member(root, "index_xxh3", "the index"), "index_xxh3");
    json body = root;
    body.erase("index_xxh3");
    const std::string text = body.dump();
    if (hex64(XXH3_64bits(text.data(), text.size())) != stored) {
      throw UserError(source + ": index checksum mismatch (index_xxh3 " + stored +
                      "); the file was modified or damaged");
    }
  }
  index.step = f.i64(f.member(root, "step", "the index"), "step");
  index.world_size = static_cast<int>(
      f.i64(f.member(root, "world_size", "the index"), "world_size", kMaxWorldSize));
  if (index.world_size < 1) f.fail("world_size", "is 0");
  if (auto it = root.find("created_utc"); it != root.end())
    index.created_utc = f.str(*it, "created_utc");

  const json& files = f.member(root, "files", "the index");
  if (!files.is_array()) f.fail("files", "is not an array");
  std::map<std::string, size_t> file_by_name;
  for (size_t k = 0; k < files.size(); ++k) {
    const std::string where = "files[" + std::to_string(k) + "]";
    FileInfo info;
    info.name = f.str(f.member(files[k], "name", where), where + ".name");
    if (!plain_file_name(info.name)) {
      f.fail(where + ".name \"" + info.name + "\"",
             "is not a plain file name inside the checkpoint directory (no '/', no '..', not "
             "absolute)");
    }
    info.rank =
        static_cast<int>(f.i64(f.member(files[k], "rank", where), where + ".rank", kMaxWorldSize));
    if (info.rank >= index.world_size) f.fail(where + ".rank", "is not below world_size");
    info.size_bytes = f.u64(f.member(files[k], "size_bytes", where), where + ".size_bytes");
    info.xxh3 =
        parse_hex64(f.str(f.member(files[k], "xxh3", where), where + ".xxh3"), f, where + ".xxh3");
    if (!file_by_name.emplace(info.name, k).second)
      f.fail(where + ".name", "repeats \"" + info.name + "\"");
    index.files.push_back(std::move(info));
  }

  const json& tensors = f.member(root, "tensors", "the index");
  if (!tensors.is_object()) f.fail("tensors", "is not an object");
  for (const auto& [name, value] : tensors.items()) {
    const std::string where = "tensors[\"" + name + "\"]";
    TensorInfo info;
    info.name = name;
    try {
      info.dtype =
          safetensors_dtype_from_name(f.str(f.member(value, "dtype", where), where + ".dtype"));
    } catch (const UserError& e) {
      f.fail(where + ".dtype", "is not valid (" + std::string(e.what()) + ")");
    }
    info.shape = f.dims(f.member(value, "shape", where), where + ".shape");
    const std::string& placement = f.str(f.member(value, "placement", where), where + ".placement");
    if (placement == "replicated") {
      info.placement = Placement::kReplicated;
    } else if (placement == "sharded") {
      info.placement = Placement::kSharded;
    } else {
      f.fail(where + ".placement", "is neither \"replicated\" nor \"sharded\"");
    }
    uint64_t numel = 1;
    for (int64_t d : info.shape) {
      if (d != 0 && numel > (uint64_t{1} << 50) / static_cast<uint64_t>(d))
        f.fail(where + ".shape", "is too large");
      numel *= static_cast<uint64_t>(d);
    }
    const json& chunks = f.member(value, "chunks", where);
    if (!chunks.is_array() || chunks.empty() || chunks.size() > kMaxChunksPerTensor) {
      f.fail(where + ".chunks", "is not an array of 1 to 4096 chunks");
    }
    uint64_t covered = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const std::string cw = where + ".chunks[" + std::to_string(c) + "]";
      ChunkInfo chunk;
      chunk.file = f.str(f.member(chunks[c], "file", cw), cw + ".file");
      if (!file_by_name.count(chunk.file)) {
        f.fail(cw + ".file \"" + chunk.file + "\"",
               "is not listed in files (or is not a plain file name)");
      }
      chunk.name = f.str(f.member(chunks[c], "name", cw), cw + ".name");
      chunk.offsets = f.dims(f.member(chunks[c], "offsets", cw), cw + ".offsets");
      chunk.sizes = f.dims(f.member(chunks[c], "sizes", cw), cw + ".sizes");
      if (chunk.offsets.size() != info.shape.size() || chunk.sizes.size() != info.shape.size()) {
        f.fail(cw, "has offsets/sizes of another rank than the tensor's shape");
      }
      for (size_t d = 0; d < info.shape.size(); ++d) {
        if (chunk.offsets[d] + chunk.sizes[d] > info.shape[d])
          f.fail(cw, "extends outside the tensor");
      }
      const json& range = f.member(chunks[c], "byte_range", cw);
      if (!range.is_array() || range.size() != 2) f.fail(cw + ".byte_range", "is not [begin, end]");
      chunk.byte_begin = f.u64(range[0], cw + ".byte_range[0]");
      chunk.byte_end = f.u64(range[1], cw + ".byte_range[1]");
      const uint64_t chunk_numel = ckpt::element_count(chunk.sizes);
      if (chunk.byte_end < chunk.byte_begin ||
          chunk.byte_end - chunk.byte_begin != chunk_numel * c10::elementSize(info.dtype)) {
        f.fail(cw + ".byte_range", "does not match its sizes and dtype");
      }
      const auto& file = index.files[file_by_name.at(chunk.file)];
      if (chunk.byte_end > file.size_bytes)
        f.fail(cw + ".byte_range", "extends past the end of " + chunk.file);
      for (const auto& other : info.chunks) {
        if (chunk_numel > 0 && ckpt::element_count(other.sizes) > 0 &&
            boxes_overlap(chunk, other)) {
          f.fail(cw, "overlaps another chunk of the tensor");
        }
      }
      covered += chunk_numel;
      info.chunks.push_back(std::move(chunk));
    }
    if (covered != numel) f.fail(where + ".chunks", "do not cover the whole tensor");
    index.tensors.push_back(std::move(info));
  }
  std::sort(index.tensors.begin(), index.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });

  if (auto it = root.find("training_state"); it != root.end()) {
    if (!it->is_object()) f.fail("training_state", "is not an object");
    index.training_state = *it;
  } else {
    index.training_state = json::object();
  }
  const json& ranks = f.member(root, "ranks", "the index");
  if (!ranks.is_array() || static_cast<int>(ranks.size()) != index.world_size) {
    f.fail("ranks", "is not an array with one entry per rank of world_size");
  }
  index.ranks = ranks;
  return index;
}

CheckpointIndex read_checkpoint_index(const std::filesystem::path& step_dir) {
  const std::filesystem::path path = step_dir / ckpt::kIndexFile;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw UserError(step_dir.string() + " is not a committed checkpoint (no index.json)");
  }
  return parse_checkpoint_index(read_file(path), path.string());
}

VerifyReport verify_checkpoint(const std::filesystem::path& step_dir) {
  VerifyReport report;
  CheckpointIndex index;
  try {
    index = read_checkpoint_index(step_dir);
  } catch (const std::exception& e) {
    report.problems.push_back(one_line_error(e));
    return report;
  }
  std::map<std::string, std::vector<std::pair<const TensorInfo*, const ChunkInfo*>>> chunks_by_file;
  for (const auto& tensor : index.tensors) {
    for (const auto& chunk : tensor.chunks)
      chunks_by_file[chunk.file].emplace_back(&tensor, &chunk);
  }
  for (const auto& file : index.files) {
    const std::filesystem::path path = step_dir / file.name;
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) {
      report.problems.push_back(path.string() + ": missing or unreadable (" + ec.message() + ")");
      continue;
    }
    if (size != file.size_bytes) {
      report.problems.push_back(path.string() + ": " + std::to_string(size) +
                                " bytes, the index says " + std::to_string(file.size_bytes) +
                                " (truncated or replaced)");
      continue;
    }
    try {
      const uint64_t hash = hash_file(path);
      report.bytes_checked += size;
      if (hash != file.xxh3) {
        report.problems.push_back(path.string() + ": xxh3 " + hex64(hash) +
                                  " does not match the index (" + hex64(file.xxh3) +
                                  "); the file is damaged");
        continue;
      }
      const SafetensorsHeader header = read_safetensors_header(path);
      for (const auto& [tensor, chunk] : chunks_by_file[file.name]) {
        auto it = std::find_if(header.tensors.begin(), header.tensors.end(),
                               [&](const SafetensorsEntry& e) { return e.name == chunk->name; });
        if (it == header.tensors.end()) {
          report.problems.push_back(path.string() + ": has no tensor '" + chunk->name +
                                    "' (index: " + tensor->name + ")");
        } else if (it->dtype != tensor->dtype || it->shape != chunk->sizes ||
                   header.data_start + it->begin != chunk->byte_begin ||
                   header.data_start + it->end != chunk->byte_end) {
          report.problems.push_back(path.string() + ": tensor '" + chunk->name +
                                    "' has another dtype, shape or byte range than the index says");
        }
      }
    } catch (const std::exception& e) {
      report.problems.push_back(one_line_error(e));
    }
  }
  return report;
}

std::vector<CheckpointEntry> list_checkpoints(const std::filesystem::path& dir) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return out;
  for (const auto& item : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = item.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !item.is_directory(ec)) continue;
    std::string digits = name.substr(5);
    bool committed = true;
    if (digits.size() > 4 && digits.ends_with(".tmp")) {
      digits.resize(digits.size() - 4);
      committed = false;
    }
    if (digits.empty() || digits.size() > 18 ||
        !std::all_of(digits.begin(), digits.end(),
                     [](unsigned char c) { return std::isdigit(c) != 0; }))
      continue;
    out.push_back({std::stoll(digits), item.path(), committed});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return std::tie(a.step, a.committed) < std::tie(b.step, b.committed);
  });
  return out;
}

std::filesystem::path resolve_checkpoint_path(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(path / ckpt::kIndexFile, ec)) return path;
  if (!std::filesystem::exists(path, ec)) throw UserError(path.string() + " does not exist");
  auto entries = list_checkpoints(path);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->committed) return it->path;
  }
  // A run directory given for its checkpoint directory: point at the one inside it.
  if (std::filesystem::is_regular_file(path / "manifest.json", ec) &&
      std::filesystem::is_directory(path / "checkpoints", ec)) {
    throw UserError(path.string() +
                    " is a run directory, not a checkpoint directory: its checkpoints are in " +
                    (path / "checkpoints").string() + " (give that, or a step-<N>/ inside it)");
  }
  throw UserError(path.string() +
                  " holds no committed checkpoint (no index.json and no step-<N>/ directory)");
}

}  // namespace kiln
