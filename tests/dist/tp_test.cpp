// Tensor parallelism (kiln/dist.h install_tensor_parallel, Model::shard_tensor_parallel) on a
// small llama and a small gpt (whose fused c_attn is sliced as three blocks), ranks as threads
// (tests/ckpt/thread_comm.h), composed as `kiln train` composes a step (kiln/job.h compose_step):
// TP 2 alone, TP 2 x DDP 2, TP 2 x FSDP 2, each against one process with the same global batch
// (per-step losses and the checkpoint's consolidated weights); the negative control drops the
// tensor-parallel all-reduces; each split weight held by half; checkpoints moved between meshes and
// a resume under TP 2 x DDP 2 bitwise.
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <mutex>

#include "ckpt/thread_comm.h"
#include "kiln/checkpoint.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/job.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

constexpr int64_t kGlobalBatch = 12;  // divides over 1, 2, 3 and 4 data-parallel ranks

// The two families with a tensor-parallel plan.
enum class Family { kLlama, kGpt };

std::string family_name(Family family) {
  return family == Family::kLlama ? "llama" : "gpt";
}

// SGD with momentum and clipping (AdamW's per-element normalisation turns fp32 summation-order
// noise into visible weight differences; tests/dist/fsdp_test.cpp says more), one thread per
// rank. gpt: 2 layers of 4 heads, 64 wide (tests/support/helpers.h gpt_config).
Config model_config(Family family, const std::filesystem::path& dir, int dp,
                    std::vector<std::string> extra = {}) {
  std::vector<std::string> keys;
  if (family == Family::kLlama)
    keys = {"model.name=llama", "model.n_kv_head=2", "model.intermediate_size=128"};
  keys.insert(keys.end(),
              {"data.seq_len=16", "data.num_workers=0", "optim.name=sgd", "optim.lr=0.3",
               "optim.momentum=0.9", "train.clip_grad_norm=0.5", "run.threads=1",
               "train.batch_size=" + std::to_string(kGlobalBatch / dp)});
  keys.insert(keys.end(), extra.begin(), extra.end());
  return gpt_config(dir, keys);
}

Config llama(const std::filesystem::path& dir, int dp, std::vector<std::string> extra = {}) {
  return model_config(Family::kLlama, dir, dp, std::move(extra));
}

struct Mesh {
  Mesh(int world, int tp, std::string strategy, std::vector<std::string> extra = {})
      : world(world), tp(tp), strategy(std::move(strategy)), extra(std::move(extra)) {}
  int world = 1, tp = 1;
  std::string strategy = "ddp";    // over the world / tp data-parallel ranks
  std::vector<std::string> extra;  // more keys (precision, checkpointing)
  Family family = Family::kLlama;
  Mesh of(Family f) const {
    Mesh out = *this;
    out.family = f;
    return out;
  }
  std::string text() const {
    return fmt::format("{} tp {} x {} {}{}{}", family_name(family), tp, strategy, world / tp,
                       extra.empty() ? "" : " ", fmt::join(extra, " "));
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> out = {"dist.tp=" + std::to_string(tp), "dist.strategy=" + strategy};
    out.insert(out.end(), extra.begin(), extra.end());
    return out;
  }
};

// fn(trainer, comm) on every rank of `mesh` (threads), the step composed by compose_step.
void with_mesh(const std::filesystem::path& dir, const Mesh& mesh,
               const std::function<void(Trainer&, Communicator&)>& fn) {
  const Config config = model_config(mesh.family, dir, mesh.world / mesh.tp, mesh.keys());
  apply_runtime_settings(config);
  run_ranks(mesh.world, [&](Communicator& borrowed) {
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    const Job job = resolve_job(config);
    ComposedStep step =
        compose_step(job, make_model(config), make_datasets(config),
                     TrainerOptions{torch::kCPU, borrowed.rank(), mesh.world, comm}, {false});
    fn(*step.trainer, borrowed);
  });
}

void save(Trainer& trainer, Communicator& comm, const std::filesystem::path& dir) {
  CheckpointOptions options;
  options.dir = dir;
  Checkpointer checkpointer(options, comm);
  checkpointer.save(capture_training_state(trainer, comm, {}));
  checkpointer.wait();
}

using Tensors = std::vector<std::pair<std::string, torch::Tensor>>;

std::filesystem::path step_dir(const std::filesystem::path& dir, int64_t step) {
  return dir / ("step-" + std::to_string(step));
}

