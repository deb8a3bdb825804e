// `kiln ckpt list|inspect|verify|consolidate|drill` as a user runs them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/ckpt_helpers.h"
#include "ckpt/thread_comm.h"
#include "kiln/checkpoint.h"
#include "kiln/safetensors.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

// Steps 1 and 2 saved by two thread-backed ranks: replicated model and optimizer tensors, and a
// sharded one; then a stale step-3.tmp as a killed save leaves it.
void make_two_rank_checkpoints(const std::filesystem::path& dir) {
  run_ranks(2, [&](Communicator& comm) {
    Checkpointer checkpointer(CheckpointOptions{dir, 3, 0, true}, comm);
    for (int64_t step : {1, 2}) {
      SaveRequest request;
      request.step = step;
      request.tensors.emplace_back("model/fc.weight",
                                   torch::full({4, 3}, static_cast<float>(step)));
      request.tensors.emplace_back("model/fc.bias", torch::ones({4}));
      request.tensors.emplace_back("optim/fc.weight.exp_avg", torch::zeros({4, 3}));
      request.tensors.emplace_back("model/table",
                                   torch::arange(3, torch::kFloat).add(3.0f * comm.rank()),
                                   std::vector<int64_t>{6}, std::vector<int64_t>{3 * comm.rank()});
      request.training_state = {{"step", step}, {"epoch", 0}};
      checkpointer.save(request);
    }
    checkpointer.wait();
  });
  std::filesystem::create_directories(dir / "step-3.tmp");
}

TEST(CkptCli, ListInspectVerifyConsolidate) {
  TempDir dir;
  make_two_rank_checkpoints(dir.path());

  auto list = run_kiln("ckpt list " + dir.path().string());
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_THAT(list.out, HasSubstr("committed"));
  EXPECT_THAT(list.out, HasSubstr("(latest)"));
  EXPECT_THAT(list.out, HasSubstr("incomplete"));

  auto inspect = run_kiln("ckpt inspect " + dir.path().string());  // a directory: its newest
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_THAT(inspect.out, HasSubstr("step-2"));
  EXPECT_THAT(inspect.out, HasSubstr("world size 2"));
  EXPECT_THAT(inspect.out, HasSubstr("model/fc.weight"));
  EXPECT_THAT(inspect.out, HasSubstr("[4, 3]"));
  EXPECT_THAT(inspect.out, HasSubstr("sharded x2"));
  EXPECT_THAT(inspect.out, HasSubstr("rank-1.safetensors"));

  auto verify = run_kiln("ckpt verify " + (dir / "step-2").string());
  EXPECT_EQ(verify.exit_code, 0) << verify.err;
  EXPECT_THAT(verify.out, HasSubstr("ok:"));

  auto out = dir / "model.safetensors";
  auto consolidate = run_kiln("ckpt consolidate " + (dir / "step-2").string() + " " + out.string());
  ASSERT_EQ(consolidate.exit_code, 0) << consolidate.err;
  auto tensors = read_safetensors(out);
  std::map<std::string, torch::Tensor> by_name(tensors.begin(), tensors.end());
  EXPECT_EQ(by_name.size(), 3u);  // no optimizer state unless asked
  EXPECT_TRUE(torch::equal(by_name.at("fc.weight"), torch::full({4, 3}, 2.0f)));
  EXPECT_TRUE(torch::equal(by_name.at("table"), torch::arange(6, torch::kFloat)));
  consolidate = run_kiln("ckpt consolidate " + (dir / "step-2").string() + " " + out.string() +
                         " --optimizer");
  ASSERT_EQ(consolidate.exit_code, 0) << consolidate.err;
  EXPECT_EQ(read_safetensors(out).size(), 4u);

  flip_byte(dir / "step-2" / "rank-1.safetensors", -1);
  verify = run_kiln("ckpt verify " + (dir / "step-2").string());
  EXPECT_EQ(verify.exit_code, 2);
  EXPECT_THAT(verify.out, HasSubstr("rank-1.safetensors: xxh3"));
  consolidate = run_kiln("ckpt consolidate " + (dir / "step-2").string() + " " + out.string());
  EXPECT_EQ(consolidate.exit_code, 2);
  EXPECT_THAT(consolidate.err, HasSubstr("failed verification"));

  auto missing = run_kiln("ckpt inspect " + (dir / "nowhere").string());
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("does not exist"));
}

std::string tiny_drill_args(const std::filesystem::path& run_dir, int drill_steps) {
  return "ckpt drill " + (source_dir() / "configs/gpt-tiny.toml").string() +
         " --set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set data.seq_len=32"
         " --set train.batch_size=8 --set run.threads=1 --set run.name=d --set "
         "checkpoint.drill_steps=" +
         std::to_string(drill_steps) + " --set run.dir=" + run_dir.string();
}

// The checkpoint rung on a tiny GPT: save, SIGKILL, restore in a fresh process, compare.
TEST(CkptCli, DrillRestoresBitwiseOnATinyGpt) {
  TempDir dir;
  auto r = run_kiln(tiny_drill_args(dir.path(), 4));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("bitwise equal"));
  auto numbers = nlohmann::json::parse(slurp(dir / "d" / "checkpoint.json"));
  EXPECT_TRUE(numbers["passed"].get<bool>());
  EXPECT_TRUE(numbers["parameters_bitwise_equal"].get<bool>());
  EXPECT_EQ(numbers["losses_compared"], 4);
  EXPECT_TRUE(numbers["verify_ok"].get<bool>());
}

// The negative control: the drill starts its runs through KILN_EXECUTABLE, here a wrapper that
// gives only the restoring process (the one passed --resume) another learning rate. The restored
// step-3 loss is still computed on the restored weights (equal); step 4 and the final parameters
// and optimizer state differ, and the drill fails (exit 3) saying which.
TEST(CkptCli, ADrillWhoseRestoreIsPerturbedFailsNamingWhatDiffered) {
  TempDir dir;
  write_text(dir / "kiln-perturbed-restore",
             std::string("#!/bin/sh\ncase \" $* \" in\n") + "  *\" --resume \"*) exec " + KILN_CLI +
                 " \"$@\" --set optim.lr=0.5 ;;\n  *) exec " + KILN_CLI + " \"$@\" ;;\nesac\n");
  std::filesystem::permissions(dir / "kiln-perturbed-restore", std::filesystem::perms::owner_all);
  auto r = run_shell("KILN_EXECUTABLE=" + (dir / "kiln-perturbed-restore").string() + " " +
                     KILN_CLI + " " + tiny_drill_args(dir.path(), 2));
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("checkpoint drill failed: resume differs from the uninterrupted "
                               "run: 1/2 losses equal"));
  EXPECT_THAT(r.err, HasSubstr("parameters differ, optimizer state differ"));
  auto numbers = nlohmann::json::parse(slurp(dir / "d" / "checkpoint.json"));
  EXPECT_FALSE(numbers["passed"].get<bool>());
  EXPECT_TRUE(numbers["verify_ok"].get<bool>());  // the checkpoint itself is sound
  EXPECT_EQ(numbers["losses_compared"], 2);
  EXPECT_FALSE(numbers["parameters_bitwise_equal"].get<bool>());
  EXPECT_FALSE(numbers["optimizer_state_bitwise_equal"].get<bool>());
}

}  // namespace
}  // namespace kiln::testing
