// The Communicator on a c10d process group: rendezvous through c10d's TCPStore, Gloo or NCCL
// collectives, failures turned into one-line CommunicationErrors, and traffic accounting.
#include <fmt/format.h>
#include <torch/cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "dist/backends.h"
#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;

double now_seconds() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

// c10d's messages span lines (and may carry a C++ stack): keep the first lines, joined.
std::string one_line(const std::string& text) {
  std::string out;
  size_t lines = 0, begin = 0;
  while (begin < text.size() && lines < 3) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (line.rfind("Exception raised from", 0) == 0 || line.rfind("frame #", 0) == 0) break;
    if (!out.empty()) out += " | ";
    out += line;
    ++lines;
  }
  if (out.size() > 500) out = out.substr(0, 497) + "...";
  return out;
}

std::string error_text(const std::exception& e) {
  if (auto* c10 = dynamic_cast<const c10::Error*>(&e))
    return one_line(c10->what_without_backtrace());
  return one_line(e.what());
}

// Time and traffic of the collectives; completion callbacks run on the backend's threads.
// Busy time is the length of the union of [start, end] intervals: for intervals taken in order
// of their start, each adds max(0, end - max(start, latest end so far)). Finished intervals wait
// until every collective that started before them has finished too.
class Ledger {
 public:
  // Returns the start time, the interval's key.
  double started(double bytes) {
    const double start = now_seconds();
    std::lock_guard lock(mutex_);
    ++totals_.collectives;
    totals_.bytes += bytes;
    in_flight_.insert(start);
    return start;
  }
  void finished(double start, double end, bool blocking) {
    std::lock_guard lock(mutex_);
    if (auto it = in_flight_.find(start); it != in_flight_.end()) in_flight_.erase(it);
    finished_.emplace_back(start, end);
    if (blocking) totals_.blocked_seconds += end - start;
    flush_locked();
  }
  void add_blocked(double seconds) {
    std::lock_guard lock(mutex_);
    totals_.blocked_seconds += seconds;
  }
  CommunicationStats snapshot() const {
    std::lock_guard lock(mutex_);
    return totals_;
  }

 private:
  void flush_locked() {
    const double limit =
        in_flight_.empty() ? std::numeric_limits<double>::infinity() : *in_flight_.begin();
    std::sort(finished_.begin(), finished_.end());
    size_t k = 0;
    for (; k < finished_.size() && finished_[k].first <= limit; ++k) {
      const auto [start, end] = finished_[k];
      totals_.busy_seconds += std::max(0.0, end - std::max(start, latest_end_));
      latest_end_ = std::max(latest_end_, end);
    }
    finished_.erase(finished_.begin(), finished_.begin() + static_cast<std::ptrdiff_t>(k));
  }

  mutable std::mutex mutex_;
  CommunicationStats totals_;
  std::multiset<double> in_flight_;
  std::vector<std::pair<double, double>> finished_;
  double latest_end_ = -std::numeric_limits<double>::infinity();
};

// One in-flight collective's end, recorded once: by the completion callback or by wait().
struct Completion {
  std::shared_ptr<Ledger> ledger;
  double start = 0;
  std::atomic<bool> recorded{false};
  void record(bool blocking) {
    if (!recorded.exchange(true)) ledger->finished(start, now_seconds(), blocking);
  }
};

class ProcessGroupCommunicator;

class PendingWork final : public PendingCollective {
 public:
  PendingWork(const ProcessGroupCommunicator* owner, std::string what,
              c10::intrusive_ptr<c10d::Work> work, std::shared_ptr<Completion> completion,
              std::vector<torch::Tensor> tensors)
      : owner_(owner),
        what_(std::move(what)),
        work_(std::move(work)),
        completion_(std::move(completion)),
        tensors_(std::move(tensors)) {}
  void wait() override;

 private:
  const ProcessGroupCommunicator* owner_;
  std::string what_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::shared_ptr<Completion> completion_;
  std::vector<torch::Tensor> tensors_;  // kept alive while in flight
};

