// Exported programs (src/models/exported.cpp): kiln's own llama twin exported by `kiln model
// import` and trained from its package against kiln's native C++ llama from the same weights,
// and each refusal of a package kiln cannot run.
#include "models/exported.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <torch/optim/adamw.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <iostream>
#include <map>

#include "core/files.h"
#include "kiln/build_info.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/models.h"
#include "kiln/safetensors.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::vector<std::string> kLlamaShape = {"model.name=llama",
                                              "data.name=text",
                                              "model.n_layer=2",
                                              "model.n_head=4",
                                              "model.n_kv_head=2",
                                              "model.n_embd=64",
                                              "model.intermediate_size=128",
                                              "model.block_size=32",
                                              "model.vocab_size=256",
                                              "data.seq_len=16",
                                              "run.seed=7"};

Config llama_config() {
  return Config::parse("", "x", kLlamaShape);
}

Config exported_config(const fs::path& package) {
  return Config::parse("", "x",
                       {"model.name=exported", "data.name=text", "data.seq_len=16",
                        "model.package=" + package.string()});
}

// The package of kiln's llama twin with the native model's initial weights, exported once per
// build (keyed on the shape, the weights and the importer's source) and shared by the tests.
fs::path llama_package() {
  auto native = make_model(llama_config());
  const std::string importer =
      read_file(fs::path(KILN_SOURCE_DIR) / "python" / "kiln_py" / "export_model.py");
  const std::string key = fmt::format(
      "{:016x}", XXH3_64bits_withSeed(
                     importer.data(), importer.size(),
                     std::hash<std::string>{}(weights_hash(*native) + native->describe().dump())));
  const fs::path root = KILN_TEST_MODEL_PACKAGES;
  fs::create_directories(root);
  const fs::path package = root / ("llama-" + key);
  const int lock = ::open((root / ".lock").c_str(), O_CREAT | O_RDWR, 0644);
  ::flock(lock, LOCK_EX);
  if (!fs::exists(package / "package.json")) {
    TempDir scratch;
    std::vector<std::pair<std::string, torch::Tensor>> weights;
    for (const auto& p : native->named_parameters()) weights.emplace_back(p.key(), p.value());
    write_safetensors(scratch / "weights.safetensors", weights);
    ImportOptions options;
    options.module =
        (fs::path(KILN_SOURCE_DIR) / "python" / "kiln_py" / "models.py").string() + ":build";
    json spec = native->describe();
    spec["name"] = "llama";
    options.options = {{"spec", spec}};
    options.weights = scratch / "weights.safetensors";
    options.out = package;
    options.max_seq = 32;
    options.max_batch = 64;
    options.python = build_info().python;
    import_model(options);
  }
  ::flock(lock, LOCK_UN);
  ::close(lock);
  return package;
}

// A copy of the shared package to break.
fs::path copy_package(const fs::path& from, const TempDir& dir) {
  const fs::path to = dir / "package";
  fs::copy(from, to, fs::copy_options::recursive);
  return to;
}

void rewrite_manifest(const fs::path& package, const std::function<void(json&)>& edit) {
  json manifest = json::parse(read_file(package / "package.json"));
  edit(manifest);
  write_text(package / "package.json", manifest.dump(2));
}

// Losses of `steps` AdamW steps on fixed random token batches.
std::vector<double> train_losses(Model& model, int steps) {
  torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(3e-3));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(11);
  // Two batches, alternated: a model that learns fits them within 20 steps.
  std::vector<torch::Tensor> batches;
  for (int b = 0; b < 2; ++b) {
    batches.push_back(
        torch::randint(0, 256, {4, 17}, generator, torch::TensorOptions().dtype(torch::kLong)));
  }
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    const torch::Tensor& tokens = batches[step % 2];
    const torch::Tensor inputs = tokens.slice(1, 0, 16), targets = tokens.slice(1, 1, 17);
    optimizer.zero_grad();
    torch::Tensor loss = model.loss(model.forward(inputs), targets);
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

