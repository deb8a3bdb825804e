// Loading: the read plan (which byte ranges each rank needs, at any world size), distributed
// checksum verification, fallback to older checkpoints, and consolidation into one file.
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "ckpt/internal.h"
#include "ckpt/resume.h"
#include "core/clock.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/safetensors.h"

namespace kiln {
namespace {

using nlohmann::json;

// One contiguous read: `bytes` bytes at `source_offset` into chunk's tensor in its file, to
// `dest_offset` bytes into the staging buffer of target `target`.
struct ReadOp {
  const ChunkInfo* chunk = nullptr;
  size_t target = 0;
  uint64_t source_offset = 0;
  uint64_t dest_offset = 0;
  uint64_t bytes = 0;
};

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * sizes[d];
  return strides;
}

// The reads bringing the part of `chunk` that overlaps the target box (offsets, sizes) into the
// target's row-major staging buffer: runs as long as both layouts are contiguous.
void plan_chunk_reads(const ChunkInfo& chunk, const std::vector<int64_t>& box_offsets,
                      const std::vector<int64_t>& box_sizes, size_t element_size, size_t target,
                      std::vector<ReadOp>& out) {
  const size_t dims = chunk.sizes.size();
  if (dims == 0) {
    out.push_back({&chunk, target, 0, 0, element_size});
    return;
  }
  std::vector<int64_t> lo(dims), hi(dims);
  for (size_t d = 0; d < dims; ++d) {
    lo[d] = std::max(chunk.offsets[d], box_offsets[d]);
    hi[d] = std::min(chunk.offsets[d] + chunk.sizes[d], box_offsets[d] + box_sizes[d]);
    if (hi[d] <= lo[d]) return;  // no overlap (or empty)
  }
  auto full = [&](size_t d) {
    return lo[d] == chunk.offsets[d] && hi[d] == chunk.offsets[d] + chunk.sizes[d] &&
           lo[d] == box_offsets[d] && hi[d] == box_offsets[d] + box_sizes[d];
  };
  size_t k = dims - 1;  // dims after k are full in both: one run spans dim k and everything after
  while (k > 0 && full(k)) --k;
  const auto src_strides = row_major_strides(chunk.sizes),
             dst_strides = row_major_strides(box_sizes);
  const uint64_t run_elements = static_cast<uint64_t>((hi[k] - lo[k]) * src_strides[k]);
  std::vector<int64_t> index(lo.begin(), lo.begin() + static_cast<std::ptrdiff_t>(k));
  while (true) {
    int64_t src = (lo[k] - chunk.offsets[k]) * src_strides[k],
            dst = (lo[k] - box_offsets[k]) * dst_strides[k];
    for (size_t d = 0; d < k; ++d) {
      src += (index[d] - chunk.offsets[d]) * src_strides[d];
      dst += (index[d] - box_offsets[d]) * dst_strides[d];
    }
    out.push_back({&chunk, target, static_cast<uint64_t>(src) * element_size,
                   static_cast<uint64_t>(dst) * element_size, run_elements * element_size});
    size_t d = k;  // odometer over dims [0, k)
    while (d > 0) {
      --d;
      if (++index[d] < hi[d]) break;
      index[d] = lo[d];
      if (d == 0) return;
    }
    if (k == 0) return;
  }
}

// Reads are cut into pieces of at most this size and issued by a few threads at once, so the
// device sees several requests in flight (virtio and NVMe disks read faster that way).
constexpr uint64_t kPieceBytes = 8ull << 20;
constexpr size_t kReadThreads = 4;

struct Piece {
  const SafetensorsEntry* entry;
  uint64_t source_offset;
  char* dest;
  uint64_t bytes;
};

void read_pieces(const SafetensorsReader& reader, const std::vector<Piece>& pieces) {
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    for (size_t k; (k = next.fetch_add(1)) < pieces.size();) {
      try {
        reader.read(*pieces[k].entry, pieces[k].source_offset, pieces[k].bytes, pieces[k].dest);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
        next = pieces.size();
      }
    }
  };
  {
    std::vector<std::jthread> helpers;  // joined at the end of this block
    for (size_t t = 1; t < std::min(kReadThreads, pieces.size()); ++t) helpers.emplace_back(work);
    work();
  }
  if (error) std::rethrow_exception(error);
}

