// Saving: the save plan (who writes what), staging, the background writer, the commit protocol
// and retention.
#include <fcntl.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "ckpt/internal.h"
#include "core/clock.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/run.h"
#include "kiln/safetensors.h"

namespace kiln {
namespace {

using nlohmann::json;
using Clock = SteadyClock;

// Blocking waits for a save poll the other ranks this often (see Checkpointer::advance).
constexpr std::chrono::milliseconds kBlockingSlice{50};

std::vector<int64_t> shape_of(const torch::Tensor& t) {
  return {t.sizes().begin(), t.sizes().end()};
}

// One rank's account of its save request, exchanged at the start of a save.
json describe_request(const SaveRequest& request, int rank) {
  json desc = {{"step", request.step}, {"error", ""}};
  std::set<std::string> names;
  std::string replicated;  // canonical text of the replicated tensors, hashed
  json sharded = json::array();
  uint64_t sharded_bytes = 0;
  for (const auto& t : request.tensors) {
    if (t.name.empty()) throw UserError("checkpoint: a state tensor has an empty name");
    if (!names.insert(t.name).second)
      throw UserError("checkpoint: state tensor '" + t.name + "' is listed twice");
    if (!t.tensor.defined())
      throw UserError("checkpoint: state tensor '" + t.name + "' is undefined");
    const std::string dtype = safetensors_dtype(t.tensor.scalar_type());
    if (t.placement == Placement::kReplicated) {
      replicated += t.name + "|" + dtype + "|" + json(shape_of(t.tensor)).dump() + "\n";
      continue;
    }
    const auto sizes = shape_of(t.tensor);
    if (t.global_shape.size() != sizes.size() || t.offsets.size() != sizes.size()) {
      throw UserError("checkpoint: sharded tensor '" + t.name + "' on rank " +
                      std::to_string(rank) +
                      ": global_shape and offsets need one entry per dimension of the piece");
    }
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (t.offsets[d] < 0 || t.offsets[d] + sizes[d] > t.global_shape[d]) {
        throw UserError("checkpoint: sharded tensor '" + t.name + "' on rank " +
                        std::to_string(rank) + ": the piece at offsets " + json(t.offsets).dump() +
                        " with shape " + json(sizes).dump() + " does not fit in the global shape " +
                        json(t.global_shape).dump());
      }
    }
    sharded.push_back({{"name", t.name},
                       {"dtype", dtype},
                       {"shape", t.global_shape},
                       {"offsets", t.offsets},
                       {"sizes", sizes}});
    sharded_bytes += t.tensor.nbytes();
  }
  desc["replicated_xxh3"] = hex64(XXH3_64bits(replicated.data(), replicated.size()));
  desc["sharded"] = std::move(sharded);
  desc["sharded_bytes"] = sharded_bytes;
  desc["rank_state"] = request.rank_state.is_null() ? json::object() : request.rank_state;
  return desc;
}

// The same verdict on every rank: the ranks agree on the step and the replicated tensors, and the
// sharded pieces of each tensor tile it exactly.
std::string check_descriptions(const std::vector<json>& descs) {
  for (size_t r = 0; r < descs.size(); ++r) {
    if (!descs[r]["error"].get<std::string>().empty()) {
      return "rank " + std::to_string(r) + ": " + descs[r]["error"].get<std::string>();
    }
  }
  for (size_t r = 1; r < descs.size(); ++r) {
    if (descs[r]["step"] != descs[0]["step"]) {
      return fmt::format(
          "checkpoint: rank {} saves step {} but rank 0 saves step {}; every rank must save the "
          "same step",
          r, descs[r]["step"].dump(), descs[0]["step"].dump());
    }
    if (descs[r]["replicated_xxh3"] != descs[0]["replicated_xxh3"]) {
      return fmt::format(
          "checkpoint: rank {} lists other replicated tensors (names, dtypes or shapes) than rank "
          "0",
          r);
    }
  }
  struct Piece {
    std::vector<int64_t> offsets, sizes;
  };
  std::map<std::string, std::pair<json, std::vector<Piece>>> sharded;
  for (const auto& desc : descs) {
    for (const auto& s : desc["sharded"]) {
      auto& [meta, pieces] = sharded[s["name"].get<std::string>()];
      if (meta.is_null()) meta = {{"dtype", s["dtype"]}, {"shape", s["shape"]}};
      if (meta["dtype"] != s["dtype"] || meta["shape"] != s["shape"]) {
        return "checkpoint: the pieces of sharded tensor '" + s["name"].get<std::string>() +
               "' disagree on dtype or global shape across ranks";
      }
      pieces.push_back(
          {s["offsets"].get<std::vector<int64_t>>(), s["sizes"].get<std::vector<int64_t>>()});
    }
  }
  for (const auto& [name, entry] : sharded) {
    const auto& [meta, pieces] = entry;
    uint64_t covered = 0;
    for (size_t a = 0; a < pieces.size(); ++a) {
      const uint64_t volume = ckpt::element_count(pieces[a].sizes);
      covered += volume;
      for (size_t b = 0; b < a && volume > 0; ++b) {
        bool overlap = ckpt::element_count(pieces[b].sizes) > 0;
        for (size_t d = 0; d < pieces[a].sizes.size() && overlap; ++d) {
          overlap = pieces[a].offsets[d] < pieces[b].offsets[d] + pieces[b].sizes[d] &&
                    pieces[b].offsets[d] < pieces[a].offsets[d] + pieces[a].sizes[d];
        }
        if (overlap) return "checkpoint: two pieces of sharded tensor '" + name + "' overlap";
      }
    }
    if (covered != ckpt::element_count(meta["shape"].get<std::vector<int64_t>>())) {
      return "checkpoint: the pieces of sharded tensor '" + name +
             "' do not cover the whole tensor";
    }
  }
  return "";
}

// Which rank writes each replicated tensor: largest first, each to the rank with the fewest bytes
// so far (sharded bytes included; ties to the lowest rank). Deterministic, so every rank computes
// the same plan from the same list.
std::vector<int> plan_replicated(const std::vector<const StateTensor*>& replicated,
                                 const std::vector<json>& descs) {
  std::vector<uint64_t> load(descs.size());
  for (size_t r = 0; r < descs.size(); ++r) load[r] = descs[r]["sharded_bytes"].get<uint64_t>();
  std::vector<size_t> order(replicated.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const uint64_t ba = replicated[a]->tensor.nbytes(), bb = replicated[b]->tensor.nbytes();
    return ba != bb ? ba > bb : replicated[a]->name < replicated[b]->name;
  });
  std::vector<int> owner(replicated.size());
  for (size_t k : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[k] = r;
    load[static_cast<size_t>(r)] += replicated[k]->tensor.nbytes();
  }
  return owner;
}

