#include <map>
#include <mutex>
#include <numeric>

#include "kiln/data.h"
#include "kiln/error.h"

namespace kiln {

struct Sampler::PermutationCache {
  std::mutex mutex;
  std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> epochs;
};

Sampler::Sampler(int64_t dataset_size, int64_t batch_size, int rank, int world_size, bool shuffle,
                 uint64_t seed)
    : dataset_size_(dataset_size),
      batch_size_(batch_size),
      rank_(rank),
      world_size_(world_size),
      shuffle_(shuffle),
      seed_(seed),
      cache_(std::make_shared<PermutationCache>()) {
  const int64_t global_batch = batch_size_ * world_size_;
  batches_per_epoch_ = dataset_size_ / global_batch;
  if (batches_per_epoch_ == 0) {
    throw UserError("the dataset has " + std::to_string(dataset_size_) +
                    " samples, fewer than one global batch (train.batch_size " +
                    std::to_string(batch_size_) + " x " + std::to_string(world_size_) +
                    " processes); lower train.batch_size or use more data");
  }
}

std::shared_ptr<const std::vector<int64_t>> Sampler::permutation(int64_t epoch) const {
  std::lock_guard lock(cache_->mutex);
  auto& cache = cache_->epochs;
  if (auto it = cache.find(epoch); it != cache.end()) return it->second;
  auto order = std::make_shared<std::vector<int64_t>>(dataset_size_);
  std::iota(order->begin(), order->end(), int64_t{0});
  if (shuffle_) {
    // Fisher-Yates with splitmix64 and Lemire's bounded draw: the same permutation on every
    // platform, and no ATen kernel on loader threads (an OpenMP team started there would compete
    // with the training thread's team for the cores). One stream per (seed, epoch).
    uint64_t state = seed_ ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(epoch + 1));
    auto next = [&state] {
      uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      return z ^ (z >> 31);
    };
    for (int64_t k = dataset_size_ - 1; k > 0; --k) {
      const uint64_t bound = static_cast<uint64_t>(k + 1);
      const uint64_t threshold = (0 - bound) % bound;
      unsigned __int128 product;
      do {
        product = static_cast<unsigned __int128>(next()) * bound;
      } while (static_cast<uint64_t>(product) < threshold);
      std::swap((*order)[static_cast<size_t>(k)], (*order)[static_cast<size_t>(product >> 64)]);
    }
  }
  // Loader workers run at most a few batches ahead, so two epochs cover every live request.
  while (cache.size() >= 2) cache.erase(cache.begin());
  cache[epoch] = order;
  return order;
}

std::vector<int64_t> Sampler::indices(int64_t epoch, int64_t batch) const {
  auto order = permutation(epoch);
  std::vector<int64_t> out(static_cast<size_t>(batch_size_));
  const int64_t base = batch * batch_size_ * world_size_;
  for (int64_t k = 0; k < batch_size_; ++k) {
    out[static_cast<size_t>(k)] = (*order)[static_cast<size_t>(base + k * world_size_ + rank_)];
  }
  return out;
}

}  // namespace kiln