class ProcessGroupCommunicator final : public Communicator {
 public:
  // The world's group (`group` empty: rank and size are the environment's) or a subgroup of it
  // over `group` (world ranks), named `tag` in messages, its traffic counted in the world's
  // ledger (`ledger`), so the world's stats() are every group's.
  ProcessGroupCommunicator(DistEnvironment env, c10::intrusive_ptr<c10d::Store> store,
                           c10::intrusive_ptr<c10d::Backend> backend, std::string backend_name,
                           torch::Device device, double timeout_seconds, std::string tag = "",
                           std::vector<int> group = {}, std::shared_ptr<Ledger> ledger = nullptr)
      : env_(std::move(env)),
        store_(std::move(store)),
        backend_(std::move(backend)),
        backend_name_(std::move(backend_name)),
        device_(device),
        timeout_seconds_(timeout_seconds),
        ledger_(ledger ? std::move(ledger) : std::make_shared<Ledger>()),
        tag_(std::move(tag)),
        group_(std::move(group)) {
    if (group_.empty()) {
      rank_ = env_.rank;
      size_ = env_.world_size;
    } else {
      rank_ = static_cast<int>(std::find(group_.begin(), group_.end(), env_.rank) - group_.begin());
      size_ = static_cast<int>(group_.size());
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  int local_rank() const override { return env_.local_rank; }
  int local_world_size() const override { return env_.local_world_size; }
  std::string backend_name() const override { return backend_name_; }
  CommunicationStats stats() const override { return ledger_->snapshot(); }

  void barrier() override {
    auto token = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
    run_blocking("barrier", token, [&] {
      std::vector<at::Tensor> tensors{token};
      return backend_->allreduce(tensors);
    });
  }

  void all_reduce_sum(torch::Tensor& tensor) override {
    torch::Tensor staged = stage(tensor);
    run_blocking("all-reduce", staged, [&] {
      std::vector<at::Tensor> tensors{staged};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      return backend_->allreduce(tensors, options);
    });
    if (!staged.is_same(tensor)) tensor.copy_(staged);
  }

  void broadcast(torch::Tensor& tensor, int root) override {
    if (root < 0 || root >= size_) {
      throw std::invalid_argument(
          fmt::format("broadcast root {} outside the group of {}", root, size_));
    }
    torch::Tensor staged = stage(tensor);
    run_blocking("broadcast", staged, [&] {
      std::vector<at::Tensor> tensors{staged};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      return backend_->broadcast(tensors, options);
    });
    if (!staged.is_same(tensor)) tensor.copy_(staged);
  }

  std::vector<std::string> all_gather_bytes(const std::string& mine) override {
    const auto on_device = torch::TensorOptions().device(device_);
    // Lengths first, then every message padded to the longest (all-gather needs equal sizes).
    auto length =
        torch::full({1}, static_cast<int64_t>(mine.size()), on_device.dtype(torch::kInt64));
    auto lengths = all_gather(length, "all-gather (lengths)").to(torch::kCPU);
    const int64_t longest = std::max<int64_t>(1, lengths.max().item<int64_t>());
    auto padded = torch::zeros({longest}, torch::kUInt8);
    std::copy(mine.begin(), mine.end(), padded.data_ptr<uint8_t>());
    auto gathered =
        all_gather(padded.to(device_), "all-gather (bytes)").to(torch::kCPU).contiguous();
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) {
      const auto* begin = gathered.data_ptr<uint8_t>() + r * longest;
      out.emplace_back(reinterpret_cast<const char*>(begin),
                       static_cast<size_t>(lengths[r].item<int64_t>()));
    }
    return out;
  }

  std::unique_ptr<PendingCollective> all_reduce_sum_async(torch::Tensor& tensor) override {
    require_on_device("all_reduce_sum_async", tensor);
    return start_async("bucket all-reduce", tensor, {tensor}, [&] {
      std::vector<at::Tensor> tensors{tensor};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      return backend_->allreduce(tensors, options);
    });
  }

  // c10d's all_gather_into_tensor (_allgather_base): Gloo implements it in torch >= 2.6.
  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& mine,
                                                      torch::Tensor& output) override {
    require_on_device("all_gather_async", mine);
    require_on_device("all_gather_async", output);
    if (output.numel() != mine.numel() * size_ || output.dtype() != mine.dtype()) {
      throw std::invalid_argument("all_gather_async: the output must hold world_size x input");
    }
    return start_async("all-gather", mine, {mine, output}, [&] {
      at::Tensor out = output.view(-1);
      at::Tensor in = mine.view(-1);
      return backend_->_allgather_base(out, in);
    });
  }

