// An in-process Communicator for tests: each thread is a rank. Collectives rendezvous through a
// shared group; when a rank fails (throws), the group is poisoned and every rank blocked in or
// entering a collective throws too, so a failing test never hangs.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kiln/dist.h"

namespace kiln::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world_size)
      : world_size_(world_size), slots_(static_cast<size_t>(world_size)) {}

  int world_size() const { return world_size_; }

  /// Every rank's `mine`, by rank. Blocks until all ranks called it (the same generation).
  std::vector<std::string> exchange(int rank, const std::string& mine) {
    std::unique_lock lock(mutex_);
    const uint64_t generation = generation_;
    throw_if_broken();
    slots_[static_cast<size_t>(rank)] = mine;
    if (++arrived_ == world_size_) {
      result_ = slots_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return result_;
    }
    cv_.wait(lock, [&] { return generation_ != generation || broken_; });
    if (generation_ == generation) throw_if_broken();
    return result_;
  }

  void poison() {
    std::vector<std::shared_ptr<ThreadGroup>> children;
    {
      std::lock_guard lock(mutex_);
      broken_ = true;
      cv_.notify_all();
      for (auto& [key, child] : children_) children.push_back(child);
    }
    for (auto& child : children) child->poison();
  }

  /// The subgroup named `key` (its ranks' threads all ask for the same key), `size` ranks;
  /// poisoned with this group.
  std::shared_ptr<ThreadGroup> child(const std::string& key, int size) {
    std::lock_guard lock(mutex_);
    auto& slot = children_[key];
    if (!slot) slot = std::make_shared<ThreadGroup>(size);
    if (broken_) slot->poison();
    return slot;
  }

  int64_t collectives() const {
    std::lock_guard lock(mutex_);
    return static_cast<int64_t>(generation_);
  }

 private:
  void throw_if_broken() const {
    if (broken_) throw std::runtime_error("thread group: another rank failed");
  }
  const int world_size_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::string> slots_, result_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool broken_ = false;
  std::map<std::string, std::shared_ptr<ThreadGroup>> children_;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }
  int local_world_size() const override { return group_->world_size(); }  // one process: one node
  void barrier() override { group_->exchange(rank_, ""); }
  void all_reduce_sum(torch::Tensor& tensor) override {
    auto all = gather_tensor(tensor);
    torch::Tensor sum = all[0].clone();
    for (size_t r = 1; r < all.size(); ++r) sum += all[r];
    tensor.copy_(sum);
  }
  void broadcast(torch::Tensor& tensor, int root) override {
    tensor.copy_(gather_tensor(tensor)[static_cast<size_t>(root)]);
  }
  std::vector<std::string> all_gather_bytes(const std::string& mine) override {
    return group_->exchange(rank_, mine);
  }
  // A group of threads over `ranks` (of this group), as Communicator::subgroup.
  std::shared_ptr<Communicator> subgroup(const std::string& tag,
                                         const std::vector<int>& ranks) override {
    if (ranks.size() == 1) return single_process_communicator();
    std::string key = tag;
    for (int r : ranks) key.append("/").append(std::to_string(r));
    const auto index = std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin();
    if (index == static_cast<std::ptrdiff_t>(ranks.size()))
      throw std::invalid_argument("subgroup: this rank is not among the ranks");
    return std::make_shared<ThreadCommunicator>(group_->child(key, static_cast<int>(ranks.size())),
                                                static_cast<int>(index));
  }
  // FSDP's collectives, finished on return (the interface's async form allows that).
  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& mine,
                                                      torch::Tensor& output) override {
    if (output.numel() != mine.numel() * world_size())
      throw std::invalid_argument("all_gather: output must hold world_size x input");
    torch::NoGradGuard no_grad;
    output.view(-1).copy_(torch::cat(gather_tensor(mine.reshape(-1))));
    return std::make_unique<Done>();
  }
  std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& input,
                                                              torch::Tensor& output) override {
    const int64_t n = output.numel();
    if (input.numel() != n * world_size())
      throw std::invalid_argument("reduce_scatter_sum: input must hold world_size x output");
    torch::NoGradGuard no_grad;
    auto all = gather_tensor(input.reshape(-1));
    torch::Tensor sum = all[0].narrow(0, n * rank_, n).clone();
    for (size_t r = 1; r < all.size(); ++r) sum += all[r].narrow(0, n * rank_, n);
    output.view(-1).copy_(sum);
    return std::make_unique<Done>();
  }

 private:
  struct Done final : PendingCollective {
    void wait() override {}
  };
  std::vector<torch::Tensor> gather_tensor(const torch::Tensor& tensor) {
    auto cpu = tensor.detach().to(torch::kCPU).contiguous();
    std::string bytes(static_cast<const char*>(cpu.data_ptr()), cpu.nbytes());
    std::vector<torch::Tensor> out;
    for (auto& b : group_->exchange(rank_, bytes)) {
      auto t = torch::empty_like(cpu);
      std::memcpy(t.data_ptr(), b.data(), b.size());
      out.push_back(t);
    }
    return out;
  }
  std::shared_ptr<ThreadGroup> group_;
  int rank_;
};

/// Runs fn(comm) on `world_size` threads, one per rank, and rethrows the first rank's exception.
inline void run_ranks(int world_size, const std::function<void(Communicator&)>& fn) {
  auto group = std::make_shared<ThreadGroup>(world_size);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::atomic<int> first_failed{-1};
  std::vector<std::thread> threads;
  // The caller's intra-op thread count, set in each rank thread before its first kernel: ATen
  // applies at::set_num_threads to a new thread only when one of its kernels first asks for the
  // count, and until then MKL runs a matmul with its own default team (measured: a fresh thread's
  // first at::mm used 2 threads after the process set 1).
  const int intra_op_threads = at::get_num_threads();
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      at::set_num_threads(intra_op_threads);
      ThreadCommunicator comm(group, r);
      try {
        fn(comm);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        int none = -1;
        first_failed.compare_exchange_strong(none, r);
        group->poison();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first_failed >= 0) std::rethrow_exception(errors[static_cast<size_t>(first_failed.load())]);
}

}  // namespace kiln::testing
