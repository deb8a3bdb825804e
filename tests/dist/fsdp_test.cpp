// FSDP (kiln/dist.h FullyShardedDataParallel) with ranks as threads of this process
// (tests/ckpt/thread_comm.h): shard layouts, the sharding collectives, equivalence with one
// process at world 2 and 3 (mlp and a small gpt, uneven sizes), gradient accumulation in both
// modes, ZeRO-2 / ZeRO-3, and that the full parameters really release their storage.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "ckpt/thread_comm.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/plan.h"
#include "kiln/session.h"
#include "support/compose.h"
#include "support/helpers.h"

namespace kiln::testing::fsdp_test {  // its own: dist_test.cpp has a RunResult too (unity)
namespace {

TEST(ShardLayout, PadsUnevenDimZeroAcrossRanks) {
  ShardLayout l = shard_layout("w", {10, 3}, 3);
  EXPECT_EQ(l.rows, 10);
  EXPECT_EQ(l.rows_per_rank, 4);
  EXPECT_EQ(l.row_numel, 3);
  EXPECT_EQ(l.valid_rows(0), 4);
  EXPECT_EQ(l.valid_rows(1), 4);
  EXPECT_EQ(l.valid_rows(2), 2);
  EXPECT_EQ(l.shard_shape(), (std::vector<int64_t>{4, 3}));
  // More ranks than rows: the last ranks hold padding only.
  ShardLayout small = shard_layout("b", {2}, 3);
  EXPECT_EQ(small.rows_per_rank, 1);
  EXPECT_EQ(small.valid_rows(2), 0);
  EXPECT_EQ(small.shard_shape(), (std::vector<int64_t>{1}));
  ShardLayout scalar = shard_layout("s", {}, 2);
  EXPECT_EQ(scalar.rows, 1);
  EXPECT_EQ(scalar.valid_rows(1), 0);
}

TEST(ShardingCollectives, AllGatherAndReduceScatterAtWorldThree) {
  run_ranks(3, [](Communicator& comm) {
    const int r = comm.rank();
    torch::Tensor mine = torch::full({2}, static_cast<float>(r + 1));
    torch::Tensor gathered = torch::empty({6});
    comm.all_gather(mine, gathered);
    EXPECT_TRUE(torch::equal(gathered, torch::tensor({1.f, 1.f, 2.f, 2.f, 3.f, 3.f})));
    torch::Tensor input = torch::arange(6, torch::kFloat) * static_cast<float>(r + 1);
    torch::Tensor out = torch::empty({2});
    comm.reduce_scatter_sum(input, out);
    // Sum over ranks of (r + 1) x [2r', 2r' + 1] for this rank r' = 6 x the chunk.
    EXPECT_TRUE(torch::equal(out, torch::arange(2 * r, 2 * r + 2, torch::kFloat) * 6));
  });
  // The interface's defaults (all-reduce based) in a world of one.
  auto one = single_process_communicator();
  torch::Tensor x = torch::arange(3, torch::kFloat), y = torch::empty({3});
  one->all_gather(x, y);
  EXPECT_TRUE(torch::equal(x, y));
  one->reduce_scatter_sum(x, y);
  EXPECT_TRUE(torch::equal(x, y));
}

struct RunResult {
  std::vector<double> losses;
  NamedTensors parameters;
  int64_t all_gathers = 0, reduce_scatters = 0, replica_all_reduces = 0;
  size_t groups = 0;
  FsdpMemory memory;
  bool storage_released = true;  // every full parameter held 0 bytes after every step
  bool shards_fp32 = true;       // every shard and its gradient fp32 after every step
  nlohmann::json grad_scaler;    // TrainState::grad_scaler after the last step
};

RunResult train_single(const Config& config, int64_t steps) {
  apply_runtime_settings(config);
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  install_configured_checkpointing(trainer);
  RunResult out;
  for (int64_t k = 0; k < steps; ++k) out.losses.push_back(trainer.train_step().loss);
  for (const auto& item : trainer.model().named_parameters())
    out.parameters.emplace_back(item.key(), item.value().detach().clone());
  out.grad_scaler = trainer.state().grad_scaler;
  return out;
}

// The mesh a rank attaches FSDP over (null: 1-D over every rank).
using MeshOf = std::function<DeviceMesh(std::shared_ptr<Communicator>)>;

// `world` ranks as threads, each with FSDP attached; the other ranks' models start from another
// seed, so the initial broadcast is what makes them equal.
std::vector<RunResult> train_fsdp(const Config& config, int world, int64_t steps,
                                  FsdpOptions options = {}, const MeshOf& mesh_of = nullptr) {
  std::vector<RunResult> results(static_cast<size_t>(world));
  apply_runtime_settings(config);
  run_ranks(world, [&](Communicator& borrowed) {
    const int rank = borrowed.rank();
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    Config model_config = config;
    if (rank > 0) model_config.set("run.seed", int64_t{777 + rank});
    Trainer trainer(TrainerSetup::from_config(config), make_model(model_config),
                    make_datasets(config), TrainerOptions{torch::kCPU, rank, world, comm});
    install_configured_checkpointing(trainer);
    auto fsdp = mesh_of ? FullyShardedDataParallel::attach(trainer, mesh_of(comm), options)
                        : FullyShardedDataParallel::attach(trainer, comm, options);
    RunResult& out = results[static_cast<size_t>(rank)];
    for (int64_t k = 0; k < steps; ++k) {
      out.losses.push_back(trainer.train_step().loss);
      for (const auto& p : trainer.model().parameters()) {
        if (p.unsafeGetTensorImpl()->storage().nbytes() != 0) out.storage_released = false;
      }
      for (const auto& [name, shard] : fsdp->shards()) {
        if (shard.scalar_type() != torch::kFloat || shard.grad().scalar_type() != torch::kFloat)
          out.shards_fp32 = false;
      }
    }
    out.grad_scaler = trainer.state().grad_scaler;
    out.parameters = fsdp->full_parameters();
    out.all_gathers = fsdp->all_gathers();
    out.reduce_scatters = fsdp->reduce_scatters();
    out.replica_all_reduces = fsdp->replica_all_reduces();
    out.groups = fsdp->group_names().size();
    out.memory = fsdp->memory();
  });
  return results;
}

double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

void expect_equivalent(const RunResult& single, const RunResult& rank, double tolerance) {
  ASSERT_EQ(single.losses.size(), rank.losses.size());
  for (size_t k = 0; k < single.losses.size(); ++k) {
    EXPECT_NEAR(rank.losses[k], single.losses[k], tolerance * std::abs(single.losses[k]))
        << "step " << k + 1;
  }
  ASSERT_EQ(single.parameters.size(), rank.parameters.size());
  for (size_t k = 0; k < single.parameters.size(); ++k) {
    EXPECT_EQ(rank.parameters[k].first, single.parameters[k].first);
    ASSERT_EQ(rank.parameters[k].second.sizes(), single.parameters[k].second.sizes());
    EXPECT_LE(relative_difference(rank.parameters[k].second, single.parameters[k].second),
              tolerance)
        << single.parameters[k].first;
  }
}

void expect_replicas_agree(const std::vector<RunResult>& ranks) {
  for (size_t r = 1; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].losses, ranks[0].losses) << "rank " << r;
    for (size_t k = 0; k < ranks[0].parameters.size(); ++k) {
      EXPECT_TRUE(torch::equal(ranks[r].parameters[k].second, ranks[0].parameters[k].second))
          << "rank " << r << " " << ranks[0].parameters[k].first;
    }
  }
}