  // c10d's reduce_scatter_tensor (_reduce_scatter_base) with SUM: Gloo implements it in
  // torch >= 2.6 (no PREMUL_SUM: callers divide afterwards).
  std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& input,
                                                              torch::Tensor& output) override {
    require_on_device("reduce_scatter_sum_async", input);
    require_on_device("reduce_scatter_sum_async", output);
    if (input.numel() != output.numel() * size_ || output.dtype() != input.dtype()) {
      throw std::invalid_argument(
          "reduce_scatter_sum_async: the input must hold world_size x output");
    }
    return start_async("reduce-scatter", input, {input, output}, [&] {
      at::Tensor out = output.view(-1);
      at::Tensor in = input.view(-1);
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      return backend_->_reduce_scatter_base(out, in, options);
    });
  }

  [[noreturn]] void fail(const std::string& what, const std::exception& e) const {
    const std::string group =
        tag_.empty() ? "" : fmt::format(" in its {} group of {}", tag_, size_);
    throw CommunicationError(fmt::format(
        "rank {}/{}: {}{} failed: {} (a peer process died or hung, or the network failed; "
        "dist.timeout_seconds = {:g})",
        env_.rank, env_.world_size, what, group, error_text(e), timeout_seconds_));
  }

  // A c10d group of the same backend over `ranks`, its keys under its own prefix of the world's
  // store (this attempt's, the tag and the ranks), so the groups of one dimension and of different
  // dimensions never share keys. Kept until the process exits, as the world's group.
  std::shared_ptr<Communicator> subgroup(const std::string& tag,
                                         const std::vector<int>& ranks) override {
    const bool member = std::find(ranks.begin(), ranks.end(), env_.rank) != ranks.end();
    if (!member || !std::is_sorted(ranks.begin(), ranks.end()) ||
        std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() || ranks.front() < 0 ||
        ranks.back() >= env_.world_size || !group_.empty()) {
      throw std::invalid_argument(fmt::format(
          "subgroup {}: ranks must be distinct world ranks in ascending order, this rank's among "
          "them, asked of the world's group",
          tag));
    }
    if (ranks.size() == 1) return single_process_communicator();
    std::string listed;
    for (int r : ranks) listed.append(listed.empty() ? "" : ",").append(std::to_string(r));
    auto prefix = c10::make_intrusive<c10d::PrefixStore>(
        fmt::format("kiln/restart{}/{}/{}/{}", env_.restart_count, backend_name_, tag, listed),
        store_);
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(1000 * timeout_seconds_));
    const int index =
        static_cast<int>(std::find(ranks.begin(), ranks.end(), env_.rank) - ranks.begin());
    const int size = static_cast<int>(ranks.size());
    c10::intrusive_ptr<c10d::Backend> backend;
    try {
      backend = backend_name_ == "nccl"
                    ? dist::make_nccl_backend(prefix, index, size, timeout, device_.index())
                    : dist::make_gloo_backend(prefix, index, size, timeout);
    } catch (const std::exception& e) {
      fail(fmt::format("creating the {} group [{}]", tag, listed), e);
    }
    static std::mutex mutex;
    // Never destroyed, as the world's group (process_communicator): a Gloo destructor may block
    // on a dead peer until the timeout, and a failing process must exit at once.
    static auto* kept = new std::vector<std::shared_ptr<Communicator>>();
    auto comm = std::make_shared<ProcessGroupCommunicator>(
        env_, store_, backend, backend_name_, device_, timeout_seconds_, tag, ranks, ledger_);
    std::lock_guard lock(mutex);
    kept->push_back(comm);
    return comm;
  }

  void account_blocked(double seconds) const { ledger_->add_blocked(seconds); }

 private:
  void require_on_device(const char* what, const torch::Tensor& tensor) const {
    if (!tensor.is_contiguous() || tensor.device() != device_) {
      throw std::invalid_argument(
          fmt::format("{} needs contiguous tensors on {}", what, device_.str()));
    }
  }

  // Starts a collective whose bytes are `payload`'s and keeps `keep` alive until it finished.
  template <typename Start>
  std::unique_ptr<PendingCollective> start_async(const char* what, const torch::Tensor& payload,
                                                 std::vector<torch::Tensor> keep, Start start) {
    auto completion = std::make_shared<Completion>();
    completion->ledger = ledger_;
    completion->start = ledger_->started(static_cast<double>(payload.nbytes()));
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = start();
    } catch (const std::exception& e) {
      completion->record(false);
      fail(what, e);
    }
    // Gloo's _allgather_base / _reduce_scatter_base works have no future ("Work::getFuture not
    // implemented"): their end is then recorded by wait(), which adds the wait to busy time. So is
    // the end of a collective captured into a CUDA graph (a callback would run on a pool stream
    // that joins the capture): the ledger then counts the capture, not the replays.
    if (!dist::capturing_cuda_graph(device_)) {
      try {
        work->getFuture()->addCallback(
            [completion](c10::ivalue::Future&) { completion->record(false); });
      } catch (const c10::Error&) {
      }
    }
    return std::make_unique<PendingWork>(this, what, std::move(work), completion, std::move(keep));
  }

  // `tensor` itself when it is contiguous on the group's device, else a contiguous copy there.
  torch::Tensor stage(const torch::Tensor& tensor) const {
    if (tensor.device() == device_ && tensor.is_contiguous()) return tensor;
    return tensor.to(device_).contiguous();
  }

  torch::Tensor all_gather(const torch::Tensor& mine, const char* what) {
    std::vector<at::Tensor> outputs_for_one;
    for (int r = 0; r < size_; ++r) outputs_for_one.push_back(torch::empty_like(mine));
    std::vector<std::vector<at::Tensor>> outputs{outputs_for_one};
    run_blocking(what, mine, [&] {
      std::vector<at::Tensor> inputs{mine};
      return backend_->allgather(outputs, inputs);
    });
    return torch::cat(outputs[0]);
  }

  template <typename Start>
  void run_blocking(const char* what, const torch::Tensor& payload, Start start) {
    const double begin = ledger_->started(static_cast<double>(payload.nbytes()));
    try {
      c10::intrusive_ptr<c10d::Work> work = start();
      work->wait();
    } catch (const std::exception& e) {
      ledger_->finished(begin, now_seconds(), true);
      fail(what, e);
    }
    ledger_->finished(begin, now_seconds(), true);
  }

  DistEnvironment env_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::string backend_name_;
  torch::Device device_;
  double timeout_seconds_;
  std::shared_ptr<Ledger> ledger_;
  std::string tag_;         // the subgroup's mesh dimension; empty for the world's group
  std::vector<int> group_;  // the subgroup's world ranks; empty for the world's group
  int rank_ = 0, size_ = 1;
};

