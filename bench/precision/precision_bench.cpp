// Step time and step peak memory of train.precision and train.activation_checkpointing.
//
// Two Trainers built from the same config but one setting (fp32 vs bf16-mixed on gpt tiny; none
// vs block activation checkpointing on gpt small at seq 256, micro-batch 8) take turns, one step
// each, `steps` times after `warmup` steps; each step's wall time is recorded and, for every
// step, the peak of live tensor bytes (kiln::MemoryMeter) in that step. The medians give the
// ratios. The loader builds batches in the training thread (num_workers = 0). JSON to stdout.
//
// usage: kiln_bench_precision <precision|checkpointing> [steps=10] [warmup=2] [threads=2]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/config.h"
#include "kiln/data.h"
#include "kiln/memory.h"
#include "kiln/models.h"
#include "kiln/train.h"

using namespace kiln;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Config bench_config(const std::vector<std::string>& extra, int threads) {
  Config config = Config::defaults();
  std::vector<std::string> overrides = {
      "run.progress=off",
      fmt::format("run.threads={}", threads),
      "train.eval_every=0",
      "data.num_workers=0",
      "run.dir=" + std::filesystem::temp_directory_path().string(),
      "model.name=gpt",
      "data.name=text"};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  for (const auto& o : overrides) config.set_from_string(o);
  config.validate();
  return config;
}

struct Side {
  std::string name;
  Config config;
  std::unique_ptr<Trainer> trainer;
  std::vector<double> seconds, peak_bytes, losses;
};

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "precision";
  const int steps = argc > 2 ? std::stoi(argv[2]) : 10;
  const int warmup = argc > 3 ? std::stoi(argv[3]) : 2;
  const int threads = argc > 4 ? std::stoi(argv[4]) : 2;
  if (steps < 5) {  // the ratio is of medians over the timed steps
    std::fprintf(stderr, "a ratio needs 5 or more timed steps (got %d)\n", steps);
    return 2;
  }
  std::vector<std::string> shape;
  std::vector<std::pair<std::string, std::string>> settings;
  if (what == "precision") {
    shape = {"model.preset=tiny", "data.seq_len=64", "train.batch_size=16"};
    settings = {{"fp32", "train.precision=fp32"}, {"bf16-mixed", "train.precision=bf16-mixed"}};
  } else {
    shape = {"model.preset=small", "data.seq_len=256", "train.batch_size=8"};
    settings = {{"none", "train.activation_checkpointing=none"},
                {"block", "train.activation_checkpointing=block"}};
  }
  std::vector<Side> sides;
  for (const auto& [name, setting] : settings) {
    auto extra = shape;
    extra.push_back(setting);
    Side side{name, bench_config(extra, threads), nullptr, {}, {}, {}};
    apply_runtime_settings(side.config);
    side.trainer = std::make_unique<Trainer>(TrainerSetup::from_config(side.config),
                                             make_model(side.config), make_datasets(side.config));
    sides.push_back(std::move(side));
  }
  for (int k = 0; k < warmup + steps; ++k) {
    for (Side& side : sides) {
      MemoryMeter meter;
      const auto begin = std::chrono::steady_clock::now();
      const StepStats stats = side.trainer->train_step(/*sync=*/true);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      meter.stop();
      if (k < warmup) continue;
      side.seconds.push_back(seconds);
      side.peak_bytes.push_back(static_cast<double>(meter.peak_bytes()));
      side.losses.push_back(stats.loss);
    }
  }
  nlohmann::json out = {{"bench", what},
                        {"config", shape},
                        {"steps", steps},
                        {"warmup", warmup},
                        {"threads", threads}};
  for (const Side& side : sides) {
    out["sides"][side.name] = {{"median_step_seconds", median(side.seconds)},
                               {"median_step_peak_bytes", median(side.peak_bytes)},
                               {"last_loss", side.losses.back()},
                               {"step_seconds", side.seconds},
                               {"step_peak_bytes", side.peak_bytes}};
  }
  const auto& a = out["sides"][sides[0].name];
  const auto& b = out["sides"][sides[1].name];
  out["ratio_step_seconds"] =
      b["median_step_seconds"].get<double>() / a["median_step_seconds"].get<double>();
  out["ratio_step_peak_bytes"] =
      b["median_step_peak_bytes"].get<double>() / a["median_step_peak_bytes"].get<double>();
  out["ratio_is"] = fmt::format("{} / {}", sides[1].name, sides[0].name);
  std::vector<double> ratios;  // step k of one setting over step k of the other (they alternate)
  for (size_t k = 0; k < sides[0].seconds.size(); ++k)
    ratios.push_back(sides[1].seconds[k] / sides[0].seconds[k]);
  out["ratio_step_seconds_per_step"] = ratios;
  std::puts(out.dump(2).c_str());
  return 0;
}