// `steps` steps on `mesh`: rank 0's losses; the checkpoint of the last step in `out`.
std::vector<double> train(const std::filesystem::path& dir, const Mesh& mesh, int64_t steps,
                          const std::filesystem::path& out) {
  std::vector<double> losses;
  with_mesh(dir, mesh, [&](Trainer& trainer, Communicator& comm) {
    for (int64_t k = 0; k < steps; ++k) {
      const double loss = trainer.train_step().loss;
      if (comm.rank() == 0) losses.push_back(loss);
    }
    save(trainer, comm, out);
  });
  return losses;
}

double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-12);
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want,
                  double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k)
    EXPECT_NEAR(got[k], want[k], tolerance * std::abs(want[k])) << "step " << k + 1;
}

void expect_close(const Tensors& got, const Tensors& want, double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].first, want[k].first);
    ASSERT_EQ(got[k].second.sizes(), want[k].second.sizes()) << want[k].first;
    EXPECT_LE(relative(got[k].second, want[k].second), tolerance) << want[k].first;
  }
}

// Seen on an AMD EPYC (AVX-512) over 6 steps: TP 2 alone bitwise-equal losses; TP 2 x DDP 2 and
// TP 2 x FSDP 2 losses within 1.8e-7 relative; every weight within 4.9e-7; the negative control
// 2.2e-2 away.
constexpr double kTolerance = 1e-5;

// gpt under TP 2 x FSDP 2 exercises the fused c_attn's pieces: each rank's FSDP rows of its
// [3C/2, C] slice cross a q/k/v block boundary, so its checkpoint piece is two boxes.
TEST(TensorParallel, MeshesMatchOneProcess) {
  for (Family family : {Family::kLlama, Family::kGpt}) {
    TempDir dir;
    constexpr int64_t kSteps = 6;
    const auto single_dir = dir / "single";
    const std::vector<double> single =
        train(dir / "cfg", Mesh{1, 1, "ddp"}.of(family), kSteps, single_dir);
    const Tensors want = read_checkpoint_tensors(step_dir(single_dir, kSteps), "model/", true);
    for (const Mesh& mesh : {Mesh{2, 2, "ddp"}, Mesh{4, 2, "ddp"}, Mesh{4, 2, "fsdp"}}) {
      SCOPED_TRACE(mesh.of(family).text());
      const auto out = dir / "split";
      std::filesystem::remove_all(out);
      expect_close(train(dir / "cfg", mesh.of(family), kSteps, out), single, kTolerance);
      // The checkpoint holds the whole weights: the slices placed at their offsets.
      expect_close(read_checkpoint_tensors(step_dir(out, kSteps), "model/", true), want,
                   kTolerance);
    }
  }
}

// Composed with activation checkpointing (each layer's recomputation in backward runs its
// all-reduces again), bf16-mixed (the all-reduces in bf16) and fp16-mixed (the loss scaler's
// overflow flag summed over the tp group with the norm), against one process with the same
// keys: checkpointing to summation order, bf16 and fp16 to the precision tests' 2e-2.
TEST(TensorParallel, ComposesWithCheckpointingAndMixedPrecision) {
  TempDir dir;
  for (Family family : {Family::kLlama, Family::kGpt}) {
    for (const auto& [keys, tolerance] : std::vector<std::pair<std::vector<std::string>, double>>{
             {{"train.activation_checkpointing=block"}, kTolerance},
             {{"train.precision=bf16-mixed"}, 2e-2},
             {{"train.precision=fp16-mixed"}, 2e-2}}) {
      const Mesh one = Mesh{1, 1, "ddp", keys}.of(family);
      const Mesh split = Mesh{4, 2, "fsdp", keys}.of(family);
      SCOPED_TRACE(split.text());
      const std::vector<double> single = train(dir / "cfg", one, 4, dir / one.text());
      expect_close(train(dir / "cfg", split, 4, dir / split.text()), single, tolerance);
    }
  }
}

// The 3-D mesh: hybrid sharding (2 replicas of 2 shards) over TP 2 slices, 8 ranks.
TEST(TensorParallel, HybridShardingOverTensorParallelMatchesOneProcess) {
  TempDir dir;
  const Mesh one = Mesh{1, 1, "ddp"}.of(Family::kGpt);
  const Mesh hsdp = Mesh{8, 2, "fsdp", {"dist.dp_replicate=2"}}.of(Family::kGpt);
  const std::vector<double> single = train(dir / "cfg", one, 4, dir / "one");
  expect_close(train(dir / "cfg", hsdp, 4, dir / "hsdp"), single, kTolerance);
  expect_close(read_checkpoint_tensors(step_dir(dir / "hsdp", 4), "model/", true),
               read_checkpoint_tensors(step_dir(dir / "one", 4), "model/", true), kTolerance);
}