TEST(Fsdp, MlpAtWorldTwoAndThreeMatchesOneProcess) {
  TempDir dir;
  // AdamW with clipping: the optimizer steps shards, the clip uses the norm summed over ranks.
  const std::vector<std::string> common = {"data.num_workers=0", "train.clip_grad_norm=0.5",
                                           "model.num_classes=10"};
  auto with = [&](int64_t batch) {
    auto extra = common;
    extra.push_back("train.batch_size=" + std::to_string(batch));
    return mlp_config(dir.path(), extra);
  };
  const RunResult single = train_single(with(24), 20);
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    auto ranks = train_fsdp(with(24 / world), world, 20);
    expect_equivalent(single, ranks[0], 1e-5);
    expect_replicas_agree(ranks);
    EXPECT_EQ(ranks[0].groups, 2u);  // fc1, fc2: the mlp has no root group
    EXPECT_EQ(ranks[0].reduce_scatters, 20 * 2);
    EXPECT_TRUE(ranks[0].storage_released);
  }
}

// SGD with momentum and clipping on the gpt, as DataParallel's tests: AdamW divides each
// gradient element by its own running magnitude, so for elements whose gradient is a cancelling
// sum fp32 summation-order noise becomes a visible parameter difference (1e-4 relative after 20
// steps at equal losses; docs/scale.md, "How close is 2 x B/2 to 1 x B?").
// One intra-op thread: the ranks are threads of one process, and with 2 intra-op threads each
// the world-3 gpt run once ended 4-7e-5 from one process's parameters (1e-5 allowed; one CI run of
// five, passing on rerun). The suspect is a BLAS picking its thread count per call while the other
// ranks' calls run; with one thread every matmul sums in one order.
const std::vector<std::string> kGptSgd = {
    "data.num_workers=0", "optim.name=sgd",           "optim.lr=0.3",
    "optim.momentum=0.9", "train.clip_grad_norm=0.5", "run.threads=1"};