// Copies `live` into reusable CPU buffers (pinned when the source is on CUDA): real copies, never
// aliases. Returns the copies, named.
std::vector<std::pair<std::string, torch::Tensor>> stage(
    std::vector<torch::Tensor>& buffers,
    const std::vector<std::pair<std::string, torch::Tensor>>& live) {
  torch::NoGradGuard no_grad;
  if (buffers.size() < live.size()) buffers.resize(live.size());
  std::vector<std::pair<std::string, torch::Tensor>> out;
  bool any_cuda = false;
  for (size_t k = 0; k < live.size(); ++k) {
    const torch::Tensor& source = live[k].second;
    torch::Tensor& buffer = buffers[k];
    if (!buffer.defined() || buffer.sizes() != source.sizes() ||
        buffer.scalar_type() != source.scalar_type()) {
      buffer = torch::empty(
          source.sizes(),
          torch::TensorOptions().dtype(source.scalar_type()).pinned_memory(source.is_cuda()));
    }
    if (source.is_cpu() && source.is_contiguous()) {
      if (source.nbytes() > 0) std::memcpy(buffer.data_ptr(), source.data_ptr(), source.nbytes());
    } else {
      buffer.copy_(source, /*non_blocking=*/source.is_cuda());
      any_cuda = any_cuda || source.is_cuda();
    }
    out.emplace_back(live[k].first, buffer);
  }
  if (any_cuda) torch::cuda::synchronize();
  return out;
}

