#include <ATen/ThreadLocalState.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "kiln/data.h"

namespace kiln {

struct Loader::Stream {
  LoaderPosition start;
  int64_t next_deliver = 0;  // stream index of the next batch next() returns
  int64_t next_claim = 0;    // stream index the next idle worker builds
  std::map<int64_t, Batch> ready;
  std::exception_ptr error;  // the failure of the lowest failed stream index, error_index:
  int64_t error_index = 0;   // next() raises it only there, after every batch before it
  bool stopping = false;
  mutable std::mutex mutex;
  std::condition_variable work_cv, ready_cv;
  std::vector<std::jthread> workers;
};

Loader::Loader(std::shared_ptr<const Dataset> dataset, LoaderOptions options)
    : dataset_(std::move(dataset)),
      options_(std::move(options)),
      sampler_(dataset_->size(), options_.batch_size, options_.rank, options_.world_size,
               options_.shuffle, options_.seed),
      stream_(std::make_unique<Stream>()) {
  if (options_.prefetch < 1) options_.prefetch = 1;
  start_workers();
}

Loader::~Loader() {
  stop_workers();
}

LoaderPosition Loader::position_of(int64_t stream_index) const {
  const int64_t per_epoch = sampler_.batches_per_epoch();
  const int64_t absolute = stream_->start.epoch * per_epoch + stream_->start.batch + stream_index;
  return {absolute / per_epoch, absolute % per_epoch};
}

LoaderPosition Loader::position() const {
  std::lock_guard lock(stream_->mutex);
  return position_of(stream_->next_deliver);
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
      std::unique_lock lock(stream_->mutex);
      stream_->work_cv.wait(lock, [&] {
        return stream_->stopping ||
               (stream_->next_claim < stream_->next_deliver + options_.prefetch &&
                (!stream_->error || stream_->next_claim < stream_->error_index));
      });
      if (stream_->stopping) return;
      index = stream_->next_claim++;
    }
    try {
      Batch batch = build(index);
      std::lock_guard lock(stream_->mutex);
      stream_->ready.emplace(index, std::move(batch));
    } catch (...) {
      std::lock_guard lock(stream_->mutex);
      if (!stream_->error || index < stream_->error_index) {
        stream_->error = std::current_exception();
        stream_->error_index = index;
      }
    }
    stream_->ready_cv.notify_all();
  }
}

void Loader::start_workers() {
  stream_->stopping = false;
  // Like at::launch: workers inherit the starting thread's thread-local state (profiler, modes).
  const at::ThreadLocalState state;
  for (int k = 0; k < options_.num_workers; ++k) {
    stream_->workers.emplace_back([this, state] {
      at::ThreadLocalStateGuard guard(state);
      worker_loop();
    });
  }
}

void Loader::stop_workers() {
  {
    std::lock_guard lock(stream_->mutex);
    stream_->stopping = true;
  }
  stream_->work_cv.notify_all();
  stream_->workers.clear();  // jthreads: each joins as it is destroyed
}

Batch Loader::next() {
  Batch batch;
  if (options_.num_workers == 0) {
    int64_t index;
    {
      std::lock_guard lock(stream_->mutex);
      index = stream_->next_deliver;
    }
    batch = build(index);
    std::lock_guard lock(stream_->mutex);
    ++stream_->next_deliver;
    stream_->next_claim = stream_->next_deliver;
  } else {
    std::unique_lock lock(stream_->mutex);
    // A failure is raised at its own place in the stream, so what a run sees before it does not
    // depend on the worker count.
    stream_->ready_cv.wait(lock, [&] {
      return stream_->ready.count(stream_->next_deliver) ||
             (stream_->error && stream_->error_index == stream_->next_deliver);
    });
    auto it = stream_->ready.find(stream_->next_deliver);
    if (it == stream_->ready.end()) std::rethrow_exception(stream_->error);
    batch = std::move(it->second);
    stream_->ready.erase(it);
    ++stream_->next_deliver;
    lock.unlock();
    stream_->work_cv.notify_all();
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
  if (stream_->workers.empty()) start_workers();
}

void Loader::seek(LoaderPosition position) {
  stop_workers();
  {
    std::lock_guard lock(stream_->mutex);
    stream_->start = position;
    stream_->next_deliver = 0;
    stream_->next_claim = 0;
    stream_->ready.clear();
    stream_->error = nullptr;
  }
  start_workers();
}

}  // namespace kiln