struct TargetBox {
  std::vector<int64_t> offsets, sizes;
};

TargetBox target_box(const StateTensor& target, const TensorInfo& info, const std::string& where) {
  TargetBox box;
  box.sizes.assign(target.tensor.sizes().begin(), target.tensor.sizes().end());
  if (target.placement == Placement::kReplicated) {
    if (box.sizes != info.shape) {
      throw UserError(where + ": tensor '" + target.name + "' has shape " + shape_text(info.shape) +
                      " in the checkpoint but " + shape_text(box.sizes) +
                      " here (another model config?)");
    }
    box.offsets.assign(box.sizes.size(), 0);
    return box;
  }
  if (target.global_shape != info.shape) {
    throw UserError(where + ": tensor '" + target.name + "' has global shape " +
                    shape_text(info.shape) + " in the checkpoint but " +
                    shape_text(target.global_shape) + " here");
  }
  if (target.offsets.size() != box.sizes.size()) {
    throw UserError(where + ": target piece of '" + target.name +
                    "' needs one offset per dimension");
  }
  box.offsets = target.offsets;
  for (size_t d = 0; d < box.sizes.size(); ++d) {
    if (box.offsets[d] < 0 || box.offsets[d] + box.sizes[d] > info.shape[d]) {
      throw UserError(where + ": target piece of '" + target.name + "' lies outside the tensor");
    }
  }
  return box;
}

// Checks the file's header agrees with the index about a chunk; returns its entry.
const SafetensorsEntry& chunk_entry(const SafetensorsReader& reader, const TensorInfo& info,
                                    const ChunkInfo& chunk) {
  const SafetensorsEntry* entry = reader.find(chunk.name);
  if (!entry)
    throw UserError(reader.path().string() + ": has no tensor '" + chunk.name +
                    "' named by the index");
  if (entry->dtype != info.dtype || entry->shape != chunk.sizes ||
      reader.header().data_start + entry->begin != chunk.byte_begin ||
      reader.header().data_start + entry->end != chunk.byte_end) {
    throw UserError(reader.path().string() + ": tensor '" + chunk.name +
                    "' has another dtype, shape or byte range than index.json says");
  }
  return *entry;
}

}  // namespace