TEST(Exported, LlamaTwinPackageTrainsAsTheNativeLlama) {
  const fs::path package = llama_package();
  auto native = make_model(llama_config());
  auto exported = make_model(exported_config(package));
  EXPECT_EQ(exported->architecture(), "exported");
  // The same parameters under the same names, bit for bit.
  std::map<std::string, torch::Tensor> theirs;
  for (const auto& p : exported->named_parameters()) theirs[p.key()] = p.value();
  ASSERT_EQ(theirs.size(), native->named_parameters().size());
  for (const auto& p : native->named_parameters()) {
    ASSERT_TRUE(theirs.count(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(theirs[p.key()], p.value())) << p.key();
  }
  const std::vector<double> want = train_losses(*native, 20);
  const std::vector<double> got = train_losses(*exported, 20);
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(want[i] - got[i]));
  EXPECT_LE(worst, 1e-6) << "native " << want.back() << " exported " << got.back();
  std::cout << fmt::format("20 steps: loss {:.6f} -> {:.6f}, max |native - exported| {:.3g}\n",
                           want.front(), want.back(), worst);
  EXPECT_LT(want.back(), want.front() - 0.1) << "the model learns";

  // Negative control: one node (layer 0's first projection) run under no-grad: its weight gets no
  // gradient, and the losses part from the native model's.
  auto broken = make_model(exported_config(package));
  set_exported_no_grad_op_for_test(*broken, "torch.ops.aten.linear.default");
  const std::vector<double> control = train_losses(*broken, 20);
  double apart = 0;
  for (size_t i = 0; i < want.size(); ++i) apart = std::max(apart, std::abs(want[i] - control[i]));
  EXPECT_GT(apart, 1e-4);
  std::cout << fmt::format("negative control (one linear under no-grad): max |difference| {:.3g}\n",
                           apart);
}

TEST(Exported, InspectAndMathFromTheGraph) {
  const fs::path package = llama_package();
  const std::string text = inspect_package(package);
  EXPECT_THAT(text, ::testing::HasSubstr("aten.scaled_dot_product_attention.default"));
  EXPECT_THAT(text, ::testing::HasSubstr("seq in [2,32]"));
  const ModelMath native = model_math(llama_config());
  const ModelMath ours = model_math(exported_config(package));
  EXPECT_EQ(ours.parameters, native.parameters);
  EXPECT_EQ(ours.flop_parameters, native.flop_parameters);
  EXPECT_EQ(ours.n_layer, native.n_layer);
  EXPECT_EQ(ours.attention_width, native.attention_width);
  EXPECT_EQ(model_vocab_size(exported_config(package)), 256);
}

// The one line Config::parse refuses `overrides` with (the config rules), or "".
std::string config_problem(const std::vector<std::string>& overrides) {
  try {
    Config::parse("", "x", overrides);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Exported, RefusesPackagesItCannotRun) {
  const fs::path shared = llama_package();
  auto refused = [](const Config& config) -> std::string {
    try {
      make_model(config);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  {  // A weight file changed after import.
    TempDir dir;
    const fs::path package = copy_package(shared, dir);
    std::fstream f(package / "weights.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
    f.close();
    EXPECT_THAT(refused(exported_config(package)),
                ::testing::HasSubstr("does not match its SHA-256"));
  }
  {  // Exported by another torch: refused by the config rules already (validate == train).
    TempDir dir;
    const fs::path package = copy_package(shared, dir);
    rewrite_manifest(package, [](json& m) { m["versions"]["torch"] = "2.9.0+cpu"; });
    EXPECT_THAT(config_problem(
                    {"model.name=exported", "data.name=text", "model.package=" + package.string()}),
                ::testing::HasSubstr("was exported with torch 2.9.0+cpu"));
  }
  {  // An operator this LibTorch has no schema for, named with its node.
    TempDir dir;
    const fs::path package = copy_package(shared, dir);
    std::string graph = read_file(package / "forward.json");
    const std::string op = "torch.ops.aten.silu.default";
    ASSERT_NE(graph.find(op), std::string::npos);
    graph.replace(graph.find(op), op.size(), "torch.ops.aten.kiln_no_such_op.default");
    write_text(package / "forward.json", graph);
    rewrite_manifest(package, [&](json& m) {
      m["graphs"][0]["sha256"] = sha256_file(package / "forward.json");
    });
    const std::string problem = refused(exported_config(package));
    EXPECT_THAT(problem, ::testing::HasSubstr("node 'silu'"));
    EXPECT_THAT(problem,
                ::testing::HasSubstr("torch.ops.aten.kiln_no_such_op.default has no schema"));
  }
  {  // A sequence longer than exported: the config rule, and the forward itself.
    EXPECT_THAT(config_problem({"model.name=exported", "data.name=text", "data.seq_len=40",
                                "model.package=" + shared.string()}),
                ::testing::HasSubstr("data.seq_len = 40 is outside the sequence range [2, 32]"));
    auto model = make_model(exported_config(shared));
    try {
      model->forward(torch::zeros({2, 40}, torch::kLong));
      ADD_FAILURE() << "a sequence of 40 ran";
    } catch (const UserError& e) {
      EXPECT_THAT(e.what(),
                  ::testing::HasSubstr("dimension 1 is 40, outside the exported range [2, 32]"));
    }
  }
  {  // No package at all.
    EXPECT_THAT(config_problem({"model.name=exported", "data.name=text"}),
                ::testing::HasSubstr("needs model.package = DIR"));
  }
}

}  // namespace
}  // namespace kiln::testing