void remove_quietly(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::filesystem::path replaced_path(const std::filesystem::path& final_dir) {
  std::filesystem::path replaced = final_dir;
  replaced += ".replaced";
  return replaced;
}

// Makes the finished `tmp_dir` (index written) the committed `final_dir`, durably. When final_dir
// exists (a step saved again, e.g. by a run resumed from an older checkpoint), the two are swapped
// in one atomic renameat2(RENAME_EXCHANGE): at every instant step-<N> is a whole checkpoint, the
// old or the new. Where the file system cannot exchange, the old one is first renamed to
// step-<N>.replaced; a crash before the second rename leaves step-<N>.replaced without step-<N>,
// which the next Checkpointer restores (recover_interrupted_commits).
void publish(const std::filesystem::path& tmp_dir, const std::filesystem::path& final_dir) {
  const std::filesystem::path dir = final_dir.parent_path();
  std::error_code ec;
  if (std::filesystem::exists(final_dir, ec)) {
    if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(dir);
      remove_quietly(tmp_dir);  // now the old checkpoint
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
      throw UserError("cannot exchange " + tmp_dir.string() + " with " + final_dir.string() + ": " +
                      errno_text());
    }
    const std::filesystem::path replaced = replaced_path(final_dir);
    remove_quietly(replaced);
    std::filesystem::rename(final_dir, replaced, ec);
    if (ec) throw UserError("cannot move aside " + final_dir.string() + ": " + ec.message());
    std::filesystem::rename(tmp_dir, final_dir, ec);
    if (ec) {
      std::error_code ignored;
      std::filesystem::rename(replaced, final_dir, ignored);
      throw UserError("cannot rename " + tmp_dir.string() + " to " + final_dir.string() + ": " +
                      ec.message());
    }
    fsync_directory(dir);
    remove_quietly(replaced);
    return;
  }
  std::filesystem::rename(tmp_dir, final_dir, ec);
  if (ec) {
    throw UserError("cannot rename " + tmp_dir.string() + " to " + final_dir.string() + ": " +
                    ec.message());
  }
  fsync_directory(dir);
}

// Rank 0 at startup: puts back what a killed run's commit left half done, then removes its
// unfinished saves. step-<N>.replaced without step-<N> is a committed checkpoint whose replacement
// never landed: it becomes step-<N> again. With step-<N> present, the replacement landed and the
// .replaced copy (and every step-<N>.tmp, latest.tmp.*) is an unfinished save.
void recover_interrupted_commits(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> stale;
  for (const auto& item : std::filesystem::directory_iterator(dir)) {
    const std::string name = item.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.ends_with(".replaced")) {
      std::filesystem::path final_dir = item.path();
      final_dir.replace_extension();  // step-<N>
      std::error_code ec;
      if (!std::filesystem::exists(final_dir, ec)) {
        std::filesystem::rename(item.path(), final_dir, ec);
        if (ec) {
          throw UserError("cannot restore " + item.path().string() + " to " + final_dir.string() +
                          ": " + ec.message() + "; rename it by hand");
        }
        fsync_directory(dir);
        log::warn("checkpoint: restored " + final_dir.string() + " from " + item.path().string() +
                  " (a run was killed while saving that step again)");
        continue;
      }
    }
    const bool stale_latest = name.rfind(std::string(ckpt::kLatestFile) + ".tmp.", 0) == 0;
    if (stale_latest ||
        (name.rfind("step-", 0) == 0 && (name.ends_with(".tmp") || name.ends_with(".replaced")))) {
      stale.push_back(item.path());
    }
  }
  for (const auto& path : stale) {
    log::info("checkpoint: removing " + path.string() + " (an unfinished save of an earlier run)");
    remove_quietly(path);
  }
}

}  // namespace