Config small_gpt(const std::filesystem::path& dir, int64_t batch,
                 std::vector<std::string> extra = {}) {
  extra.insert(extra.end(), kGptSgd.begin(), kGptSgd.end());
  extra.push_back(fmt::format("train.batch_size={}", batch));
  return gpt_config(dir, extra);
}

TEST(Fsdp, GptAtWorldThreeMatchesOneProcess) {
  // gpt's wte [256, 32] and layer norms [32] split unevenly over 3 ranks; the tied head makes
  // wte's gradient come from two uses. Groups: 4 blocks and the root.
  TempDir dir;
  const std::vector<std::string> shape = {"model.n_layer=4", "model.n_embd=32", "data.seq_len=16"};
  const RunResult single = train_single(small_gpt(dir.path(), 6, shape), 20);
  auto ranks = train_fsdp(small_gpt(dir.path(), 2, shape), 3, 20);
  expect_equivalent(single, ranks[0], 1e-5);
  expect_replicas_agree(ranks);
  EXPECT_EQ(ranks[0].groups, 5u);
  // Per step: the root and unit 0 at the micro-step's start, units 1-3 prefetched in forward,
  // the 4 units again in backward (ZeRO-3); then full_parameters() gathers each group once.
  EXPECT_EQ(ranks[0].all_gathers, 20 * 9 + 5);
  EXPECT_EQ(ranks[0].reduce_scatters, 20 * 5);
  EXPECT_TRUE(ranks[0].storage_released);
  // Shards: about a third of the parameters each (padding included).
  int64_t full_bytes = 0, root_bytes = 0, block_bytes = 0;
  for (const auto& [name, p] : single.parameters) {
    full_bytes += static_cast<int64_t>(p.nbytes());
    (name.starts_with("transformer.h.") ? block_bytes : root_bytes) +=
        static_cast<int64_t>(p.nbytes());
  }
  block_bytes /= 4;
  EXPECT_LE(ranks[0].memory.parameter_shards, full_bytes / 3 + 4096);
  EXPECT_GE(ranks[0].memory.parameter_shards, full_bytes / 3);
  // Gathered at once: the root, two blocks and one block's all-gather buffer in flight at most
  // (prefetch), never the whole model.
  EXPECT_GT(ranks[0].memory.gathered_peak, root_bytes);
  EXPECT_LE(ranks[0].memory.gathered_peak, root_bytes + 3 * block_bytes + 4096);
  EXPECT_LT(ranks[0].memory.gathered_peak, full_bytes);
}

// Hybrid sharding, 2 replicas x 2 shards at world 4, against one process of the same global
// batch: the same tolerance as FSDP (fp32 summation order; seen: within 1e-5 relative).
TEST(Hsdp, TwoReplicasOfTwoShardsMatchOneProcess) {
  TempDir dir;
  const std::vector<std::string> shape = {"model.n_layer=4", "model.n_embd=32", "data.seq_len=16"};
  const RunResult single = train_single(small_gpt(dir.path(), 8, shape), 12);
  const MeshOf two_by_two = [](std::shared_ptr<Communicator> world) {
    return build_device_mesh(std::move(world), {2, 2});
  };
  auto ranks = train_fsdp(small_gpt(dir.path(), 2, shape), 4, 12, {}, two_by_two);
  expect_equivalent(single, ranks[0], 1e-5);
  expect_replicas_agree(ranks);
  EXPECT_EQ(ranks[0].groups, 5u);
  EXPECT_EQ(ranks[0].reduce_scatters, 12 * 5);      // inside the shard group
  EXPECT_EQ(ranks[0].replica_all_reduces, 12 * 5);  // each shard across the replicas
  // Each rank holds half of the state (the shard group's size), not a quarter.
  int64_t full_bytes = 0;
  for (const auto& [name, p] : single.parameters) full_bytes += static_cast<int64_t>(p.nbytes());
  EXPECT_GE(ranks[0].memory.parameter_shards, full_bytes / 2);
  EXPECT_LE(ranks[0].memory.parameter_shards, full_bytes / 2 + 4096);

  // Negative control: the replicas never all-reduce (a one-rank replicate communicator), so
  // each replica steps with half the batch's gradient and they drift apart.
  const MeshOf no_replica_reduce = [](std::shared_ptr<Communicator> world) {
    DeviceMesh mesh = build_device_mesh(std::move(world), {2, 2});
    mesh.replicate = single_process_communicator();
    return mesh;
  };
  auto broken = train_fsdp(small_gpt(dir.path(), 2, shape), 4, 12, {}, no_replica_reduce);
  double worst = 0;
  for (size_t k = 0; k < single.parameters.size(); ++k) {
    worst = std::max(
        worst, relative_difference(broken[2].parameters[k].second, single.parameters[k].second));
  }
  EXPECT_GT(worst, 1e-3) << "the replicas' all-reduce is what makes HSDP equal one process";
}

