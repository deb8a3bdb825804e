#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <nlohmann/json.hpp>
#include <regex>

#include "kiln/build_info.h"
#include "kiln/models.h"
#include "kiln/session.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

TEST(Manifest, RunDirectoryHoldsConfigManifestMetricsAndLog) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"train.steps=5"});
  {
    auto session = open_session(config, {{"kiln", "train", "x.toml"}});
    session->trainer->fit(5, session->run.get());
  }
  auto run_dir = dir / "t";
  for (auto name : {"config.toml", "manifest.json", "metrics.jsonl", "train.log"}) {
    EXPECT_TRUE(std::filesystem::exists(run_dir / name)) << name;
  }
  // The resolved config parses back to the same hash.
  EXPECT_EQ(Config::load(run_dir / "config.toml").hash(), config.hash());
  // metrics.jsonl: one object per step with the documented fields (+ the final eval record).
  std::istringstream lines(slurp(run_dir / "metrics.jsonl"));
  std::string line;
  int steps = 0;
  while (std::getline(lines, line)) {
    auto record = nlohmann::json::parse(line);
    if (!record.contains("loss")) continue;
    ++steps;
    EXPECT_EQ(record["step"], steps);
    for (auto key :
         {"lr", "grad_norm", "step_seconds", "data_wait_seconds", "samples_per_second"}) {
      EXPECT_TRUE(record.contains(key)) << key;
    }
  }
  EXPECT_EQ(steps, 5);
}

TEST(Manifest, PinsWhatReproducesTheRun) {
  TempDir dir;
  Config config = mlp_config(dir.path(), {"run.seed=99", "data.seed=7"});
  ::setenv("KILN_CONTAINER_DIGEST", "sha256:abc123", 1);
  { auto session = open_session(config, {{"kiln", "train", "my config.toml"}}); }
  ::unsetenv("KILN_CONTAINER_DIGEST");
  auto m = nlohmann::json::parse(slurp(dir / "t" / "manifest.json"));
  EXPECT_EQ(m["kiln"]["version"], build_info().version);
  // The commit the build was made from: a git checkout (CI's fresh clone) has one, 40 hex digits;
  // only a source tree without .git says "unknown".
  EXPECT_EQ(m["kiln"]["git_commit"], build_info().git_commit);
  if (std::filesystem::exists(source_dir() / ".git")) {
    EXPECT_TRUE(
        std::regex_match(m["kiln"]["git_commit"].get<std::string>(), std::regex("[0-9a-f]{40}")))
        << m["kiln"]["git_commit"];
  } else {
    EXPECT_EQ(m["kiln"]["git_commit"], "unknown");
  }
  EXPECT_TRUE(m["kiln"]["git_dirty"].is_boolean());
  EXPECT_FALSE(m["libtorch"]["version"].get<std::string>().empty());
  EXPECT_FALSE(m["build"]["compiler"].get<std::string>().empty());
  EXPECT_FALSE(m["build"]["flags"].get<std::string>().empty());
  EXPECT_TRUE(m["libtorch"].contains("cuda_runtime"));
  EXPECT_TRUE(m["libtorch"].contains("cudnn"));
  const std::string blas = m["libtorch"]["blas"].get<std::string>();
  EXPECT_EQ(blas.find(','), std::string::npos) << "one setting, not the rest of the line: " << blas;
#ifdef KILN_WITH_CUDA
  EXPECT_TRUE(m["libtorch"]["cuda_build"].is_string());
#else
  EXPECT_TRUE(m["libtorch"]["cuda_build"].is_null());
#endif
#ifdef KILN_WITH_CUDA
  EXPECT_TRUE(m["libtorch"]["nccl"].is_string());  // the CUDA wheels kiln builds against ship NCCL
#else
  EXPECT_TRUE(m["libtorch"]["nccl"].is_null());  // a CPU LibTorch has no NCCL
#endif
  ASSERT_EQ(m["devices"].size(),
            1u + (m["libtorch"]["cuda_available"].get<bool>() ? torch::cuda::device_count() : 0));
  EXPECT_EQ(m["devices"][0]["type"], "cpu");
  for (size_t k = 1; k < m["devices"].size(); ++k) {
    EXPECT_EQ(m["devices"][k]["type"], "cuda");
#ifdef KILN_WITH_CUDA
    EXPECT_FALSE(m["devices"][k]["name"].get<std::string>().empty());
#endif
  }
  EXPECT_FALSE(m["host"]["hostname"].get<std::string>().empty());
  EXPECT_FALSE(m["host"]["cpu_model"].get<std::string>().empty());
  EXPECT_GE(m["host"]["intra_op_threads"].get<int>(), 1);
  EXPECT_EQ(m["host"]["os"]["system"], "Linux");
  EXPECT_EQ(m["config"]["hash_xxh64"], config.hash());
  EXPECT_EQ(m["seeds"]["run.seed"], 99);
  EXPECT_EQ(m["seeds"]["data.seed"], 7);
  EXPECT_EQ(m["container_image_digest"], "sha256:abc123");
  EXPECT_EQ(m["command_line"], "kiln train 'my config.toml'");
  EXPECT_EQ(m["data"]["kind"], "synthetic");
  EXPECT_EQ(m["data"]["train_samples"], 2048);
  // The model identity matches a freshly built model: same architecture, count and weights.
  auto model = make_model(config);
  EXPECT_EQ(m["model"]["architecture"], "mlp");
  EXPECT_EQ(m["model"]["parameter_count"], 100 * 256 + 256 + 256 * 10 + 10);
  EXPECT_EQ(m["model"]["initial_weights_xxh3"], weights_hash(*model));
  EXPECT_EQ(m["start_time_utc"].get<std::string>().size(), 20u);
}

TEST(Manifest, TextDataIsIdentifiedByContentHash) {
  TempDir dir;
  write_text(dir / "a.txt", std::string(5000, 'a'));
  Config config = gpt_config(dir.path(), {"data.path=" + (dir / "a.txt").string()});
  { auto session = open_session(config, {{"kiln"}}); }
  auto m = nlohmann::json::parse(slurp(dir / "t" / "manifest.json"));
  EXPECT_EQ(m["data"]["kind"], "text");
  EXPECT_EQ(m["data"]["size_bytes"], 5000);
  EXPECT_EQ(m["data"]["content_xxh3"].get<std::string>().size(), 16u);
}

}  // namespace
}  // namespace kiln::testing
