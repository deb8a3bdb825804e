// The profiler hook's cost while its schedule is in the wait phase.
//
// Two Trainers built from the same config take turns: block after block of `steps` steps, one
// without hooks, one with a Profiler whose schedule waits for the whole run. A third, unprofiled
// Trainer is the control (the noise of two identical trainers). The medians of the per-block mean
// step times give the ratios. The loader builds batches in the training thread (num_workers = 0):
// a worker thread's wake-up latency on a busy machine would swamp the hook's cost. Last, the
// hook's calls for one waiting step are timed on their own, millions of times. JSON to stdout.
//
// usage: kiln_bench_profile_overhead <mlp|gpt> [blocks=40] [steps per block=50]
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/config.h"
#include "kiln/profile.h"
#include "kiln/train.h"

using namespace kiln;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Config bench_config(const std::string& model, const std::filesystem::path& dir) {
  Config config = Config::defaults();
  std::vector<std::string> overrides = {"run.progress=off", "run.threads=1", "train.eval_every=0",
                                        "data.num_workers=0", "run.dir=" + dir.string()};
  if (model == "gpt") {
    for (const char* o : {"model.name=gpt", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
                          "data.name=text", "data.seq_len=32", "train.batch_size=8"}) {
      overrides.emplace_back(o);
    }
  }
  // The schedule waits longer than the run: the hook only counts steps.
  for (const char* o : {"profile.skip_first=0", "profile.wait=1000000000", "profile.warmup=0",
                        "profile.active=1", "profile.repeat=1"}) {
    overrides.emplace_back(o);
  }
  for (const auto& o : overrides) config.set_from_string(o);
  config.validate();
  return config;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string model = argc > 1 ? argv[1] : "mlp";
  const int blocks = argc > 2 ? std::stoi(argv[2]) : 40;
  const int steps = argc > 3 ? std::stoi(argv[3]) : 50;
  const auto dir =
      std::filesystem::temp_directory_path() / fmt::format("kiln-bench-profile-{}", ::getpid());
  const Config config = bench_config(model, dir);
  apply_runtime_settings(config);

  // Identical trainers: the same seed before each one.
  auto make_trainer = [&] {
    apply_runtime_settings(config);
    return std::make_unique<Trainer>(TrainerSetup::from_config(config), make_model(config),
                                     make_datasets(config));
  };
  auto trainers = std::vector<std::unique_ptr<Trainer>>();
  for (int k = 0; k < 3; ++k) trainers.push_back(make_trainer());
  // Which of the three carries the profiler rotates with the process id, so no trainer's
  // placement in memory is always the profiled one.
  const int hooked = static_cast<int>(::getpid() % 3);
  Trainer& profiled = *trainers[hooked];
  Trainer& plain = *trainers[(hooked + 1) % 3];
  Trainer& control = *trainers[(hooked + 2) % 3];
  auto profiler =
      std::make_shared<Profiler>(profiler_options(config, dir / "traces", torch::kCPU, 0, 1));
  profiled.add_hook(profiler);

  auto block = [&](Trainer& trainer) {
    const auto begin = std::chrono::steady_clock::now();
    for (int k = 0; k < steps; ++k) trainer.train_step();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() / steps;
  };
  // Warm-up: allocator caches, lazy initialisation.
  block(plain), block(control), block(profiled);
  std::vector<double> plain_s, control_s, profiled_s;
  for (int b = 0; b < blocks; ++b) {
    // Rotate the order so no trainer always runs first.
    const int rotation = b % 3;
    for (int k = 0; k < 3; ++k) {
      switch ((k + rotation) % 3) {
        case 0:
          plain_s.push_back(block(plain));
          break;
        case 1:
          control_s.push_back(block(control));
          break;
        case 2:
          profiled_s.push_back(block(profiled));
          break;
      }
    }
  }
  // The hook's own cost per waiting step, timed directly: the calls the Trainer makes in one
  // step (step begin/end and the four phases' begin/end), many times over.
  const int64_t hook_steps = 2'000'000;
  StepStats stats;
  const auto hook_begin = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < hook_steps; ++k) {
    profiler->on_step_begin(profiled, k);
    for (Phase phase : {Phase::kDataWait, Phase::kForward, Phase::kBackward, Phase::kOptimizer}) {
      profiler->on_phase_begin(profiled, phase);
      profiler->on_phase_end(profiled, phase);
    }
    profiler->on_step_end(profiled, stats);
  }
  const double hook_seconds_per_step =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - hook_begin).count() /
      static_cast<double>(hook_steps);
  const bool waited =
      profiler->traces().empty() && profiler->current_action() == ProfilerAction::kNone;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  const double plain_median = median(plain_s), control_median = median(control_s),
               profiled_median = median(profiled_s);
  // Blocks of one round ran back to back, under the same momentary machine load: the median of
  // their ratios is steadier than the ratio of medians on a shared machine.
  std::vector<double> paired, paired_control;
  for (size_t b = 0; b < plain_s.size(); ++b) {
    paired.push_back(profiled_s[b] / plain_s[b]);
    paired_control.push_back(control_s[b] / plain_s[b]);
  }
  nlohmann::json out = {{"model", model},
                        {"blocks", blocks},
                        {"steps_per_block", steps},
                        {"schedule", "wait phase for the whole run"},
                        {"profiled_trainer_index", hooked},
                        {"profiler_stayed_in_wait", waited},
                        {"step_seconds_median",
                         {{"unprofiled", plain_median},
                          {"unprofiled_control", control_median},
                          {"profiler_waiting", profiled_median}}},
                        {"ratio_profiler_waiting_to_unprofiled", profiled_median / plain_median},
                        {"ratio_control_to_unprofiled", control_median / plain_median},
                        {"ratio_profiler_waiting_to_unprofiled_paired", median(paired)},
                        {"ratio_control_to_unprofiled_paired", median(paired_control)},
                        {"hook_ns_per_waiting_step", 1e9 * hook_seconds_per_step},
                        {"hook_share_of_unprofiled_step", hook_seconds_per_step / plain_median}};
  std::printf("%s\n", out.dump(2).c_str());
  return waited ? 0 : 1;
}