TEST(Hsdp, MeshShapesAndRefusals) {
  EXPECT_EQ(fsdp_mesh_shape(0, 8, 2).dp_shard, 4);   // auto: the plan's replicas
  EXPECT_EQ(fsdp_mesh_shape(1, 8, 2).dp_shard, 8);   // 1: over every rank
  EXPECT_EQ(fsdp_mesh_shape(4, 8).dp_replicate, 4);  // explicit
  try {
    fsdp_mesh_shape(3, 4);
    FAIL() << "3 replicas of a world of 4 was accepted";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("dist.dp_replicate = 3 does not divide the world "
                                               "of 4 ranks"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("one of 1, 2, 4"));
  }
  run_ranks(2, [](Communicator& borrowed) {
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    EXPECT_THROW(build_device_mesh(comm, {2, 2}), UserError);  // 4 ranks asked of 2
    const DeviceMesh mesh = build_device_mesh(comm, {2, 1});   // DDP-like: shards of one rank
    EXPECT_EQ(mesh.shard->world_size(), 1);
    EXPECT_EQ(mesh.replicate->world_size(), 2);
    EXPECT_EQ(mesh.replica, borrowed.rank());
  });
}

TEST(Fsdp, AccumulationUnshardedCommunicatesOnTheLastMicroStepOnly) {
  TempDir dir;
  const std::vector<std::string> accumulate = {"train.grad_accum_steps=2", "data.seq_len=16"};
  const RunResult single = train_single(small_gpt(dir.path(), 8, accumulate), 6);
  FsdpOptions unsharded;
  auto ranks = train_fsdp(small_gpt(dir.path(), 4, accumulate), 2, 6, unsharded);
  expect_equivalent(single, ranks[0], 1e-5);
  EXPECT_EQ(ranks[0].reduce_scatters, 6 * 3);  // once per group per step
  FsdpOptions sharded;
  sharded.accumulate_sharded = true;
  auto every = train_fsdp(small_gpt(dir.path(), 4, accumulate), 2, 6, sharded);
  expect_equivalent(single, every[0], 1e-5);
  EXPECT_EQ(every[0].reduce_scatters, 6 * 2 * 3);  // once per group per micro-step
  expect_replicas_agree(every);
}

TEST(Fsdp, KeepingUnitsGatheredUntilBackwardTrainsTheSame) {
  TempDir dir;
  const RunResult single = train_single(small_gpt(dir.path(), 4, {"data.seq_len=16"}), 4);
  FsdpOptions zero2;
  zero2.reshard_after_forward = false;
  zero2.prefetch = false;
  auto ranks = train_fsdp(small_gpt(dir.path(), 2, {"data.seq_len=16"}), 2, 4, zero2);
  expect_equivalent(single, ranks[0], 1e-5);
  // Each group once per step (no regather in backward), then once for full_parameters().
  EXPECT_EQ(ranks[0].all_gathers, 4 * 3 + 3);
  EXPECT_TRUE(ranks[0].storage_released);
}

// bf16-mixed: the shards, their gradients and the optimizer stay fp32; the all-gather sends bf16
// copies and the units compute with bf16 parameters (FSDP2's MixedPrecisionPolicy(param_dtype =
// bf16, reduce_dtype = fp32)). One process under bf16-mixed keeps fp32 parameters and lets
// autocast cast them per matmul, so the two round differently (FSDP's embeddings, norms and
// residual stream are bf16 too); 2e-2 relative is the precision tests' bf16 tolerance (bf16 has
// 8 bits of mantissa: ~4e-3 per rounding), far below the ~5e-1 the losses fall over the run.
TEST(Fsdp, Bf16MixedGathersBf16AndMatchesOneProcessBf16) {
  TempDir dir;
  const std::vector<std::string> bf16 = {"train.precision=bf16-mixed", "data.seq_len=16"};
  const Config one = small_gpt(dir.path(), 4, bf16);
  const RunResult single = train_single(one, 8);
  const Config config = small_gpt(dir.path(), 2, bf16);
  const FsdpOptions options = fsdp_options(config);
  ASSERT_EQ(options.param_dtype, torch::kBFloat16);
  auto ranks = train_fsdp(config, 2, 8, options);
  expect_equivalent(single, ranks[0], 2e-2);
  expect_replicas_agree(ranks);
  EXPECT_TRUE(ranks[0].shards_fp32);
  EXPECT_TRUE(ranks[0].storage_released);
  for (const auto& [name, p] : ranks[0].parameters) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  // The gathered units are bf16: half the bytes of the fp32 block.
  int64_t block_bytes = 0;
  for (const auto& [name, p] : single.parameters) {
    if (name.starts_with("transformer.h.0.")) block_bytes += static_cast<int64_t>(p.nbytes());
  }
  EXPECT_EQ(ranks[0].memory.largest_unit * 2, block_bytes);
  // And it is not fp32 FSDP: the same run without the bf16 gather differs.
  FsdpOptions fp32_gather = options;
  fp32_gather.param_dtype.reset();
  auto autocast_only = train_fsdp(config, 2, 8, fp32_gather);
  EXPECT_NE(autocast_only[0].losses, ranks[0].losses);
}

