// Datasets, the sampler and the threaded loader.
//
// Data flow: Dataset (samples by index) -> Sampler (which indices form batch b of epoch e on this
// rank) -> Loader (worker threads build batches ahead into a bounded queue; the training thread
// takes them in order). The batch sequence depends only on (data seed, epoch, rank, world size),
// never on the number of workers.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

namespace kiln {

class Config;

/// One micro-batch. Classification: inputs [B, D] float32, targets [B] int64.
/// Language model: inputs [B, T] int64 tokens, targets [B, T] int64 (inputs shifted by one).
struct Batch {
  torch::Tensor inputs;
  torch::Tensor targets;
  int64_t samples() const { return inputs.size(0); }
};

/// A finite, indexable set of samples. Implementations are immutable after construction, so
/// get() may be called from several loader threads at once.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// Tokens per sample for language data (seq_len); 0 for classification.
  virtual int64_t tokens_per_sample() const = 0;
  /// The batch made of these samples, in this order, as CPU tensors. Thread-safe.
  /// Throws UserError on bad content (e.g. a token id >= the model's vocabulary).
  virtual Batch get(const std::vector<int64_t>& indices) const = 0;
};

struct Datasets {
  std::shared_ptr<const Dataset> train;
  std::shared_ptr<const Dataset> val;
  nlohmann::json identity;  // manifest "data": kind, path(s), size, content hash, split
};

/// The [data] keys the built-in datasets read (src/data/options.cpp).
struct DataSource {
  std::string name;            // data.name: "synthetic", "text", "tokens" or a registered one
  std::string path, val_path;  // data.path, data.val_path
  std::string format;          // data.format: the token files' format
  int64_t seq_len = 0;         // data.seq_len
  double val_fraction = 0;     // data.val_fraction
  int64_t num_samples = 0, val_samples = 0, teacher_hidden = 0;  // synthetic's data.*
  int64_t input_dim = 0, num_classes = 0;  // synthetic's shape: model.input_dim, num_classes
  uint64_t seed = 0;                       // data_seed(config)
  static DataSource from_config(const Config& config);
};

/// Builds the train/val datasets the config describes. Throws UserError naming the file/key.
Datasets make_datasets(const Config& config);

/// DistributedSampler semantics. Each epoch is a permutation of [0, N) drawn from (seed, epoch)
/// (identity when shuffle is off). Global batch b of an epoch is the permutation's slice
/// [b*B*W, (b+1)*B*W); rank r takes its elements r, r+W, r+2W, ... (B of them). The remainder
/// N mod (B*W) is left out of that epoch; with shuffle on it differs from epoch to epoch, with
/// shuffle off the same tail is never visited. Thread-safe.
class Sampler {
 public:
  Sampler(int64_t dataset_size, int64_t batch_size, int rank, int world_size, bool shuffle,
          uint64_t seed);
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t batch_size() const { return batch_size_; }
  /// This rank's sample indices for batch `batch` of epoch `epoch`.
  std::vector<int64_t> indices(int64_t epoch, int64_t batch) const;

 private:
  std::shared_ptr<const std::vector<int64_t>> permutation(int64_t epoch) const;
  int64_t dataset_size_, batch_size_;
  int rank_, world_size_;
  bool shuffle_;
  uint64_t seed_;
  int64_t batches_per_epoch_;
  struct PermutationCache;  // the last two epochs' permutations, locked (src/data/sampler.cpp)
  std::shared_ptr<PermutationCache> cache_;
};

/// Where the loader is: the next batch it returns is batch `batch` of epoch `epoch`.
struct LoaderPosition {
  int64_t epoch = 0;
  int64_t batch = 0;
  bool operator==(const LoaderPosition&) const = default;
};

struct LoaderOptions {
  int64_t batch_size = 32;
  int num_workers = 0;  // 0: batches are built in next(), in the caller's thread
  int prefetch = 2;     // batches built ahead of the consumer (>= 1)
  bool shuffle = true;
  uint64_t seed = 0;
  int rank = 0;
  int world_size = 1;
  torch::Device device = torch::kCPU;  // CUDA: pinned host memory + non-blocking copies
};

/// Background batch builder. next() is called from one thread (the training thread).
/// A worker's error is rethrown from next() at that batch's place in the stream, after every
/// batch before it, so what a run sees never depends on the worker count.
class Loader {
 public:
  Loader(std::shared_ptr<const Dataset> dataset, LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// The next batch in order, on the device. Blocks while it is being built.
  Batch next();
  LoaderPosition position() const;
  /// Continues from `position` (restarts the workers). Used by checkpoint resume.
  void seek(LoaderPosition position);
  /// Stops the worker threads once the batches they are building are done; built batches are
  /// kept and the batch sequence is unchanged. resume_workers() starts them again. Workers run
  /// with the thread-local state (profiler, grad mode) of the thread that started them, so a
  /// profiler pauses them around enabling and disabling (no op may run while it finalizes).
  /// Training thread only, and next() must not be called while paused; both are no-ops with
  /// num_workers = 0.
  void pause_workers();
  void resume_workers();
  const Sampler& sampler() const { return sampler_; }
  const LoaderOptions& options() const { return options_; }

 private:
  Batch build(int64_t stream_index) const;
  LoaderPosition position_of(int64_t stream_index) const;
  void start_workers();
  void stop_workers();
  void worker_loop();

  std::shared_ptr<const Dataset> dataset_;
  LoaderOptions options_;
  Sampler sampler_;
  struct Stream;  // the batch stream and its worker threads (src/data/loader.cpp)
  std::unique_ptr<Stream> stream_;
};

}  // namespace kiln