// ---- SaveHandle --------------------------------------------------------------------------------

bool SaveHandle::finished() const {
  std::lock_guard lock(mutex_);
  return finished_;
}
bool SaveHandle::committed() const {
  std::lock_guard lock(mutex_);
  return committed_;
}
std::string SaveHandle::error() const {
  std::lock_guard lock(mutex_);
  return error_;
}
void SaveHandle::rethrow_if_failed() const {
  std::lock_guard lock(mutex_);
  if (finished_ && !committed_) throw UserError(error_);
}
SaveStats SaveHandle::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

// ---- the save in flight ----------------------------------------------------------------------

struct Checkpointer::Job {
  enum class Status { kWriting, kWritten, kFailed, kCommitting, kCommitted, kCommitFailed };

  std::shared_ptr<SaveHandle> handle;
  int64_t step = 0;
  int rank = 0;
  CheckpointOptions options;
  std::filesystem::path tmp_dir, final_dir;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;  // this rank's file, CPU tensors
  std::vector<std::pair<std::string, torch::Tensor>>
      sources;                                    // background staging: the live tensors
  std::vector<torch::Tensor>* staging = nullptr;  // ... and the buffers to copy them into
  std::map<std::string, std::string> metadata;
  json index;  // rank 0: the index without files and byte ranges
  Clock::time_point begin;

  std::mutex mutex;
  std::condition_variable cv;
  Status status = Status::kWriting;
  std::string message;  // the written file's description, or the error
  double write_seconds = 0, staging_seconds = 0;
  bool staged = true;  // false while background staging has not copied `sources` yet
  uint64_t bytes_written = 0, total_bytes = 0;
  bool commit_requested = false, abandon = false;
  std::vector<std::string> gathered;  // rank 0: every rank's "written" message
  std::thread thread;