LoadResult load_checkpoint(const std::filesystem::path& step_dir, std::vector<StateTensor>& targets,
                           Communicator& comm, LoadOptions options) {
  const auto begin = SteadyClock::now();
  const std::string where = step_dir.string();
  LoadResult result;
  result.path = step_dir;
  std::string error;
  try {
    result.index = options.index ? *options.index : read_checkpoint_index(step_dir);
  } catch (const std::exception& e) {
    error = one_line_error(e);
  }
  ckpt::agree(comm, error);
  const CheckpointIndex& index = result.index;

  // 1. Plan: staging buffers and the reads that fill them.
  std::vector<torch::Tensor> staged(targets.size());
  std::map<std::string, std::vector<ReadOp>> ops_by_file;
  std::map<const ChunkInfo*, const TensorInfo*> tensor_of;
  try {
    std::set<std::string> names;
    for (size_t i = 0; i < targets.size(); ++i) {
      const StateTensor& target = targets[i];
      if (!names.insert(target.stored_name()).second)
        throw UserError(where + ": target '" + target.stored_name() + "' listed twice");
      const TensorInfo* info = index.find(target.name);
      if (!info) {
        throw UserError(where + " has no tensor '" + target.name + "' (it holds " +
                        std::to_string(index.tensors.size()) +
                        " tensors; saved from another model or optimizer?)");
      }
      if (!target.tensor.defined() || target.tensor.scalar_type() != info->dtype) {
        throw UserError(where + ": tensor '" + target.name + "' is " +
                        safetensors_dtype(info->dtype) +
                        " in the checkpoint but another dtype here");
      }
      const TargetBox box = target_box(target, *info, where);
      staged[i] = torch::empty(box.sizes, torch::TensorOptions().dtype(info->dtype));
      const size_t element_size = c10::elementSize(info->dtype);
      for (const auto& chunk : info->chunks) {
        tensor_of[&chunk] = info;
        plan_chunk_reads(chunk, box.offsets, box.sizes, element_size, i, ops_by_file[chunk.file]);
      }
    }
  } catch (const std::exception& e) {
    error = one_line_error(e);
  }
  ckpt::agree(comm, error);

  // 2. Read. A file whose every tensor this rank reads whole is hashed while it streams.
  std::set<std::string> verified;
  try {
    std::map<std::string, const FileInfo*> file_info;
    for (const auto& f : index.files) file_info[f.name] = &f;
    for (auto& [file, ops] : ops_by_file) {
      if (ops.empty()) continue;
      SafetensorsReader reader(step_dir / file);
      const FileInfo& info = *file_info.at(file);
      if (reader.size_bytes() != info.size_bytes) {
        throw UserError(reader.path().string() + ": " + std::to_string(reader.size_bytes()) +
                        " bytes, index.json says " + std::to_string(info.size_bytes) +
                        " (truncated or replaced)");
      }
      std::vector<std::pair<const SafetensorsEntry*, ReadOp>> reads;
      for (const auto& op : ops)
        reads.emplace_back(&chunk_entry(reader, *tensor_of.at(op.chunk), *op.chunk), op);
      std::sort(reads.begin(), reads.end(), [](const auto& a, const auto& b) {
        return a.first->begin + a.second.source_offset < b.first->begin + b.second.source_offset;
      });
      const auto& entries = reader.header().tensors;
      bool stream = options.verify && reads.size() == entries.size();
      for (size_t k = 0; stream && k < reads.size(); ++k) {
        stream = reads[k].first == &entries[k] && reads[k].second.source_offset == 0 &&
                 reads[k].second.bytes == entries[k].end - entries[k].begin;
      }
      std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash(XXH3_createState(),
                                                                    XXH3_freeState);
      if (stream) {
        XXH3_64bits_reset(hash.get());
        std::string prefix(reader.header().data_start, '\0');
        reader.read_raw(0, prefix.size(), prefix.data());
        XXH3_64bits_update(hash.get(), prefix.data(), prefix.size());
      }
      std::vector<Piece> pieces;
      for (const auto& [entry, op] : reads) {
        char* dest = static_cast<char*>(staged[op.target].data_ptr()) + op.dest_offset;
        for (uint64_t at = 0; at < op.bytes; at += kPieceBytes) {
          pieces.push_back(
              {entry, op.source_offset + at, dest + at, std::min(kPieceBytes, op.bytes - at)});
        }
        result.bytes_read += op.bytes;
      }
      read_pieces(reader, pieces);
      if (stream) {
        for (const auto& [entry, op] : reads) {
          XXH3_64bits_update(hash.get(),
                             static_cast<char*>(staged[op.target].data_ptr()) + op.dest_offset,
                             op.bytes);
        }
      }
      if (stream) {
        if (XXH3_64bits_digest(hash.get()) != info.xxh3) {
          throw UserError(reader.path().string() +
                          ": xxh3 does not match index.json; the file is damaged");
        }
        verified.insert(file);
      }
    }
  } catch (const std::exception& e) {
    error = one_line_error(e);
  }
  ckpt::agree(comm, error);

  // 3. Verify the files no rank streamed: each hashed by one rank (file k by rank k mod world).
  if (options.verify) {
    json mine = verified;
    std::set<std::string> done;
    for (const auto& text : comm.all_gather_bytes(mine.dump())) {
      for (const auto& name : json::parse(text)) done.insert(name.get<std::string>());
    }
    try {
      for (size_t k = 0; k < index.files.size(); ++k) {
        const FileInfo& f = index.files[k];
        if (done.count(f.name) ||
            static_cast<int>(k % static_cast<size_t>(comm.world_size())) != comm.rank())
          continue;
        const std::filesystem::path path = step_dir / f.name;
        std::error_code ec;
        const auto size = std::filesystem::file_size(path, ec);
        if (ec || size != f.size_bytes) {
          throw UserError(path.string() + ": missing or of the wrong size (index.json says " +
                          std::to_string(f.size_bytes) + " bytes)");
        }
        if (hash_file(path) != f.xxh3) {
          throw UserError(path.string() + ": xxh3 does not match index.json; the file is damaged");
        }
      }
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
    ckpt::agree(comm, error);
  }

  // 4. Everything verified on every rank: only now touch the targets.
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < targets.size(); ++i) targets[i].tensor.copy_(staged[i]);
  }
  result.seconds = seconds_since(begin);
  return result;
}