// Unsharded accumulation under bf16-mixed keeps the full gradients in fp32 between micro-steps
// (FSDP2 upcasts to reduce_dtype): equal to sharded accumulation, which reduces each micro-step's
// gradient in fp32, up to the order of the fp32 sums.
TEST(Fsdp, Bf16MixedAccumulatesInFp32) {
  TempDir dir;
  const Config config = small_gpt(
      dir.path(), 2, {"train.precision=bf16-mixed", "data.seq_len=16", "train.grad_accum_steps=2"});
  FsdpOptions unsharded = fsdp_options(config);
  FsdpOptions sharded = unsharded;
  sharded.accumulate_sharded = true;
  auto a = train_fsdp(config, 2, 4, unsharded);
  auto b = train_fsdp(config, 2, 4, sharded);
  for (size_t k = 0; k < a[0].losses.size(); ++k)
    EXPECT_NEAR(a[0].losses[k], b[0].losses[k], 1e-5 * std::abs(b[0].losses[k])) << k;
  EXPECT_TRUE(a[0].shards_fp32);
}

// fp16-mixed: the loss scaler's overflow flag is summed over the ranks with the squared shard
// norms, so every rank skips the same steps and holds the same scale; the losses follow one
// process's fp16-mixed run within fp16's tolerance (10 bits of mantissa, 2e-2 as for bf16).
TEST(Fsdp, Fp16MixedScalerAgreesAcrossRanks) {
  TempDir dir;
  const std::vector<std::string> fp16 = {"train.precision=fp16-mixed", "data.seq_len=16"};
  const RunResult single = train_single(small_gpt(dir.path(), 4, fp16), 8);
  const Config config = small_gpt(dir.path(), 2, fp16);
  auto ranks = train_fsdp(config, 2, 8, fsdp_options(config));
  expect_equivalent(single, ranks[0], 2e-2);
  expect_replicas_agree(ranks);
  ASSERT_FALSE(ranks[0].grad_scaler.is_null());
  EXPECT_EQ(ranks[0].grad_scaler, ranks[1].grad_scaler);
  EXPECT_EQ(ranks[0].grad_scaler["scale"], single.grad_scaler["scale"]);
  EXPECT_TRUE(ranks[0].shards_fp32);
}

// Activation checkpointing (the Trainer's wrapper, outside FSDP's): the recomputation in
// backward gathers the freed unit again; losses and parameters are those without it, with the
// same number of all-gathers (the unit is gathered once in forward, once in backward).
// Equal up to fp32 summation order, not bitwise: bitwise on every machine we ran, but one CI run
// (ranks as threads) ended step 3's loss ~1e-7 apart, the drift two intra-op threads instead of
// one give (measured: losses 1e-7, parameters 3e-7 relative after 4 steps; under bf16-mixed 5e-5
// and 8e-3). A recomputation that went wrong (another unit's weights, missing rows, fp32 instead
// of bf16) moves the losses by 1e-3 and more.
TEST(Fsdp, ActivationCheckpointingTrainsTheSame) {
  TempDir dir;
  const std::vector<std::string> shape = {"model.n_layer=3", "data.seq_len=16"};
  auto with_ac = shape;
  with_ac.push_back("train.activation_checkpointing=block");
  auto plain = train_fsdp(small_gpt(dir.path(), 2, shape), 2, 4);
  auto checkpointed = train_fsdp(small_gpt(dir.path(), 2, with_ac), 2, 4);
  ASSERT_EQ(checkpointed[0].losses.size(), plain[0].losses.size());
  for (size_t k = 0; k < plain[0].losses.size(); ++k)
    EXPECT_NEAR(checkpointed[0].losses[k], plain[0].losses[k], 1e-6 * plain[0].losses[k]) << k;
  for (size_t k = 0; k < plain[0].parameters.size(); ++k) {
    EXPECT_LE(
        relative_difference(checkpointed[0].parameters[k].second, plain[0].parameters[k].second),
        1e-5)
        << plain[0].parameters[k].first;
  }
  EXPECT_EQ(checkpointed[0].all_gathers, plain[0].all_gathers);
  EXPECT_TRUE(checkpointed[0].storage_released);
  expect_replicas_agree(checkpointed);
  // Under bf16-mixed too (the recomputation repeats the forward's autocast state).
  auto bf16 = with_ac;
  bf16.push_back("train.precision=bf16-mixed");
  auto bf16_plain_config = shape;
  bf16_plain_config.push_back("train.precision=bf16-mixed");
  const Config c1 = small_gpt(dir.path(), 2, bf16),
               c2 = small_gpt(dir.path(), 2, bf16_plain_config);
  auto bf16_ac = train_fsdp(c1, 2, 3, fsdp_options(c1));
  auto bf16_plain = train_fsdp(c2, 2, 3, fsdp_options(c2));
  ASSERT_EQ(bf16_ac[0].losses.size(), bf16_plain[0].losses.size());
  for (size_t k = 0; k < bf16_plain[0].losses.size(); ++k)
    EXPECT_NEAR(bf16_ac[0].losses[k], bf16_plain[0].losses[k], 2e-4 * bf16_plain[0].losses[k]) << k;
  EXPECT_EQ(bf16_ac[0].all_gathers, bf16_plain[0].all_gathers);
  expect_replicas_agree(bf16_ac);
}

