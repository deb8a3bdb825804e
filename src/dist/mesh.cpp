// The device mesh (kiln/dist.h): a job's ranks as dp_replicate x dp_shard, a communicator per
// dimension built on Communicator::subgroup.
#include <fmt/format.h>

#include <numeric>

#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {

std::string MeshShape::text() const {
  return fmt::format("{} x {} (dp_replicate x dp_shard)", dp_replicate, dp_shard);
}

MeshShape fsdp_mesh_shape(int64_t dp_replicate, int world_size, int auto_replicas) {
  const int64_t replicas = dp_replicate == 0 ? auto_replicas : dp_replicate;
  if (replicas < 1 || world_size % replicas != 0) {
    std::string divisors;
    for (int d = 1; d <= world_size; ++d) {
      if (world_size % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
    }
    throw UserError(fmt::format(
        "dist.dp_replicate = {} does not divide the world of {} ranks: hybrid sharding needs "
        "dp_replicate x dp_shard = the world size; set dist.dp_replicate to one of {} (0 = auto)",
        replicas, world_size, divisors));
  }
  return {static_cast<int>(replicas), static_cast<int>(world_size / replicas)};
}

DeviceMesh build_device_mesh(std::shared_ptr<Communicator> world, const MeshShape& shape) {
  if (shape.size() != world->world_size()) {
    throw UserError(fmt::format(
        "the device mesh {} holds {} ranks but the world has {}; set dist.dp_replicate so that "
        "dp_replicate x dp_shard = {}",
        shape.text(), shape.size(), world->world_size(), world->world_size()));
  }
  DeviceMesh mesh;
  mesh.shape = shape;
  mesh.world = world;
  const int rank = world->rank();
  mesh.replica = rank / shape.dp_shard;
  mesh.shard_index = rank % shape.dp_shard;
  if (shape.dp_replicate == 1) {
    mesh.shard = world;
    return mesh;
  }
  // Every rank creates its dp_shard group, then its dp_replicate group: the same order on all.
  std::vector<int> shard_ranks(static_cast<size_t>(shape.dp_shard));
  std::iota(shard_ranks.begin(), shard_ranks.end(), mesh.replica * shape.dp_shard);
  mesh.shard = world->subgroup("dp_shard", shard_ranks);
  std::vector<int> replica_ranks;
  for (int r = 0; r < shape.dp_replicate; ++r)
    replica_ranks.push_back(r * shape.dp_shard + mesh.shard_index);
  mesh.replicate = world->subgroup("dp_replicate", replica_ranks);
  if (shape.dp_shard > world->local_world_size() && world->local_world_size() > 1) {
    log::info(fmt::format(
        "device mesh {}: a shard group of {} spans more than one node's {} ranks, so its "
        "all-gathers and reduce-scatters cross nodes",
        shape.text(), shape.dp_shard, world->local_world_size()));
  }
  return mesh;
}

}  // namespace kiln
