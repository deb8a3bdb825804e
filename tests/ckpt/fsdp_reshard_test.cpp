// FSDP checkpoints (kiln/dist.h, kiln/checkpoint.h): each rank writes its shards at their global
// offsets; a checkpoint resumes under another layout (single process, DDP at N, FSDP at M). For
// each pair: the state loaded, saved again, consolidates bitwise to what was saved, and the
// continued losses agree with an uninterrupted run of the target layout (fsdp 2 -> fsdp 2:
// bitwise). Ranks are threads (tests/ckpt/thread_comm.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "ckpt/thread_comm.h"
#include "kiln/checkpoint.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/safetensors.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

constexpr int64_t kGlobalBatch = 24;
constexpr int64_t kSaveAt = 3, kMore = 3;

struct Layout {
  std::string strategy;  // "single", "ddp", "fsdp", "hsdp" (2 replicas x world / 2 shards)
  int world = 1;
  std::string text() const { return strategy + " " + std::to_string(world); }
};

Config layout_config(const std::filesystem::path& dir, const Layout& layout) {
  return mlp_config(dir, {"data.num_samples=480", "data.num_workers=0",
                          "train.batch_size=" + std::to_string(kGlobalBatch / layout.world)});
}

// Runs fn on every rank of `layout` (threads), each with a trainer and its strategy attached.
void with_layout(const std::filesystem::path& dir, const Layout& layout,
                 const std::function<void(Trainer&, Communicator&)>& fn) {
  const Config config = layout_config(dir, layout);
  apply_runtime_settings(config);
  run_ranks(layout.world, [&](Communicator& borrowed) {
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                    TrainerOptions{torch::kCPU, borrowed.rank(), layout.world, comm});
    if (layout.strategy == "fsdp") FullyShardedDataParallel::attach(trainer, comm, {});
    if (layout.strategy == "hsdp") {
      FullyShardedDataParallel::attach(trainer, build_device_mesh(comm, {2, layout.world / 2}), {});
    }
    if (layout.strategy == "ddp") DataParallel::attach(trainer, comm, {});
    fn(trainer, borrowed);
  });
}

void save(Trainer& trainer, Communicator& comm, const std::filesystem::path& run_dir) {
  CheckpointOptions options;  // the [checkpoint] defaults, in <run dir>/checkpoints
  options.dir = run_dir / "checkpoints";
  Checkpointer checkpointer(options, comm);
  checkpointer.save(capture_training_state(trainer, comm, {}));
  checkpointer.wait();
}

using Tensors = std::vector<std::pair<std::string, torch::Tensor>>;

// The checkpoint's model and optimizer tensors, whole.
Tensors consolidated(const std::filesystem::path& step_dir) {
  Tensors out = read_checkpoint_tensors(step_dir, "model/", true);
  for (auto& t : read_checkpoint_tensors(step_dir, "optim/", true)) out.push_back(std::move(t));
  return out;
}

void expect_bitwise(const Tensors& a, const Tensors& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].first, b[k].first);
    ASSERT_EQ(a[k].second.sizes(), b[k].second.sizes()) << a[k].first;
    EXPECT_EQ(std::memcmp(a[k].second.data_ptr(), b[k].second.data_ptr(), a[k].second.nbytes()), 0)
        << a[k].first;
  }
}

// Source trains kSaveAt steps and saves; the target loads it, saves it again (compared whole
// with the original), trains kMore steps; an uninterrupted target run trains kSaveAt + kMore.
void reshard(const Layout& source, const Layout& target, bool bitwise) {
  SCOPED_TRACE(source.text() + " -> " + target.text());
  TempDir dir;
  with_layout(dir / "cfg", source, [&](Trainer& trainer, Communicator& comm) {
    for (int64_t k = 0; k < kSaveAt; ++k) trainer.train_step();
    save(trainer, comm, dir / "saved");
  });
  const auto saved_step = dir / "saved" / "checkpoints" / ("step-" + std::to_string(kSaveAt));
  const auto index = read_checkpoint_index(saved_step);
  EXPECT_EQ(index.world_size, source.world);
  if (source.strategy == "fsdp") {
    const TensorInfo* fc1 = index.find("model/fc1.weight");
    ASSERT_NE(fc1, nullptr);
    EXPECT_EQ(fc1->placement, Placement::kSharded);
    EXPECT_EQ(fc1->chunks.size(), static_cast<size_t>(source.world));  // one shard per rank
  }
  if (source.strategy == "hsdp") {  // each shard once: replica 0's
    const TensorInfo* fc1 = index.find("model/fc1.weight");
    ASSERT_NE(fc1, nullptr);
    EXPECT_EQ(fc1->chunks.size(), static_cast<size_t>(source.world / 2));
  }

  std::vector<double> resumed;
  with_layout(dir / "cfg", target, [&](Trainer& trainer, Communicator& comm) {
    restore_training_state(trainer, comm, saved_step, /*dir_fallback=*/false);
    save(trainer, comm, dir / "again");
    for (int64_t k = 0; k < kMore; ++k) {
      const double loss = trainer.train_step().loss;
      if (comm.rank() == 0) resumed.push_back(loss);
    }
  });
  expect_bitwise(consolidated(dir / "again" / "checkpoints" / ("step-" + std::to_string(kSaveAt))),
                 consolidated(saved_step));

  std::vector<double> straight;
  with_layout(dir / "cfg", target, [&](Trainer& trainer, Communicator& comm) {
    for (int64_t k = 0; k < kSaveAt + kMore; ++k) {
      const double loss = trainer.train_step().loss;
      if (comm.rank() == 0 && k >= kSaveAt) straight.push_back(loss);
    }
  });
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t k = 0; k < resumed.size(); ++k) {
    if (bitwise) {
      EXPECT_EQ(resumed[k], straight[k]) << "step " << kSaveAt + 1 + k;
    } else {
      EXPECT_NEAR(resumed[k], straight[k], 1e-6 * std::abs(straight[k]))
          << "step " << kSaveAt + 1 + k;
    }
  }
}

