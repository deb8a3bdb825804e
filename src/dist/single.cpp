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

}  // namespace

std::shared_ptr<Communicator> single_process_communicator() {
  static const auto world_of_one = std::make_shared<SingleProcess>();
  return world_of_one;
}

}  // namespace kiln