TEST(Fsdp, EvaluateGathersAndFreesAgain) {
  TempDir dir;
  const Config config =
      gpt_config(dir.path(), {"data.num_workers=0", "train.batch_size=2", "train.eval_batches=2"});
  // One process with the global batch of the two ranks sees the same validation samples.
  const Config whole =
      gpt_config(dir.path(), {"data.num_workers=0", "train.batch_size=4", "train.eval_batches=2"});
  apply_runtime_settings(whole);
  Trainer reference(TrainerSetup::from_config(whole), make_model(whole), make_datasets(whole));
  install_configured_checkpointing(reference);
  const double expected = reference.evaluate().loss;
  std::vector<double> losses(2);
  run_ranks(2, [&](Communicator& borrowed) {
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                    TrainerOptions{torch::kCPU, borrowed.rank(), 2, comm});
    install_configured_checkpointing(trainer);
    FullyShardedDataParallel::attach(trainer, comm, {});
    losses[static_cast<size_t>(borrowed.rank())] = trainer.evaluate().loss;
    for (const auto& p : trainer.model().parameters())
      EXPECT_EQ(p.unsafeGetTensorImpl()->storage().nbytes(), 0u);
  });
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_NEAR(losses[0], expected, 1e-5 * expected);
}

}  // namespace
}  // namespace kiln::testing::fsdp_test

