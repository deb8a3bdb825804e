// kiln's optimizers against torch.optim (tests/train/optimizer_oracle.py): fused and reference
// kernels, with a parameter that has no gradient on some steps (it must keep its moments and its
// own step count, as torch.optim skips it).
#include <gtest/gtest.h>

#include "kiln/safetensors.h"
#include "kiln/train.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

struct OracleCase {
  OptimOptions::Kind kind;
  bool fused;
  bool nesterov;
};

std::string run_case(const OracleCase& c, const std::filesystem::path& dir) {
  torch::manual_seed(7);
  OptimOptions options;
  options.kind = c.kind;
  options.fused = c.fused;
  options.lr = c.kind == OptimOptions::Kind::kAdamW ? 1e-2 : 5e-2;
  options.weight_decay = 0.1;
  options.momentum = c.kind == OptimOptions::Kind::kSGD ? 0.9 : 0.0;
  options.nesterov = c.nesterov;
  NamedTensors params = {
      {"a", torch::randn({4, 3})}, {"b", torch::randn({3})}, {"c", torch::randn({2, 2})}};
  NamedTensors file;
  for (auto& [name, p] : params) {
    file.emplace_back("init/" + name, p.clone());
    p.requires_grad_(true);
  }
  Optimizer optimizer(options, params);
  const int steps = 6;
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    for (auto& [name, p] : params) {
      // "c" has no gradient on steps 0 and 2 (as if unused by those forward passes): its state
      // starts a step later than the others' and pauses once.
      if (name == "c" && (step == 0 || step == 2)) continue;
      auto grad = torch::randn(p.sizes());
      p.mutable_grad() = grad;
      file.emplace_back("grad/" + std::to_string(step) + "/" + name, grad.clone());
    }
    optimizer.step(options.lr);
  }
  for (auto& [name, p] : params) file.emplace_back("kiln/" + name, p.detach().clone());
  for (auto& [name, t] : optimizer.step_counts()) {
    file.emplace_back("kiln_step/" + name.substr(0, name.size() - 5), t.clone());
  }
  const auto path = dir / "case.safetensors";
  write_safetensors(path, file,
                    {{"optimizer", c.kind == OptimOptions::Kind::kAdamW ? "adamw" : "sgd"},
                     {"fused", c.fused ? "true" : "false"},
                     {"lr", std::to_string(options.lr)},
                     {"weight_decay", "0.1"},
                     {"momentum", std::to_string(options.momentum)},
                     {"nesterov", c.nesterov ? "true" : "false"},
                     {"steps", std::to_string(steps)}});
  return path.string();
}

TEST(Optimizer, MatchesTorchOptimWithAParameterWithoutGradientOnSomeSteps) {
  const std::vector<OracleCase> cases = {{OptimOptions::Kind::kAdamW, true, false},
                                         {OptimOptions::Kind::kAdamW, false, false},
                                         {OptimOptions::Kind::kSGD, true, true},
                                         {OptimOptions::Kind::kSGD, false, false}};
  // One oracle process for every case (a Python start and torch import is most of its time).
  std::vector<TempDir> dirs(cases.size());
  std::string files;
  for (size_t k = 0; k < cases.size(); ++k) files += " " + run_case(cases[k], dirs[k].path());
  const auto result =
      run_shell((source_dir() / ".venv/bin/python").string() + " " +
                (source_dir() / "tests/train/optimizer_oracle.py").string() + files);
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  // Every case ran: one summary line each.
  size_t summaries = 0;
  for (size_t at = result.out.find("disagreement(s)"); at != std::string::npos;
       at = result.out.find("disagreement(s)", at + 1))
    ++summaries;
  EXPECT_EQ(summaries, cases.size()) << result.out;
}

}  // namespace
}  // namespace kiln::testing