// Megatron's f and g dropped: each rank's row-parallel output is its partial sum only.
class NoReduce final : public Communicator {
 public:
  explicit NoReduce(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void barrier() override { inner_->barrier(); }
  void all_reduce_sum(torch::Tensor&) override {}
  void broadcast(torch::Tensor& t, int root) override { inner_->broadcast(t, root); }
  std::vector<std::string> all_gather_bytes(const std::string& mine) override {
    return inner_->all_gather_bytes(mine);
  }

 private:
  std::shared_ptr<Communicator> inner_;
};

TEST(TensorParallel, WithoutItsAllReducesItDoesNotMatch) {
  for (Family family : {Family::kLlama, Family::kGpt}) {
    SCOPED_TRACE(family_name(family));
    TempDir dir;
    const std::vector<double> single =
        train(dir / "cfg", Mesh{1, 1, "ddp"}.of(family), 6, dir / "single");
    const Config config = model_config(family, dir / "cfg", 1, {"dist.tp=2"});
    std::vector<double> broken;
    run_ranks(2, [&](Communicator& borrowed) {
      std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
      DeviceMesh mesh = build_device_mesh(comm, ddp_mesh_shape(2, 2));
      mesh.tp = std::make_shared<NoReduce>(mesh.tp);
      Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                      TrainerOptions{torch::kCPU, 0, 1, mesh.dp});
      install_tensor_parallel(trainer, mesh);
      for (int k = 0; k < 6; ++k) {
        const double loss = trainer.train_step().loss;
        if (borrowed.rank() == 0) broken.push_back(loss);
      }
    });
    double worst = 0;
    for (size_t k = 0; k < single.size(); ++k)
      worst = std::max(worst, std::abs(broken[k] - single[k]) / std::abs(single[k]));
    EXPECT_GT(worst, 1e-3) << "the tensor-parallel all-reduces are what make TP equal one process";
  }
}

TEST(TensorParallel, EachRankHoldsHalfOfEachSplitWeight) {
  for (Family family : {Family::kLlama, Family::kGpt}) {
    SCOPED_TRACE(family_name(family));
    TempDir dir;
    std::mutex mutex;
    std::vector<std::pair<int64_t, int64_t>> held;  // (bytes held, whole bytes) of split weights
    int64_t whole_bytes = 0, split = 0;
    with_mesh(dir.path(), Mesh{2, 2, "ddp"}.of(family), [&](Trainer& trainer, Communicator&) {
      int64_t mine = 0, whole = 0;
      for (const auto& item : trainer.model().named_parameters()) {
        const auto it = trainer.model().tensor_parallel().find(item.key());
        if (it == trainer.model().tensor_parallel().end()) continue;
        int64_t numel = 1;
        for (int64_t d : it->second.global_shape) numel *= d;
        mine += static_cast<int64_t>(item.value().nbytes());
        whole += numel * static_cast<int64_t>(item.value().element_size());
      }
      std::lock_guard lock(mutex);
      held.emplace_back(mine, whole);
      split = static_cast<int64_t>(trainer.model().tensor_parallel().size());
      whole_bytes = whole;
    });
    // llama: q, k, v, o, gate, up, down of each of the 2 layers; gpt: c_attn's weight and bias,
    // attn.c_proj's weight, c_fc's weight and bias, mlp.c_proj's weight.
    EXPECT_EQ(split, family == Family::kLlama ? 2 * 7 : 2 * 6);
    for (const auto& [mine, whole] : held) EXPECT_EQ(2 * mine, whole);
    EXPECT_GT(whole_bytes, 0);
  }
}

// The checkpoint of a TP 2 x DDP 2 run after 3 steps, loaded by `target`, saved again (compared
// whole, bitwise) and trained 3 more steps, against an uninterrupted target run.
void move(const Mesh& source, const Mesh& target, bool bitwise) {
  SCOPED_TRACE(source.text() + " -> " + target.text());
  TempDir dir;
  train(dir / "cfg", source, 3, dir / "saved");
  const auto saved = step_dir(dir / "saved", 3);
  std::vector<double> resumed;
  with_mesh(dir / "cfg", target, [&](Trainer& trainer, Communicator& comm) {
    restore_training_state(trainer, comm, saved, /*dir_fallback=*/false);
    save(trainer, comm, dir / "again");
    for (int k = 0; k < 3; ++k) {
      const double loss = trainer.train_step().loss;
      if (comm.rank() == 0) resumed.push_back(loss);
    }
  });
  for (const char* prefix : {"model/", "optim/"}) {
    const Tensors a = read_checkpoint_tensors(step_dir(dir / "again", 3), prefix, true);
    const Tensors b = read_checkpoint_tensors(saved, prefix, true);
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      ASSERT_EQ(a[k].second.sizes(), b[k].second.sizes()) << a[k].first;
      EXPECT_EQ(std::memcmp(a[k].second.data_ptr(), b[k].second.data_ptr(), a[k].second.nbytes()),
                0)
          << a[k].first;
    }
  }
  std::vector<double> straight;
  with_mesh(dir / "cfg", target, [&](Trainer& trainer, Communicator& comm) {
    for (int k = 0; k < 6; ++k) {
      const double loss = trainer.train_step().loss;
      if (comm.rank() == 0 && k >= 3) straight.push_back(loss);
    }
  });
  if (bitwise) {
    EXPECT_EQ(resumed, straight);
  } else {
    expect_close(resumed, straight, 1e-6);
  }
}