TEST(FsdpReshard, FsdpTwoToSingle) {
  reshard({"fsdp", 2}, {"single", 1}, false);
}
TEST(FsdpReshard, SingleToFsdpTwo) {
  reshard({"single", 1}, {"fsdp", 2}, false);
}
TEST(FsdpReshard, FsdpTwoToFsdpThree) {
  reshard({"fsdp", 2}, {"fsdp", 3}, false);
}
TEST(FsdpReshard, FsdpTwoToDdpTwo) {
  reshard({"fsdp", 2}, {"ddp", 2}, false);
}
TEST(FsdpReshard, FsdpTwoToFsdpTwoContinuesBitwise) {
  reshard({"fsdp", 2}, {"fsdp", 2}, true);
}

// Hybrid sharding (2 replicas x 2 shards): one copy of each shard saved, loaded by every replica.
TEST(FsdpReshard, HsdpTwoByTwoToSingle) {
  reshard({"hsdp", 4}, {"single", 1}, false);
}
TEST(FsdpReshard, FsdpThreeToHsdpTwoByTwo) {
  reshard({"fsdp", 3}, {"hsdp", 4}, false);
}
TEST(FsdpReshard, HsdpTwoByTwoContinuesBitwise) {
  reshard({"hsdp", 4}, {"hsdp", 4}, true);
}

TEST(FsdpReshard, ConsolidateGivesTheFullModel) {
  TempDir dir;
  // What consolidation must give back: the full parameters the FSDP ranks hold after the step
  // (gathered by FullyShardedDataParallel::full_parameters), bit for bit.
  constexpr int kWorld = 3;
  Tensors gathered;
  const Config config = layout_config(dir / "cfg", {"fsdp", kWorld});
  apply_runtime_settings(config);
  run_ranks(kWorld, [&](Communicator& borrowed) {
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config),
                    TrainerOptions{torch::kCPU, borrowed.rank(), kWorld, comm});
    auto fsdp = FullyShardedDataParallel::attach(trainer, comm, {});
    trainer.train_step();
    save(trainer, borrowed, dir / "saved");
    auto full = fsdp->full_parameters();
    if (borrowed.rank() == 0) gathered = std::move(full);
  });
  // The same step in one process: FSDP's gradients are averaged over the ranks in another order,
  // so the weights agree to float rounding (which varies with the CPU's vector width), not bits.
  Tensors single;
  with_layout(dir / "cfg", {"single", 1}, [&](Trainer& trainer, Communicator&) {
    trainer.train_step();
    for (const auto& item : trainer.model().named_parameters())
      single.emplace_back(item.key(), item.value().detach().clone());
  });
  const auto out = dir / "full.safetensors";
  EXPECT_EQ(consolidate_checkpoint(dir / "saved" / "checkpoints" / "step-1", out, false),
            static_cast<int64_t>(single.size()));
  const auto whole = read_safetensors(out);
  ASSERT_EQ(whole.size(), single.size());
  ASSERT_EQ(gathered.size(), single.size());
  for (size_t k = 0; k < single.size(); ++k) {
    const auto& [name, expected] = single[k];
    auto it =
        std::find_if(whole.begin(), whole.end(), [&](const auto& t) { return t.first == name; });
    ASSERT_NE(it, whole.end()) << name;
    ASSERT_EQ(it->second.sizes(), expected.sizes()) << name;
    ASSERT_EQ(gathered[k].first, name);
    ASSERT_EQ(gathered[k].second.sizes(), expected.sizes()) << name;
    EXPECT_EQ(
        std::memcmp(it->second.data_ptr(), gathered[k].second.data_ptr(), it->second.nbytes()), 0)
        << name;
    // Seen on an AVX-512 CPU: at most 7.1e-7 (fc1.weight; AdamW's first step is ~lr * sign(g)).
    EXPECT_LT((it->second - expected).abs().max().item<double>(), 1e-5) << name;
  }
}

}  // namespace
}  // namespace kiln::testing
