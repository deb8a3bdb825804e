#include <stdexcept>
#include <string>

#include "kiln/dist.h"

namespace kiln {
namespace {

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void barrier() override {}
  void all_reduce_sum(torch::Tensor&) override {}
  void broadcast(torch::Tensor&, int) override {}
  std::vector<std::string> all_gather_bytes(const std::string& mine) override { return {mine}; }
};

// A collective that already finished (the default all_reduce_sum_async runs it synchronously).
class Finished final : public PendingCollective {
 public:
  void wait() override {}
};

}  // namespace

std::unique_ptr<PendingCollective> Communicator::all_reduce_sum_async(torch::Tensor& tensor) {
  all_reduce_sum(tensor);
  return std::make_unique<Finished>();
}

std::unique_ptr<PendingCollective> Communicator::all_gather_async(const torch::Tensor& mine,
                                                                  torch::Tensor& output) {
  const int64_t n = mine.numel();
  if (output.numel() != n * world_size()) {
    throw std::invalid_argument("all_gather: the output must hold world_size x input elements");
  }
  torch::NoGradGuard no_grad;
  output.zero_();
  output.narrow(0, n * rank(), n).copy_(mine.reshape(-1));
  all_reduce_sum(output);
  return std::make_unique<Finished>();
}

std::unique_ptr<PendingCollective> Communicator::reduce_scatter_sum_async(
    const torch::Tensor& input, torch::Tensor& output) {
  const int64_t n = output.numel();
  if (input.numel() != n * world_size()) {
    throw std::invalid_argument(
        "reduce_scatter_sum: the input must hold world_size x output elements");
  }
  torch::NoGradGuard no_grad;
  torch::Tensor sum = input.reshape(-1).clone();
  all_reduce_sum(sum);
  output.view(-1).copy_(sum.narrow(0, n * rank(), n));
  return std::make_unique<Finished>();
}

std::shared_ptr<Communicator> Communicator::subgroup(const std::string& tag,
                                                     const std::vector<int>& ranks) {
  if (ranks.size() == 1 && ranks[0] == rank()) return single_process_communicator();
  throw std::logic_error("this communicator has no subgroups (asked for " + tag + " of " +
                         std::to_string(ranks.size()) + " ranks)");
}

std::shared_ptr<Communicator> single_process_communicator() {
  static const auto world_of_one = std::make_shared<SingleProcess>();
  return world_of_one;
}

}  // namespace kiln