std::optional<LoadResult> load_latest_checkpoint(const std::filesystem::path& dir,
                                                 std::vector<StateTensor>& targets,
                                                 Communicator& comm, LoadOptions options) {
  return ckpt::load_newest(dir, comm, [&](const std::filesystem::path& step_dir) {
    return load_checkpoint(step_dir, targets, comm, options);
  });
}

namespace ckpt {

std::optional<LoadResult> load_newest(
    const std::filesystem::path& dir, Communicator& comm,
    const std::function<LoadResult(const std::filesystem::path&)>& load) {
  // Rank 0's listing, so every rank tries the same candidates in the same order.
  json steps = json::array();
  std::string error;
  if (comm.rank() == 0) {
    try {
      for (const auto& entry : list_checkpoints(dir)) {
        if (entry.committed) steps.push_back(entry.step);
      }
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
  }
  agree(comm, error);
  steps = json::parse(comm.all_gather_bytes(steps.dump())[0]);
  if (steps.empty()) return std::nullopt;
  std::string newest_error;
  for (size_t k = steps.size(); k-- > 0;) {
    const std::filesystem::path step_dir = dir / step_dir_name(steps[k].get<int64_t>());
    try {
      return load(step_dir);
    } catch (const StateMismatch&) {  // not damage: an older checkpoint holds the same state
      throw;
    } catch (const UserError& e) {  // agreed on every rank (a CommunicationError is not caught)
      if (newest_error.empty()) newest_error = e.what();
      log::warn("checkpoint: cannot load " + step_dir.string() + ": " + e.what() +
                (k > 0 ? "; falling back to the previous checkpoint" : ""));
    }
  }
  throw UserError("no loadable checkpoint in " + dir.string() + " (" +
                  std::to_string(steps.size()) + " tried; the newest failed with: " + newest_error +
                  "); run `kiln ckpt list " + dir.string() + "`");
}

}  // namespace ckpt

std::vector<std::pair<std::string, torch::Tensor>> read_checkpoint_tensors(
    const std::filesystem::path& step_dir, const std::string& prefix, bool verify) {
  if (verify) {
    VerifyReport report = verify_checkpoint(step_dir);
    if (!report.ok()) {
      throw UserError(step_dir.string() + " failed verification (" +
                      std::to_string(report.problems.size()) + " problems; run `kiln ckpt verify " +
                      step_dir.string() + "`): " + report.problems.front());
    }
  }
  CheckpointIndex index = read_checkpoint_index(step_dir);
  std::vector<StateTensor> targets;
  for (const auto& info : index.tensors) {
    if (info.name.rfind(prefix, 0) != 0) continue;
    targets.push_back(
        {info.name, torch::empty(info.shape, torch::TensorOptions().dtype(info.dtype))});
  }
  load_checkpoint(step_dir, targets, *single_process_communicator(), {.verify = false});
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& t : targets) out.emplace_back(t.name, std::move(t.tensor));
  return out;
}

int64_t consolidate_checkpoint(const std::filesystem::path& step_dir,
                               const std::filesystem::path& out, bool include_optimizer) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  const CheckpointIndex index = read_checkpoint_index(step_dir);
  for (auto& [name, tensor] : read_checkpoint_tensors(step_dir, "", /*verify=*/true)) {
    if (name.rfind("rng/", 0) == 0) continue;
    if (name.rfind("optim/", 0) == 0 && !include_optimizer) continue;
    tensors.emplace_back(name.rfind("model/", 0) == 0 ? name.substr(6) : name, std::move(tensor));
  }
  std::map<std::string, std::string> metadata = {
      {"format", "kiln-consolidated"},
      {"step", std::to_string(index.step)},
      {"source_world_size", std::to_string(index.world_size)}};
  write_safetensors(out, tensors, metadata);
  return static_cast<int64_t>(tensors.size());
}

}  // namespace kiln
