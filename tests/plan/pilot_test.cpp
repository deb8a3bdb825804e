// The pilot: the memory estimate against the measured peak of live tensor bytes (CPU), one full
// cycle with the restore check in a fresh process, the pins and --check-pins (docs/plan.md).
#include "kiln/pilot.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "kiln/memory.h"
#include "kiln/plan.h"
#include "kiln/rungs.h"
#include "kiln/session.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

std::string corpus() {
  std::string text;
  for (int k = 0; k < 400; ++k)
    text += "the quick brown fox jumps over the lazy dog " + std::to_string(k) + "\n";
  return text;
}

// Measures one full optimizer step the way the pilot does (the state held across steps plus the
// step's own peak of live tensor bytes) and returns measured / estimated.
double measured_over_estimate(const std::vector<std::string>& overrides) {
  TempDir dir;
  write_text(dir / "corpus.txt", corpus());
  std::vector<std::string> all = {"run.dir=" + dir.path().string(),
                                  "data.path=" + (dir / "corpus.txt").string(),
                                  "run.name=m",
                                  "run.progress=off",
                                  "model.name=gpt",
                                  "data.name=text",
                                  "train.eval_every=0",
                                  "data.num_workers=0"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  Config config = Config::defaults();
  for (const auto& o : all) config.set_from_string(o);
  config.validate();
  auto session = open_session(config, {{"kiln"}});
  Trainer& trainer = *session->trainer;
  trainer.run_steps(1);  // allocates the optimizer state
  double state = 0;
  for (const auto& p : trainer.model().parameters()) state += static_cast<double>(p.nbytes());
  for (const auto& [name, t] : trainer.optimizer().state())
    state += static_cast<double>(t.nbytes());
  MemoryMeter meter;
  trainer.train_step(/*sync=*/true);
  meter.stop();
  const double measured = state + static_cast<double>(meter.peak_bytes());
  JobShape job = job_shape(config);
  job.world_size = 1;
  const double estimated = estimate_memory(model_shape(config), job).step_peak();
  return measured / estimated;
}

TEST(PilotMemory, EstimateWithinFifteenPercentOfTheMeasuredPeak) {
  const std::vector<std::vector<std::string>> cases = {
      {"model.preset=tiny", "data.seq_len=64", "train.batch_size=8"},
      {"model.preset=tiny", "data.seq_len=64", "train.batch_size=16"},
      // Accumulation: the earlier micro-batches' gradients stay live beside the activations.
      {"model.preset=tiny", "data.seq_len=64", "train.batch_size=8", "train.grad_accum_steps=2"},
      {"model.preset=small", "data.seq_len=64", "train.batch_size=4"},
      {"model.preset=small", "data.seq_len=128", "train.batch_size=4"},
  };
  for (const auto& c : cases) {
    const double ratio = measured_over_estimate(c);
    std::printf("measured / estimated peak: %.3f for %s\n", ratio,
                ::testing::PrintToString(c).c_str());
    EXPECT_NEAR(ratio, 1.0, 0.15) << ::testing::PrintToString(c);
  }
}

std::string tiny_pilot_args(const TempDir& dir, const std::string& extra = "") {
  return (source_dir() / "configs" / "gpt-tiny.toml").string() +
         " --set run.dir=" + dir.path().string() +
         " --set run.name=p --set data.seq_len=32 --set train.batch_size=4" +
         " --set train.eval_batches=2 --set data.num_workers=0 --set data.path=" +
         (dir / "corpus.txt").string() + extra;
}

TEST(Pilot, FullCycleRestoreCheckPinsAndPlan) {
  TempDir dir;
  write_text(dir / "corpus.txt", corpus());
  auto r = run_kiln("pilot " + tiny_pilot_args(dir, " --set data.revision=v1"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("pilot — PASSED"));
  const auto run_dir = dir / "p";
  auto pilot = nlohmann::json::parse(slurp(run_dir / "pilot.json"));
  EXPECT_TRUE(pilot["restore"]["passed"].get<bool>());
  EXPECT_TRUE(pilot["restore"]["loss_bitwise_equal"].get<bool>());
  EXPECT_TRUE(pilot["restore"]["differing_tensors"].empty());
  const auto& m = pilot["memory"]["measured"];
  EXPECT_GT(m["parameters_bytes"].get<double>(), 0);
  EXPECT_EQ(m["gradients_bytes"], m["parameters_bytes"]);
  EXPECT_EQ(m["optimizer_bytes"].get<double>(),
            2 * m["parameters_bytes"].get<double>());  // AdamW's two moments
  EXPECT_GT(m["activations_and_logits_bytes"].get<double>(), 0);
  EXPECT_GT(m["process_peak_rss_bytes"].get<double>(), m["peak_bytes"].get<double>());
  EXPECT_NEAR(pilot["memory"]["measured_over_estimate"].get<double>(), 1.0, 0.15);
  EXPECT_GT(pilot["checkpoint"]["write_bytes_per_second"].get<double>(), 0);
  EXPECT_GT(pilot["eval_seconds"].get<double>(), 0);

  // The pins: revision, environment, container.
  auto manifest = nlohmann::json::parse(slurp(run_dir / "manifest.json"));
  EXPECT_EQ(manifest["data"]["revision"], "v1");
  EXPECT_FALSE(manifest["container"]["digest_source"].get<std::string>().empty());
  EXPECT_FALSE(manifest["pins"]["python"]["pip_freeze"].empty());
  EXPECT_THAT(manifest["pins"]["debian_packages"].dump(), HasSubstr("cmake="));

  // The plan calibrates from it; a plan of another job refuses it.
  auto plan = run_kiln("plan " + tiny_pilot_args(dir) + " --set data.revision=v1 --pilot " +
                       run_dir.string() + " --set plan.hardware=h100-sxm");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  auto plan_json = nlohmann::json::parse(slurp(run_dir / "plan.json"));
  EXPECT_EQ(plan_json["pilot"], run_dir.string());
  EXPECT_DOUBLE_EQ(plan_json["memory_per_device"]["activation_calibration"].get<double>(),
                   pilot["memory"]["activation_ratio"].get<double>());
  auto other = run_kiln("plan " + tiny_pilot_args(dir) + " --set train.batch_size=5 --pilot " +
                        run_dir.string());
  EXPECT_EQ(other.exit_code, 2);
  EXPECT_THAT(other.err, HasSubstr("another job"));

  // --check-pins: nothing differs; then a changed revision, then content under the same revision.
  const std::string manifest_path = (run_dir / "manifest.json").string();
  auto same = run_kiln("pilot " + tiny_pilot_args(dir, " --set data.revision=v1") +
                       " --check-pins " + manifest_path);
  EXPECT_EQ(same.exit_code, 0) << same.out << same.err;
  auto revised = run_kiln("pilot " + tiny_pilot_args(dir, " --set data.revision=v2") +
                          " --check-pins " + manifest_path);
  EXPECT_EQ(revised.exit_code, 3);
  EXPECT_THAT(revised.out, HasSubstr("data.revision: \"v1\" -> \"v2\""));
  write_text(dir / "corpus.txt", corpus() + "one more line\n");
  auto changed = run_kiln("pilot " + tiny_pilot_args(dir, " --set data.revision=v1") +
                          " --check-pins " + manifest_path);
  EXPECT_EQ(changed.exit_code, 3);
  EXPECT_THAT(changed.out, HasSubstr("data.revision \"v1\" is unchanged but the data's content "
                                     "hash changed"));
}

TEST(Pilot, ARestoreThatDiffersFailsNamingTheTensors) {
  TempDir dir;
  write_text(dir / "corpus.txt", corpus());
  // The restore process trains with another learning rate: its step differs from the pilot's.
  write_text(dir / "kiln-other-lr",
             std::string("#!/bin/sh\nexec ") + KILN_CLI + " \"$@\" --set optim.lr=0.5\n");
  std::filesystem::permissions(dir / "kiln-other-lr", std::filesystem::perms::owner_all);
  auto r = run_shell("KILN_EXECUTABLE=" + (dir / "kiln-other-lr").string() + " " + KILN_CLI +
                     " pilot " + tiny_pilot_args(dir));
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("differ"));
  auto pilot = nlohmann::json::parse(slurp(dir / "p" / "pilot.json"));
  EXPECT_FALSE(pilot["restore"]["passed"].get<bool>());
  EXPECT_THAT(pilot["restore"]["differing_tensors"].get<std::vector<std::string>>(),
              ::testing::Contains("model/transformer.wte.weight"));
  EXPECT_THAT(pilot["restore"]["differing_tensors"].dump(),
              ::testing::Not(HasSubstr("model/model/")));
}

}  // namespace
}  // namespace kiln::testing