namespace kiln::testing {
namespace {

TEST(DistStrategy, AutoPicksFsdpOnlyWhenDdpDoesNotFit) {
  TempDir dir;
  auto choose = [&](const std::string& memory) {
    const Config config =
        gpt_config(dir.path(), {"dist.strategy=auto", "dist.device_memory_bytes=" + memory});
    return resolve_strategy(config, *make_model(config), torch::kCPU, StrategyWorld{2});
  };
  const StrategyChoice roomy = choose("1e12");
  EXPECT_EQ(roomy.strategy, Parallelism::kDdp);
  EXPECT_EQ(roomy.decision["strategy"], "ddp");
  // Half a MB: below DDP's model state (16 B x ~0.1M parameters): fsdp, and the reason says why.
  const StrategyChoice tight = choose("5e5");
  EXPECT_EQ(tight.strategy, Parallelism::kFsdp);
  EXPECT_THAT(tight.reason, ::testing::HasSubstr("dist.strategy = \"auto\": fsdp"));
  EXPECT_THAT(tight.reason, ::testing::HasSubstr("dist.device_memory_bytes"));
  // At world 4 the plan's degree is the shard group, replicated over the rest (hybrid sharding
  // when the degree is below the world).
  // Usable memory halfway between FSDP over 4 and DDP (as sized at world 4): FSDP over 2 fits.
  const Config roomy4 = gpt_config(dir.path(), {"dist.strategy=auto", "dist.memory_headroom=0",
                                                "dist.device_memory_bytes=1e12"});
  const StrategyChoice sizes =
      resolve_strategy(roomy4, *make_model(roomy4), torch::kCPU, StrategyWorld{4});
  const double halfway = (sizes.decision["ddp_bytes_per_device"].get<double>() +
                          sizes.decision["fsdp_bytes_per_device"].get<double>()) /
                         2;
  const Config tight4 =
      gpt_config(dir.path(), {"dist.strategy=auto", "dist.memory_headroom=0",
                              fmt::format("dist.device_memory_bytes={:.0f}", halfway)});
  const StrategyChoice hybrid =
      resolve_strategy(tight4, *make_model(tight4), torch::kCPU, StrategyWorld{4});
  const int degree = hybrid.decision["fsdp_degree"].get<int>();
  EXPECT_EQ(degree, 2);
  EXPECT_EQ(hybrid.mesh.dp_shard, degree);
  EXPECT_EQ(hybrid.mesh.dp_replicate, 4 / degree);
  if (degree < 4) {
    EXPECT_THAT(hybrid.reason, ::testing::HasSubstr("hybrid sharding"));
  }
  const Config asked = gpt_config(dir.path(), {"dist.strategy=fsdp", "dist.dp_replicate=2"});
  const StrategyChoice two_by_two =
      resolve_strategy(asked, *make_model(asked), torch::kCPU, StrategyWorld{4});
  EXPECT_EQ(two_by_two.mesh.dp_replicate, 2);
  EXPECT_EQ(two_by_two.mesh.dp_shard, 2);
  const Config over_all = gpt_config(dir.path(), {"dist.strategy=fsdp"});
  EXPECT_EQ(resolve_strategy(over_all, *make_model(over_all), torch::kCPU, StrategyWorld{4})
                .mesh.dp_shard,
            4);
  const Config fixed = gpt_config(dir.path(), {"dist.strategy=ddp"});
  EXPECT_EQ(resolve_strategy(fixed, *make_model(fixed), torch::kCPU, StrategyWorld{2}).strategy,
            Parallelism::kDdp);
  EXPECT_TRUE(resolve_strategy(fixed, *make_model(fixed), torch::kCPU, StrategyWorld{2})
                  .decision.is_null());
}

// dist.strategy = "auto" with dist.tp = 0 runs the layout `kiln plan` recommends for the same
// job on the same hardware row: two nodes of two ranks, memory between FSDP over one node and
// FSDP over both, a network 5x slower one way than the node's link: TP 2 inside a node with
// FSDP over the slices communicates less across nodes than FSDP over all four.
// dist.strategy = "auto" on a gpt whose memory lies between FSDP over 2 and over 4 (the rule's
// own figures from roomy decisions), and a catalog row for this CPU as nodes of 2 ranks whose node
// link is 10x the network (5x one way).
struct TwoNodeJob {
  TempDir dir;
  std::filesystem::path catalog = dir.path() / "cpu.toml";
  double memory = 0;
  Config config(std::vector<std::string> extra) const {
    const std::vector<std::string> base = {"dist.strategy=auto", "dist.memory_headroom=0",
                                           "plan.headroom=0"};
    extra.insert(extra.begin(), base.begin(), base.end());
    return gpt_config(dir.path(), extra);
  }
  StrategyChoice resolve(const Config& config, StrategyWorld world) const {
    return resolve_strategy(config, *make_model(config), torch::kCPU, world);
  }
  std::string sized() const { return fmt::format("dist.device_memory_bytes={:.0f}", memory); }
  TwoNodeJob() {
    const Config roomy = config({"dist.device_memory_bytes=1e12"});
    const double fsdp2 = resolve(roomy, StrategyWorld{2}).decision["fsdp_bytes_per_device"];
    const double fsdp4 =
        resolve(roomy, StrategyWorld{4, 2, true}).decision["fsdp_bytes_per_device"];
    EXPECT_LT(fsdp4, fsdp2);
    memory = (fsdp2 + fsdp4) / 2;
    write_text(catalog, fmt::format(R"([device.two-node-cpu]
match = ["CPU"]
memory_gb = {:.9f}
memory_bandwidth_gb_per_s = 20
interconnect_gb_per_s = 10
gpus_per_node = 2
network_gb_per_s = 1
peak_tflops = {{ fp32 = 0.1 }}
source = "a test row"
date = "2026-12"
)",
                                    memory / 1e9));
  }
};

TEST(DistStrategy, AutoChoosesTensorParallelInsideANodeAsThePlanDoes) {
  const TwoNodeJob two;
  auto config_with = [&](std::vector<std::string> extra) { return two.config(std::move(extra)); };
  auto resolve = [&](const Config& config, StrategyWorld world) {
    return two.resolve(config, world);
  };
  const std::filesystem::path catalog = two.catalog;
  const StrategyWorld two_nodes{4, 2, true};
  const std::string sized = two.sized();
  const Config linked = config_with(
      {sized, "plan.catalog=" + catalog.string(), "plan.hardware=two-node-cpu", "plan.gpus=4"});
  const StrategyChoice tp = resolve(linked, two_nodes);
  EXPECT_EQ(tp.strategy, Parallelism::kFsdp);
  EXPECT_EQ(tp.mesh.tp, 2);
  EXPECT_EQ(tp.mesh.dp_shard, 2);
  EXPECT_EQ(tp.mesh.dp_replicate, 1);
  EXPECT_EQ(tp.decision["tp_degree"], 2);
  EXPECT_THAT(tp.reason, ::testing::HasSubstr("tp 2 with fsdp"));
  EXPECT_THAT(tp.reason, ::testing::HasSubstr("catalog row two-node-cpu"));
  // The plan of the same job on that row: the same layout.
  const PlanResult plan = make_plan(linked, nullptr, false);
  ASSERT_EQ(plan.rows.size(), 1u);
  EXPECT_EQ(plan.rows[0].strategy, "fsdp");
  EXPECT_EQ(plan.rows[0].fsdp_degree, tp.mesh.dp_shard);
  EXPECT_EQ(plan.rows[0].tp_degree, tp.mesh.tp);
  // Negative controls, each one change away: links unknown (no row matches this CPU) prefer
  // FSDP over all four (the rule's default); TP not allowed (a compiled step) or dist.tp = 1 set;
  // one node of four ranks, where FSDP over four stays inside it.
  const StrategyChoice unknown = resolve(config_with({sized}), two_nodes);
  EXPECT_EQ(unknown.mesh.tp, 1);
  EXPECT_EQ(unknown.mesh.dp_shard, 4);
  EXPECT_THAT(unknown.reason, ::testing::HasSubstr("link bandwidths unknown"));
  EXPECT_EQ(resolve(linked, StrategyWorld{4, 2, false}).mesh.tp, 1);
  const Config tp_one = config_with({sized, "plan.catalog=" + catalog.string(), "dist.tp=1"});
  EXPECT_EQ(resolve(tp_one, two_nodes).mesh.tp, 1);
  const StrategyChoice one_node = resolve(linked, StrategyWorld{4, 4, true});
  EXPECT_EQ(one_node.mesh.tp, 1);
  EXPECT_EQ(one_node.mesh.dp_shard, 4);
}

// The pilot of a larger job (StrategyWorld::production_world_size = plan.gpus): "auto" chooses
// the layout at the production world and runs its tp and dp_shard at the pilot's world with fewer
// replicas, so the memory the pilot measures is a production rank's. 8 GPUs in nodes of 2 (the
// catalog row), memory between FSDP over 2 and over 4: production runs tp 2 x fsdp 2 x 2
// replicas; a pilot of 4 ranks on one machine (one node of 4) runs 1 x 2 x 2, where choosing for
// its own world gives FSDP over its 4. Controls: no production world; a pilot world of 2, which
// tp 2 x dp_shard 2 does not divide (said, and chosen for that world).
TEST(DistStrategy, APilotRunsTheProductionLayoutScaledDown) {
  const TwoNodeJob two;
  auto resolve = [&](const Config& config, StrategyWorld world) {
    return two.resolve(config, world);
  };
  const Config config = two.config({two.sized(), "plan.catalog=" + two.catalog.string()});
  StrategyWorld pilot{4, 4, true};
  pilot.production_world_size = 8;
  const StrategyChoice scaled = resolve(config, pilot);
  EXPECT_EQ(scaled.strategy, Parallelism::kFsdp);
  EXPECT_EQ(scaled.mesh.tp, 2);
  EXPECT_EQ(scaled.mesh.dp_shard, 2);
  EXPECT_EQ(scaled.mesh.dp_replicate, 1);
  EXPECT_EQ(scaled.decision["production_world_size"], 8);
  EXPECT_EQ(scaled.decision["production_layout_scaled"], true);
  EXPECT_THAT(scaled.reason,
              ::testing::HasSubstr("plan.gpus = 8 (fsdp 2 x tp 2, dp_replicate 2) "
                                   "scaled down to this world of 4: dp_replicate 1"));
  // Production itself: the same tp and dp_shard, twice the replicas.
  const StrategyChoice production = resolve(config, StrategyWorld{8, 2, true});
  EXPECT_EQ(production.mesh.tp, 2);
  EXPECT_EQ(production.mesh.dp_shard, 2);
  EXPECT_EQ(production.mesh.dp_replicate, 2);
  // Controls.
  const StrategyChoice own = resolve(config, StrategyWorld{4, 4, true});
  EXPECT_EQ(own.mesh.tp, 1);
  EXPECT_EQ(own.mesh.dp_shard, 4);
  StrategyWorld small{2, 2, true};
  small.production_world_size = 8;
  const StrategyChoice too_small = resolve(config, small);
  EXPECT_EQ(too_small.mesh.size(), 2);
  EXPECT_EQ(too_small.decision["production_layout_scaled"], false);
  EXPECT_THAT(too_small.reason, ::testing::HasSubstr("needs 4 ranks per replica, which do not "
                                                     "divide this world of 2"));
}

}  // namespace
}  // namespace kiln::testing
