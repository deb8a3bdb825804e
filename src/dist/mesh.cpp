// The device mesh (kiln/dist.h): a job's ranks as dp_replicate x dp_shard x tp, a communicator
// per dimension built on Communicator::subgroup.
#include <fmt/format.h>

#include <numeric>

#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace {

std::string divisors_of(int n) {
  std::string out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out.append(out.empty() ? "" : ", ").append(std::to_string(d));
  }
  return out;
}

int check_tp(int64_t tp, int world_size) {
  if (tp < 1 || world_size % tp != 0) {
    throw UserError(fmt::format(
        "dist.tp = {} does not divide the world of {} ranks: each layer is split over tp "
        "consecutive ranks; set dist.tp to one of {}",
        tp, world_size, divisors_of(world_size)));
  }
  return static_cast<int>(tp);
}

}  // namespace

std::string MeshShape::text() const {
  if (tp > 1) {
    return fmt::format("{} x {} x {} (dp_replicate x dp_shard x tp)", dp_replicate, dp_shard, tp);
  }
  return fmt::format("{} x {} (dp_replicate x dp_shard)", dp_replicate, dp_shard);
}

MeshShape fsdp_mesh_shape(int64_t dp_replicate, int world_size, int auto_replicas, int64_t tp) {
  const int slices = check_tp(tp, world_size);
  const int dp = world_size / slices;
  const int64_t replicas = dp_replicate == 0 ? auto_replicas : dp_replicate;
  if (replicas < 1 || dp % replicas != 0) {
    throw UserError(fmt::format(
        "dist.dp_replicate = {} does not divide the world of {} ranks{}: hybrid sharding needs "
        "dp_replicate x dp_shard{} = the world size; set dist.dp_replicate to one of {} (0 = "
        "auto)",
        replicas, world_size,
        slices > 1 ? fmt::format(" over dist.tp = {} ({} data-parallel ranks)", slices, dp) : "",
        slices > 1 ? " x tp" : "", divisors_of(dp)));
  }
  return {static_cast<int>(replicas), static_cast<int>(dp / replicas), slices};
}

MeshShape ddp_mesh_shape(int world_size, int64_t tp) {
  const int slices = check_tp(tp, world_size);
  return {world_size / slices, 1, slices};
}

DeviceMesh build_device_mesh(std::shared_ptr<Communicator> world, const MeshShape& shape) {
  if (shape.size() != world->world_size()) {
    throw UserError(fmt::format(
        "the device mesh {} holds {} ranks but the world has {}; set dist.dp_replicate and "
        "dist.tp so that dp_replicate x dp_shard x tp = {}",
        shape.text(), shape.size(), world->world_size(), world->world_size()));
  }
  DeviceMesh mesh;
  mesh.shape = shape;
  mesh.world = world;
  const int rank = world->rank();
  const int dp_index = rank / shape.tp;
  mesh.tp_index = rank % shape.tp;
  mesh.replica = dp_index / shape.dp_shard;
  mesh.shard_index = dp_index % shape.dp_shard;
  // The groups of a dimension, each rank asking for its own, in one order on every rank.
  auto group = [&](const char* tag, int size, const std::function<int(int)>& member) {
    if (size == world->world_size()) return world;
    std::vector<int> ranks(static_cast<size_t>(size));
    for (int k = 0; k < size; ++k) ranks[static_cast<size_t>(k)] = member(k);
    return world->subgroup(tag, ranks);
  };
  auto rank_of = [&](int replica, int shard, int t) {
    return (replica * shape.dp_shard + shard) * shape.tp + t;
  };
  if (shape.tp > 1) {
    mesh.tp =
        group("tp", shape.tp, [&](int t) { return rank_of(mesh.replica, mesh.shard_index, t); });
  }
  mesh.dp = group("dp", shape.dp_size(), [&](int d) {
    return rank_of(d / shape.dp_shard, d % shape.dp_shard, mesh.tp_index);
  });
  mesh.shard = shape.dp_replicate == 1 ? mesh.dp : group("dp_shard", shape.dp_shard, [&](int s) {
    return rank_of(mesh.replica, s, mesh.tp_index);
  });
  if (shape.dp_replicate > 1) {
    mesh.replicate =
        shape.dp_shard == 1 ? mesh.dp : group("dp_replicate", shape.dp_replicate, [&](int r) {
          return rank_of(r, mesh.shard_index, mesh.tp_index);
        });
  }
  const int local = world->local_world_size();
  if (local > 1 && shape.tp == 1 && shape.dp_replicate > 1 && shape.dp_shard > local) {
    log::info(fmt::format(
        "device mesh {}: a shard group of {} spans more than one node's {} ranks, so its "
        "all-gathers and reduce-scatters cross nodes",
        shape.text(), shape.dp_shard, local));
  }
  return mesh;
}

}  // namespace kiln