void PendingWork::wait() {
  if (!work_) return;
  const double begin = now_seconds();
  try {
    work_->wait();
  } catch (const std::exception& e) {
    completion_->record(false);
    work_.reset();
    owner_->fail(what_, e);
  }
  completion_->record(false);
  owner_->account_blocked(now_seconds() - begin);
  work_.reset();
  tensors_.clear();
}

std::string resolve_backend(const ProcessGroupOptions& options) {
  using Backend = ProcessGroupOptions::Backend;
  Backend backend = options.backend;
  if (backend == Backend::kAuto) {
    backend = resolve_device(options.device).is_cuda() ? Backend::kNccl : Backend::kGloo;
  }
  return std::string(to_string(backend));
}

std::shared_ptr<Communicator> connect(const DistEnvironment& env,
                                      const ProcessGroupOptions& options) {
  log::set_rank(env.rank, env.world_size);
  // A peer that dies closes its sockets; writing to them must fail with EPIPE (a c10d error we
  // report), not kill this process with SIGPIPE. Python ignores SIGPIPE for the same reason.
  std::signal(SIGPIPE, SIG_IGN);
  const double timeout_seconds = options.timeout_seconds;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(1000 * timeout_seconds));
  const std::string backend_name = resolve_backend(options);
  torch::Device device = torch::kCPU;
  if (backend_name == "nccl") {
    if (!dist::nccl_compiled()) dist::make_nccl_backend({}, 0, 0, timeout, 0);  // throws UserError
    if (!resolve_device(options.device).is_cuda()) {
      throw UserError(
          "dist.backend = \"nccl\" needs CUDA, but run.device resolves to cpu; set "
          "dist.backend = \"gloo\" (or \"auto\")");
    }
    const int devices = static_cast<int>(torch::cuda::device_count());
    device = torch::Device(torch::kCUDA,
                           static_cast<c10::DeviceIndex>(env.local_rank % std::max(1, devices)));
  }
  const std::string where = fmt::format("{}:{}", env.master_addr, env.master_port);
  auto rendezvous_error = [&](const std::string& step, const std::exception& e) {
    return CommunicationError(fmt::format(
        "rank {}/{}: {} failed: {}; check MASTER_ADDR/MASTER_PORT ({}) and that all {} ranks "
        "started (dist.timeout_seconds = {:g})",
        env.rank, env.world_size, step, error_text(e), where, env.world_size, timeout_seconds));
  };

  // Rendezvous: under torchrun the agent already hosts a TCPStore at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True) and every rank is a client; otherwise rank 0 hosts it.
  c10::intrusive_ptr<c10d::Store> store;
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  store_options.isServer = !env.agent_store && env.rank == 0;
  store_options.numWorkers = static_cast<size_t>(env.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = timeout;
  store_options.multiTenant = true;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    throw rendezvous_error("rendezvous at the TCPStore", e);
  }
  // Keys of this attempt only: a torchrun restart reuses the agent's store.
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(
      fmt::format("kiln/restart{}/{}", env.restart_count, backend_name), store);

  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = backend_name == "nccl"
                  ? dist::make_nccl_backend(group_store, env.rank, env.world_size, timeout,
                                            device.index())
                  : dist::make_gloo_backend(group_store, env.rank, env.world_size, timeout);
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    throw rendezvous_error("creating the " + backend_name + " process group", e);
  }
  auto comm = std::make_shared<ProcessGroupCommunicator>(env, store, backend, backend_name, device,
                                                         timeout_seconds);
  log::info(fmt::format(
      "process group: rank {} of {} (local {} of {}), {} via {}, store {} ({}), "
      "timeout {:g}s{}",
      env.rank, env.world_size, env.local_rank, env.local_world_size, backend_name, env.launcher,
      where, env.agent_store ? "torchrun agent" : "rank 0", timeout_seconds,
      env.restart_count > 0 ? fmt::format(", restart {}", env.restart_count) : ""));

  // Every rank must train the same job: compare the resolved configs' hashes.
  const std::vector<std::string> hashes = comm->all_gather_bytes(options.config_hash);
  if (std::adjacent_find(hashes.begin(), hashes.end(), std::not_equal_to<>()) != hashes.end()) {
    std::string listing;
    for (size_t r = 0; r < hashes.size(); ++r) {
      listing += fmt::format("{}rank {} {}", r ? ", " : "", r, hashes[r]);
    }
    throw UserError(fmt::format(
        "rank {}/{}: the ranks were started with different configs (config hashes: {}); start "
        "every rank with the same config file and --set overrides",
        env.rank, env.world_size, listing));
  }
  return comm;
}

}  // namespace

std::shared_ptr<Communicator> process_communicator(const Config& config) {
  static std::mutex mutex;
  // Created once and never destroyed: c10d's Gloo destructor joins worker threads that may be
  // blocked on a dead peer until the timeout, and a process that is failing must exit at once.
  static std::shared_ptr<Communicator>* process_group = nullptr;
  std::lock_guard lock(mutex);
  if (process_group) return *process_group;
  const ProcessGroupOptions options = ProcessGroupOptions::from_config(config);
  const DistEnvironment env =
      read_dist_environment(options, [](const char* name) { return std::getenv(name); });
  if (!env.process_group) return single_process_communicator();
  process_group = new std::shared_ptr<Communicator>(connect(env, options));
  return *process_group;
}

}  // namespace kiln
