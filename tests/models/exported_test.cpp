// Exported programs (src/models/exported.cpp): kiln's own llama twin exported by `kiln model
// import` and trained from its package against kiln's native C++ llama from the same weights,
// and each refusal of a package kiln cannot run.
#include "models/exported.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <iostream>
#include <map>

#include "ckpt/thread_comm.h"
#include "core/files.h"
#include "kiln/build_info.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/models.h"
#include "kiln/safetensors.h"
#include "kiln/train.h"
#include "support/compose.h"
#include "support/helpers.h"
#include "train/activation_checkpointing.h"

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
  const FileLock lock(root / ".lock");
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

// Counts each unit's forward calls (inside every wrapper added before it).
struct CountingWrapper : UnitWrapper {
  std::map<int, int> calls;
  torch::Tensor run(int unit, const UnitForward& forward, const torch::Tensor& input) override {
    ++calls[unit];
    return forward(input);
  }
};

TEST(Exported, UnitsAreTheNativeModelsAndActivationCheckpointingRecomputesThem) {
  const fs::path package = llama_package();
  auto native = make_model(llama_config());
  auto exported = make_model(exported_config(package));
  // The decoder layers, as the native llama names them, with the same parameters.
  const std::vector<ModelUnit> want = native->units(), got = exported->units();
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(got[k].name, want[k].name);
    std::vector<std::string> a = want[k].parameters, b = got[k].parameters;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    EXPECT_EQ(b, a) << want[k].name;
  }
  EXPECT_EQ(model_math(exported_config(package)).largest_unit_parameters,
            model_math(llama_config()).largest_unit_parameters);

  // Activation checkpointing around each unit: the same losses bit for bit, and every unit's
  // forward runs twice a step (forward, then recomputed in backward).
  const std::vector<double> plain = train_losses(*exported, 6);
  auto checkpointed = make_model(exported_config(package));
  checkpointed->add_unit_wrapper(
      make_activation_checkpointing(*checkpointed, checkpointed->units()));
  auto counter = std::make_shared<CountingWrapper>();
  checkpointed->add_unit_wrapper(counter);
  EXPECT_EQ(train_losses(*checkpointed, 6), plain);
  ASSERT_EQ(counter->calls.size(), want.size());
  for (const auto& [unit, calls] : counter->calls) EXPECT_EQ(calls, 12) << "unit " << unit;
  const std::vector<double> reference = train_losses(*native, 6);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_NEAR(plain[i], reference[i], 1e-6);

  // Negative control: the same package imported with --units none has no units, and no wrapper
  // runs.
  TempDir dir;
  const fs::path whole = copy_package(package, dir);
  rewrite_manifest(whole, [](json& m) { m["units"] = nullptr; });
  auto undivided = make_model(exported_config(whole));
  EXPECT_TRUE(undivided->units().empty());
  auto idle = std::make_shared<CountingWrapper>();
  undivided->add_unit_wrapper(idle);
  EXPECT_EQ(train_losses(*undivided, 6), plain);
  EXPECT_TRUE(idle->calls.empty());
}

TEST(Exported, FsdpShardsEachUnitAndMatchesOneProcess) {
  const fs::path package = llama_package();
  auto config = [&](int64_t batch, bool checkpointing) {
    return Config::parse(
        "", "x",
        {"model.name=exported", "data.name=text", "data.seq_len=16", "data.num_workers=0",
         "model.package=" + package.string(), "train.batch_size=" + std::to_string(batch),
         std::string("train.activation_checkpointing=") + (checkpointing ? "block" : "none")});
  };
  auto single = [&](const Config& c) {
    apply_runtime_settings(c);
    Trainer trainer(TrainerSetup::from_config(c), make_model(c), make_datasets(c));
    std::vector<double> losses;
    for (int k = 0; k < 5; ++k) losses.push_back(trainer.train_step().loss);
    return losses;
  };
  const std::vector<double> want = single(config(8, false));
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "with activation checkpointing" : "without");
    const Config c = config(4, checkpointing);
    std::vector<std::vector<double>> losses(2);
    std::vector<std::vector<std::string>> groups(2);
    run_ranks(2, [&](Communicator& borrowed) {
      const int rank = borrowed.rank();
      std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
      Trainer trainer(TrainerSetup::from_config(c), make_model(c), make_datasets(c),
                      TrainerOptions{torch::kCPU, rank, 2, comm});
      install_configured_checkpointing(trainer);
      auto fsdp = FullyShardedDataParallel::attach(trainer, comm, FsdpOptions{});
      for (int k = 0; k < 5; ++k) losses[rank].push_back(trainer.train_step().loss);
      groups[rank] = fsdp->group_names();
    });
    // A group per decoder layer and the root (embeddings, final norm, head).
    EXPECT_EQ(groups[0].size(), 3u);
    EXPECT_EQ(losses[1], losses[0]);
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_NEAR(losses[0][k], want[k], 1e-5 * std::abs(want[k])) << "step " << k + 1;
    }
  }
}

TEST(Exported, RefusesUnitsThatDoNotSplitTheGraph) {
  TempDir dir;
  const fs::path package = copy_package(llama_package(), dir);
  rewrite_manifest(package,
                   [](json& m) { m["units"] = {{"prefix", "model.layers"}, {"count", 3}}; });
  try {
    make_model(exported_config(package));
    ADD_FAILURE() << "three units of a two-layer graph";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(),
                ::testing::HasSubstr("no node of the graph runs in module model.layers.2"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("re-import with --units none"));
  }
  // --units naming a module that is not a list: refused before anything is exported.
  ImportOptions options;
  options.module =
      (fs::path(KILN_SOURCE_DIR) / "python" / "kiln_py" / "models.py").string() + ":build";
  json spec = make_model(llama_config())->describe();
  spec["name"] = "llama";
  options.options = {{"spec", spec}};
  options.out = dir / "units";
  options.max_seq = 32;
  options.units = "model.norm";
  options.python = build_info().python;
  try {
    import_model(options);
    ADD_FAILURE() << "--units model.norm imported";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("--units 'model.norm'"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("not a non-empty nn.ModuleList"));
  }
  EXPECT_FALSE(fs::exists(dir / "units"));
}

TEST(Exported, AGraphThatWritesABufferTrainsEagerAndIsRefusedCompiled) {
  TempDir dir;
  write_text(dir / "counting.py", R"(import torch


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 16)
        self.head = torch.nn.Linear(16, 256)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, idx):
        self.seen.add_(1)
        return self.head(self.embed(idx))


def build():
    return Counting()
)");
  ImportOptions options;
  options.module = (dir / "counting.py").string() + ":build";
  options.out = dir / "package";
  options.max_seq = 16;
  options.units = "none";
  options.python = build_info().python;
  import_model(options);
  // Eager: the graph's buffer mutation is applied after each forward.
  auto model = make_model(exported_config(dir / "package"));
  model->forward(torch::zeros({2, 8}, torch::kLong));
  model->forward(torch::zeros({2, 8}, torch::kLong));
  EXPECT_EQ(model->named_buffers()["seen"].item<double>(), 2.0);
  // Compiled: the step binds buffers read-only, so the config rule refuses it.
  EXPECT_THAT(
      config_problem({"model.name=exported", "data.name=text", "data.seq_len=16",
                      "model.package=" + (dir / "package").string(), "compile.backend=inductor"}),
      ::testing::HasSubstr("writes buffer 'seen' in its forward"));
  EXPECT_EQ(config_problem({"model.name=exported", "data.name=text", "data.seq_len=16",
                            "model.package=" + (dir / "package").string()}),
            "");
}

}  // namespace
}  // namespace kiln::testing