  void run() {
    if (!sources.empty() || !staged) {
      const auto staging_begin = Clock::now();
      std::string error;
      try {
        tensors = stage(*staging, sources);
      } catch (const std::exception& e) {
        error = "staging failed: " + one_line_error(e);
      }
      sources.clear();
      {
        std::lock_guard lock(mutex);
        staged = true;
        staging_seconds = seconds_since(staging_begin);
        if (!error.empty()) {
          status = Status::kFailed;
          message = error;
        }
      }
      cv.notify_all();
      if (!error.empty()) return;
    }
    const auto start = Clock::now();
    bool written = false;
    try {
      const std::string file = ckpt::rank_file_name(rank);
      std::error_code ec;
      std::filesystem::create_directories(tmp_dir, ec);
      if (ec) throw UserError("cannot create " + tmp_dir.string() + ": " + ec.message());
      SafetensorsWriteResult result = write_safetensors(tmp_dir / file, tensors, metadata);
      json info = {{"file", file}, {"size_bytes", result.size_bytes}, {"xxh3", hex64(result.xxh3)}};
      json ranges = json::object();
      for (size_t k = 0; k < tensors.size(); ++k) {
        ranges[tensors[k].first] = {result.tensor_byte_ranges[k].first,
                                    result.tensor_byte_ranges[k].second};
      }
      info["ranges"] = std::move(ranges);
      std::lock_guard lock(mutex);
      status = Status::kWritten;
      message = info.dump();
      bytes_written = result.size_bytes;
      write_seconds = seconds_since(start);
      written = true;
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex);
      status = Status::kFailed;
      message = one_line_error(e);
      write_seconds = seconds_since(start);
    }
    tensors.clear();  // drop the references to the staged (or live) tensors
    cv.notify_all();
    if (rank != 0 || !written) return;
    {
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return commit_requested || abandon; });
      if (abandon) return;
    }
    std::string error;
    uint64_t total = 0;
    try {
      total = commit();
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
    {
      std::lock_guard lock(mutex);
      status = error.empty() ? Status::kCommitted : Status::kCommitFailed;
      message = error;
      total_bytes = total;
    }
    cv.notify_all();
  }

  // Rank 0, after every rank's file is durable: index.json, rename, fsync, latest, retention.
  uint64_t commit() {
    json files = json::array();
    std::map<std::pair<std::string, std::string>, json> ranges;  // (file, name) -> [begin, end]
    uint64_t total = 0;
    for (size_t r = 0; r < gathered.size(); ++r) {
      json info = json::parse(gathered[r].substr(1));
      const std::string file = info["file"].get<std::string>();
      files.push_back({{"name", file},
                       {"rank", r},
                       {"size_bytes", info["size_bytes"]},
                       {"xxh3", info["xxh3"]}});
      total += info["size_bytes"].get<uint64_t>();
      for (const auto& [name, range] : info["ranges"].items()) ranges[{file, name}] = range;
    }
    index["files"] = std::move(files);
    for (auto& [name, tensor] : index["tensors"].items()) {
      for (auto& chunk : tensor["chunks"]) {
        auto it = ranges.find({chunk["file"].get<std::string>(), chunk["name"].get<std::string>()});
        if (it == ranges.end())
          throw UserError("checkpoint: internal error: no byte range for " + name);
        chunk["byte_range"] = it->second;
      }
    }
    write_file_atomic(tmp_dir / ckpt::kIndexFile, ckpt::index_text_with_checksum(index));
    publish(tmp_dir, final_dir);
    write_file_atomic(options.dir / ckpt::kLatestFile, ckpt::step_dir_name(step) + "\n");
    try {
      for (const auto& removed :
           ckpt::prune(options.dir, options.keep_last_k, options.keep_every, step)) {
        log::info("checkpoint: removed " + removed.string() +
                  " (retention: keep_last_k = " + std::to_string(options.keep_last_k) +
                  ", keep_every = " + std::to_string(options.keep_every) + ")");
      }
    } catch (const std::exception& e) {
      log::warn("checkpoint: retention failed (checkpoints kept): " + one_line_error(e));
    }
    return total;
  }
};

// ---- Checkpointer ------------------------------------------------------------------------------

