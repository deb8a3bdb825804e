#include <ATen/ThreadLocalState.h>

#include <chrono>

#include "kiln/data.h"

namespace kiln {

Loader::Loader(std::shared_ptr<const Dataset> dataset, LoaderOptions options)
    : dataset_(std::move(dataset)),
      options_(std::move(options)),
      sampler_(dataset_->size(), options_.batch_size, options_.rank, options_.world_size,
               options_.shuffle, options_.seed) {
  if (options_.prefetch < 1) options_.prefetch = 1;
  start_workers();
}

Loader::~Loader() {
  stop_workers();
}

LoaderPosition Loader::position_of(int64_t stream_index) const {
  const int64_t per_epoch = sampler_.batches_per_epoch();
  const int64_t absolute = start_.epoch * per_epoch + start_.batch + stream_index;
  return {absolute / per_epoch, absolute % per_epoch};
}

LoaderPosition Loader::position() const {
  std::lock_guard lock(mutex_);
  return position_of(next_deliver_);
}

Batch Loader::build(int64_t stream_index) const {
  LoaderPosition at = position_of(stream_index);
  Batch batch = dataset_->get(sampler_.indices(at.epoch, at.batch));
  if (options_.device.is_cuda()) {
    batch.inputs = batch.inputs.pin_memory();
    batch.targets = batch.targets.pin_memory();
  }
  return batch;
}

void Loader::worker_loop() {
  while (true) {
    int64_t index;
    {
      std::unique_lock lock(mutex_);
      work_cv_.wait(lock, [&] {
        return stopping_ || (next_claim_ < next_deliver_ + options_.prefetch &&
                             (!error_ || next_claim_ < error_index_));
      });
      if (stopping_) return;
      index = next_claim_++;
    }
    try {
      Batch batch = build(index);
      std::lock_guard lock(mutex_);
      ready_.emplace(index, std::move(batch));
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_ || index < error_index_) {
        error_ = std::current_exception();
        error_index_ = index;
      }
    }
    ready_cv_.notify_all();
  }
}

void Loader::start_workers() {
  stopping_ = false;
  // Like at::launch: workers inherit the starting thread's thread-local state (profiler, modes).
  const at::ThreadLocalState state;
  for (int k = 0; k < options_.num_workers; ++k) {
    workers_.emplace_back([this, state] {
      at::ThreadLocalStateGuard guard(state);
      worker_loop();
    });
  }
}

void Loader::stop_workers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  workers_.clear();  // jthreads: each joins as it is destroyed
}

Batch Loader::next() {
  Batch batch;
  if (options_.num_workers == 0) {
    int64_t index;
    {
      std::lock_guard lock(mutex_);
      index = next_deliver_;
    }
    batch = build(index);
    std::lock_guard lock(mutex_);
    ++next_deliver_;
    next_claim_ = next_deliver_;
  } else {
    std::unique_lock lock(mutex_);
    // A failure is raised at its own place in the stream, so what a run sees before it does not
    // depend on the worker count.
    ready_cv_.wait(lock, [&] {
      return ready_.count(next_deliver_) || (error_ && error_index_ == next_deliver_);
    });
    auto it = ready_.find(next_deliver_);
    if (it == ready_.end()) std::rethrow_exception(error_);
    batch = std::move(it->second);
    ready_.erase(it);
    ++next_deliver_;
    lock.unlock();
    work_cv_.notify_all();
  }
  if (!options_.device.is_cpu()) {
    batch.inputs = batch.inputs.to(options_.device, /*non_blocking=*/true);
    batch.targets = batch.targets.to(options_.device, /*non_blocking=*/true);
  }
  return batch;
}

void Loader::pause_workers() {
  stop_workers();
}

void Loader::resume_workers() {
  if (workers_.empty()) start_workers();
}

void Loader::seek(LoaderPosition position) {
  stop_workers();
  {
    std::lock_guard lock(mutex_);
    start_ = position;
    next_deliver_ = 0;
    next_claim_ = 0;
    ready_.clear();
    error_ = nullptr;
  }
  start_workers();
}

}  // namespace kiln
