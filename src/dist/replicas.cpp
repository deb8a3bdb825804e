#include "dist/replicas.h"

#include <fmt/format.h>

#include <map>
#include <utility>
#include <vector>

namespace kiln::dist {

std::string replicate_rank0(Communicator& comm, Model& model) {
  if (comm.world_size() > 1) {
    torch::NoGradGuard no_grad;
    std::map<std::pair<c10::ScalarType, std::string>, std::vector<torch::Tensor>> groups;
    for (const auto& t : model.parameters())
      groups[{t.scalar_type(), t.device().str()}].push_back(t);
    for (const auto& t : model.buffers()) groups[{t.scalar_type(), t.device().str()}].push_back(t);
    for (auto& [key, group] : groups) {
      std::vector<torch::Tensor> flat_parts;
      for (const auto& t : group) flat_parts.push_back(t.reshape(-1));
      torch::Tensor flat = torch::cat(flat_parts);
      comm.broadcast(flat, 0);
      int64_t offset = 0;
      for (auto& t : group) {
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }
  // Confirm: every rank now holds the same weights.
  const std::string hash = weights_hash(model);
  const std::vector<std::string> hashes = comm.all_gather_bytes(hash);
  for (size_t r = 0; r < hashes.size(); ++r) {
    if (hashes[r] != hashes[0]) {
      throw CommunicationError(fmt::format(
          "rank {}/{}: model weights differ after the initial broadcast (rank 0 {}, rank {} {})",
          comm.rank(), comm.world_size(), hashes[0], r, hashes[r]));
    }
  }
  return hash;
}

}  // namespace kiln::dist