Checkpointer::Checkpointer(CheckpointOptions options, Communicator& comm)
    : options_(std::move(options)), comm_(comm) {
  if (options_.keep_last_k < 2) {
    throw UserError("checkpoint.keep_last_k = " + std::to_string(options_.keep_last_k) +
                    " must be >= 2 (a checkpoint being written must never be the only one)");
  }
  std::string error;
  if (comm_.rank() == 0) {
    try {
      std::error_code ec;
      std::filesystem::create_directories(options_.dir, ec);
      if (ec)
        throw UserError("cannot create checkpoint directory " + options_.dir.string() + ": " +
                        ec.message());
      recover_interrupted_commits(options_.dir);
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
  }
  ckpt::agree(comm_, error);
}

Checkpointer::~Checkpointer() {
  if (!job_) return;
  {
    std::lock_guard lock(job_->mutex);
    job_->abandon = true;
  }
  job_->cv.notify_all();
  if (job_->thread.joinable()) job_->thread.join();
  // Rank 0's thread finishes a commit it had started; only rank 0 knows the outcome.
  const std::string step = std::to_string(job_->step);
  if (comm_.rank() != 0) {
    if (job_->status != Job::Status::kWritten) {
      log::warn("checkpoint: this rank's part of the save of step " + step +
                " was not written (abandoned)");
    }
    return;
  }
  if (job_->status == Job::Status::kCommitted) {
    log::info("checkpoint: step-" + step + " committed while the checkpointer shut down");
    return;
  }
  remove_quietly(job_->tmp_dir);
  log::warn("checkpoint: the save of step " + step + " was not committed (abandoned)");
}

std::shared_ptr<const SaveHandle> Checkpointer::save(SaveRequest request) {
  const auto begin = Clock::now();
  wait();
  const double wait_previous = seconds_since(begin);
  const int rank = comm_.rank(), world = comm_.world_size();

  // 1. Agree on what is saved.
  json mine;
  try {
    mine = describe_request(request, rank);
  } catch (const std::exception& e) {
    mine = {{"step", request.step}, {"error", one_line_error(e)}};
  }
  std::vector<json> descs;
  for (const auto& text : comm_.all_gather_bytes(mine.dump())) descs.push_back(json::parse(text));
  if (std::string problem = check_descriptions(descs); !problem.empty()) throw UserError(problem);

  // 2. Every rank's writer thread creates step-<N>.tmp/ (idempotent), so no further round trip is
  // needed here; stale .tmp directories were removed when the Checkpointer started, failed saves
  // remove theirs.
  const std::filesystem::path tmp_dir = options_.dir / ckpt::tmp_dir_name(request.step);

  // 3. What this rank writes: its share of the replicated tensors and its own pieces.
  std::vector<const StateTensor*> replicated;
  for (const auto& t : request.tensors) {
    if (t.placement == Placement::kReplicated) replicated.push_back(&t);
  }
  std::sort(replicated.begin(), replicated.end(),
            [](auto* a, auto* b) { return a->name < b->name; });
  const std::vector<int> owner = plan_replicated(replicated, descs);
  std::vector<const StateTensor*> to_write;
  for (const auto& t : request.tensors) {
    if (t.placement == Placement::kSharded) to_write.push_back(&t);
  }
  for (size_t k = 0; k < replicated.size(); ++k) {
    if (owner[k] == rank) to_write.push_back(replicated[k]);
  }

  auto job = std::make_unique<Job>();
  job->handle = std::shared_ptr<SaveHandle>(new SaveHandle(request.step));
  job->step = request.step;
  job->rank = rank;
  job->options = options_;
  job->tmp_dir = tmp_dir;
  job->final_dir = options_.dir / ckpt::step_dir_name(request.step);
  job->begin = begin;
  job->metadata = {{"format", ckpt::kFormatName},
                   {"format_version", std::to_string(kCheckpointFormatVersion)},
                   {"step", std::to_string(request.step)},
                   {"rank", std::to_string(rank)},
                   {"world_size", std::to_string(world)}};

  // 4. Staging. Sync saves write the live CPU tensors (training waits). Async saves copy them to
  // CPU buffers reused across saves (pinned for CUDA) so training may change the live tensors:
  // here, or with background_staging in the writer thread before it writes (wait_for_staging()
  // fences the caller's next change of them).
  std::vector<std::pair<std::string, torch::Tensor>> live;
  for (const auto* t : to_write) live.emplace_back(t->name, t->tensor.detach());
  double staging_seconds = 0;
  if (!options_.async) {
    for (auto& [name, tensor] : live)
      job->tensors.emplace_back(name, tensor.to(torch::kCPU).contiguous());
  } else if (options_.background_staging) {
    job->sources = std::move(live);
    job->staging = &staging_;
    job->staged = false;
  } else {
    const auto staging_begin = Clock::now();
    job->tensors = stage(staging_, live);
    staging_seconds = seconds_since(staging_begin);
  }

  // 5. Rank 0 drafts the index (files and byte ranges are filled in at commit).
  if (rank == 0) {
    json tensors = json::object();
    for (size_t k = 0; k < replicated.size(); ++k) {
      const auto& t = *replicated[k];
      const auto shape = shape_of(t.tensor);
      tensors[t.name] = {
          {"dtype", safetensors_dtype(t.tensor.scalar_type())},
          {"shape", shape},
          {"placement", "replicated"},
          {"chunks", json::array({{{"file", ckpt::rank_file_name(owner[k])},
                                   {"name", t.name},
                                   {"offsets", std::vector<int64_t>(shape.size(), 0)},
                                   {"sizes", shape}}})}};
    }
    for (size_t r = 0; r < descs.size(); ++r) {
      for (const auto& s : descs[r]["sharded"]) {
        json& entry = tensors[s["name"].get<std::string>()];
        if (entry.is_null()) {
          entry = {{"dtype", s["dtype"]},
                   {"shape", s["shape"]},
                   {"placement", "sharded"},
                   {"chunks", json::array()}};
        }
        entry["chunks"].push_back({{"file", ckpt::rank_file_name(static_cast<int>(r))},
                                   {"name", s["name"]},
                                   {"offsets", s["offsets"]},
                                   {"sizes", s["sizes"]}});
      }
    }
    json ranks = json::array();
    for (const auto& d : descs) ranks.push_back(d["rank_state"]);
    job->index = {{"format", ckpt::kFormatName},
                  {"format_version", kCheckpointFormatVersion},
                  {"step", request.step},
                  {"world_size", world},
                  {"created_utc", utc_now_iso8601()},
                  {"tensors", std::move(tensors)},
                  {"training_state",
                   request.training_state.is_null() ? json::object() : request.training_state},
                  {"ranks", std::move(ranks)}};
  }

  // 6. Write in the background; a sync save waits for the commit here.
  {
    std::lock_guard lock(job->handle->mutex_);
    job->handle->stats_.wait_previous_seconds = wait_previous;
    job->handle->stats_.staging_seconds = staging_seconds;
  }
  Job* raw = job.get();
  job->thread = std::thread([raw] { raw->run(); });
  job_ = std::move(job);
  last_ = job_->handle;
  auto handle = last_;
  if (!options_.async) advance(/*blocking=*/true);
  {
    std::lock_guard lock(handle->mutex_);
    handle->stats_.stall_seconds = seconds_since(begin);
  }
  return handle;
}

double Checkpointer::wait_for_staging() {
  if (!job_) return 0;
  const auto begin = Clock::now();
  std::unique_lock lock(job_->mutex);
  job_->cv.wait(lock, [&] { return job_->staged; });
  return seconds_since(begin);
}

void Checkpointer::poll() {
  if (job_) advance(/*blocking=*/false);
}

void Checkpointer::wait() {
  if (!job_) return;
  const auto begin = Clock::now();
  const int64_t step = job_->step;
  advance(/*blocking=*/true);
  log::info(fmt::format("checkpoint: waited {} for the save of step {} to finish",
                        format_duration(seconds_since(begin)), step));
}

void Checkpointer::advance(bool blocking) {
  using Status = Job::Status;
  while (job_) {
    std::string mine;
    {
      std::unique_lock lock(job_->mutex);
      if (blocking) {
        // Wait locally for at most a slice, then exchange statuses (again and again): every rank
        // reaches each all-gather within a slice of the others, so a rank whose write takes
        // longer than dist.timeout_seconds never leaves the others blocked in a collective.
        job_->cv.wait_for(lock, kBlockingSlice, [&] {
          return job_->status != Status::kWriting && job_->status != Status::kCommitting;
        });
      }
      switch (job_->status) {
        case Status::kWriting:
          mine = "W";
          break;
        case Status::kWritten:
          mine = "D" + job_->message;
          break;
        case Status::kFailed:
          mine = "F" + job_->message;
          break;
        case Status::kCommitting:
          mine = "C";
          break;
        case Status::kCommitted:
          mine = "K" + std::to_string(job_->total_bytes);
          break;
        case Status::kCommitFailed:
          mine = "X" + job_->message;
          break;
      }
    }
    const std::vector<std::string> all = comm_.all_gather_bytes(mine);
    // Every rank decides from the same gathered statuses, so all resolve at the same call.
    const char rank0 = all[0].empty() ? 'W' : all[0][0];
    if (rank0 == 'K') {
      resolve("", std::stoull(all[0].substr(1)));
      return;
    }
    if (rank0 == 'X') {
      resolve("commit of step " + std::to_string(job_->step) + " failed: " + all[0].substr(1), 0);
      return;
    }
    const bool waiting =
        rank0 == 'C' || std::any_of(all.begin(), all.end(),
                                    [](const std::string& s) { return s.empty() || s[0] == 'W'; });
    if (!waiting) {
      for (size_t r = 0; r < all.size(); ++r) {
        if (all[r][0] == 'F') {
          resolve((all.size() > 1 ? "rank " + std::to_string(r) + ": " : std::string()) +
                      all[r].substr(1),
                  0);
          return;
        }
      }
      if (comm_.rank() == 0) {
        std::lock_guard lock(job_->mutex);
        job_->gathered = all;
        job_->commit_requested = true;
        job_->status = Status::kCommitting;
      }
      job_->cv.notify_all();
    }
    if (!blocking) return;
  }
}

void Checkpointer::resolve(const std::string& error, uint64_t total_bytes) {
  {
    std::lock_guard lock(job_->mutex);
    job_->abandon = true;  // rank 0's thread may still wait for a commit decision
  }
  job_->cv.notify_all();
  if (job_->thread.joinable()) job_->thread.join();
  if (!error.empty() && comm_.rank() == 0) remove_quietly(job_->tmp_dir);
  const double total_seconds = seconds_since(job_->begin);
  {
    auto& h = *job_->handle;
    std::lock_guard lock(h.mutex_);
    h.finished_ = true;
    h.committed_ = error.empty();
    h.error_ = error.empty() ? "" : "checkpoint step " + std::to_string(job_->step) + ": " + error;
    h.stats_.bytes_written = job_->bytes_written;
    h.stats_.total_bytes = total_bytes;
    h.stats_.write_seconds = job_->write_seconds;
    if (options_.background_staging) h.stats_.staging_seconds = job_->staging_seconds;
    h.stats_.total_seconds = total_seconds;
  }
  if (error.empty()) {
    if (comm_.rank() == 0) {
      log::info(fmt::format("checkpoint: step-{} committed ({} in {})", job_->step,
                            format_bytes(static_cast<double>(total_bytes)),
                            format_duration(total_seconds)));
    }
  } else {
    log::error(job_->handle->error());
  }
  job_.reset();
}

namespace ckpt {

std::vector<std::filesystem::path> prune(const std::filesystem::path& dir, int64_t keep_last_k,
                                         int64_t keep_every, int64_t just_committed) {
  std::vector<CheckpointEntry> committed;
  for (auto& entry : list_checkpoints(dir)) {
    if (entry.committed) committed.push_back(std::move(entry));
  }
  std::vector<std::filesystem::path> removed;
  const int64_t n = static_cast<int64_t>(committed.size());
  // The newest keep_last_k (at least the newest one) are kept.
  for (int64_t k = 0; k + std::max<int64_t>(keep_last_k, 1) < n; ++k) {
    const auto& entry = committed[static_cast<size_t>(k)];
    if (keep_every > 0 && entry.step % keep_every == 0) continue;
    if (entry.step == just_committed) continue;
    std::error_code ec;
    std::filesystem::remove_all(entry.path, ec);
    if (ec) throw UserError("cannot remove " + entry.path.string() + ": " + ec.message());
    removed.push_back(entry.path);
  }
  return removed;
}

}  // namespace ckpt

std::vector<std::filesystem::path> prune_checkpoints(const std::filesystem::path& dir,
                                                     int64_t keep_last_k, int64_t keep_every) {
  return ckpt::prune(dir, keep_last_k, keep_every, /*just_committed=*/-1);
}

}  // namespace kiln