TEST(TensorParallel, CheckpointsMoveBetweenMeshes) {
  move({4, 2, "ddp"}, {4, 2, "ddp"}, true);     // kill and resume: bitwise
  move({4, 2, "ddp"}, {1, 1, "ddp"}, false);    // one process
  move({4, 2, "ddp"}, {4, 1, "ddp"}, false);    // DDP over 4, no TP
  move({4, 2, "fsdp"}, {3, 1, "fsdp"}, false);  // FSDP over 3
  // gpt's fused c_attn: saved as two boxes per rank under TP 2 x FSDP 2, read back the same
  // way, whole in one process, and re-cut at FSDP over 3.
  const Family gpt = Family::kGpt;
  move(Mesh{4, 2, "fsdp"}.of(gpt), Mesh{4, 2, "fsdp"}.of(gpt), true);
  move(Mesh{4, 2, "fsdp"}.of(gpt), Mesh{1, 1, "ddp"}.of(gpt), false);
  move(Mesh{4, 2, "ddp"}.of(gpt), Mesh{3, 1, "fsdp"}.of(gpt), false);
}

// A fused placement (3 blocks of 32 rows, rank 1 of 2 holds rows [16, 32) of each): FSDP's rows
// of the slice map to one run per block they touch.
TEST(TensorParallel, AFusedSliceMapsToOneRunPerBlock) {
  TensorParallelPlacement p;
  p.global_shape = {96, 8};
  p.offset = 16;
  p.length = 16;
  p.chunks = 3;
  auto text = [](const std::vector<TensorParallelPlacement::Run>& runs) {
    std::string out;
    for (const auto& r : runs) out += fmt::format("{}->{}x{} ", r.local, r.global, r.length);
    return out;
  };
  EXPECT_EQ(text(p.runs(0, 48)), "0->16x16 16->48x16 32->80x16 ");
  EXPECT_EQ(text(p.runs(20, 20)), "20->52x12 32->80x8 ");
  EXPECT_EQ(text(p.runs(40, 4)), "40->88x4 ");
  p.chunks = 1;  // a plain column-parallel slice: one run
  p.global_shape = {32, 8};
  EXPECT_EQ(text(p.runs(4, 12)), "4->20x12 ");
}

TEST(TensorParallel, RefusesMeshesItCannotRun) {
  EXPECT_THROW(ddp_mesh_shape(4, 3), UserError);
  try {
    fsdp_mesh_shape(0, 4, 1, 3);
    FAIL() << "tp 3 of 4 ranks was accepted";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("dist.tp = 3 does not divide the world of 4"));
  }
  EXPECT_EQ(fsdp_mesh_shape(2, 8, 1, 2).dp_shard, 2);  // 2 replicas x 2 shards x tp 2
  // A model without a plan, and a tp that splits no (key/value) heads evenly: config rules.
  TempDir dir;
  Config mlp = Config::defaults();  // model.name = "mlp"
  mlp.set_from_string("dist.tp=2");
  EXPECT_THROW(mlp.validate(), UserError);
  EXPECT_THROW(llama(dir.path(), 1, {"dist.tp=4"}), UserError);  // 2 key/value heads
  EXPECT_NO_THROW(llama(dir.path(), 1, {"dist.tp=2"}));
  try {
    model_config(Family::kGpt, dir.path(), 1, {"dist.tp=3"});  // 4 heads
    FAIL() << "gpt split over 3 ranks was accepted";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("dist.tp = 3 must divide the attention heads"));
  }
  EXPECT_NO_THROW(model_config(Family::kGpt, dir.path(), 1, {"dist.tp=2"}));
}

}  // namespace
}  // namespace kiln::testing
