// Your own model and dataset on kiln's ladder, from a program of your own that links an installed
// kiln (find_package(kiln)). It reads top to bottom in the order data flows:
//   1. the dataset: points on concentric shells, the class is the shell (ShellsDataset)
//   2. the model: a residual MLP whose blocks are units (ResidualMlp)
//   3. their registrations: register_dataset("shells"), register_model("resmlp")
//   4. main(): `train` is kiln train on this program's model; `ladder` runs the rungs
// B = batch, D = input features (model.input_dim), W = width (model.hidden_dim),
// C = classes (model.num_classes), K = residual blocks (model.blocks, a key this model adds).
#include <ATen/CPUGeneratorImpl.h>
#include <kiln/dataset_registry.h>
#include <kiln/error.h>
#include <kiln/models.h>
#include <kiln/rungs.h>
#include <kiln/training_run.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

namespace nn = torch::nn;

// ---- 1. the dataset -----------------------------------------------------------------------------

// N samples held in memory: inputs [N, D] float32, targets [N] int64.
class ShellsDataset final : public kiln::Dataset {
 public:
  ShellsDataset(torch::Tensor inputs, torch::Tensor targets)
      : inputs_(std::move(inputs)), targets_(std::move(targets)) {}
  int64_t size() const override { return inputs_.size(0); }
  int64_t tokens_per_sample() const override { return 0; }  // feature vectors, not tokens
  // Called from kiln's loader threads at once: it only reads, and copies rows with memcpy (no
  // ATen kernel, so no OpenMP team, runs on a loader thread).
  kiln::Batch get(const std::vector<int64_t>& indices) const override {
    const int64_t batch = static_cast<int64_t>(indices.size()), dim = inputs_.size(1);
    auto inputs = torch::empty({batch, dim}, inputs_.options());  // [B, D]
    auto targets = torch::empty({batch}, targets_.options());     // [B]
    for (int64_t row = 0; row < batch; ++row) {
      std::memcpy(inputs.data_ptr<float>() + row * dim,
                  inputs_.data_ptr<float>() + indices[row] * dim,
                  sizeof(float) * static_cast<size_t>(dim));
      targets.data_ptr<int64_t>()[row] = targets_.data_ptr<int64_t>()[indices[row]];
    }
    return {inputs, targets};
  }

 private:
  torch::Tensor inputs_, targets_;
};

// x = r * u with u uniform on the unit sphere in D dimensions and r uniform in [0, C): the class
// is floor(r), the shell x lies on. The same data seed gives the same bits (resume compares them).
kiln::Datasets make_shells(const kiln::Config& config) {
  const int64_t dim = config.get_int("data.dim"), classes = config.get_int("data.shells");
  const int64_t seed =
      config.get_int("data.seed") != 0 ? config.get_int("data.seed") : config.get_int("run.seed");
  auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  auto make = [&](int64_t count) {
    auto direction = torch::randn({count, dim}, generator);  // [N, D]
    direction = direction / direction.norm(2, /*dim=*/{1}, /*keepdim=*/true);
    auto radius = torch::rand({count}, generator) * static_cast<double>(classes);  // [N]
    auto inputs = (direction * radius.unsqueeze(1)).contiguous();
    auto targets = radius.floor().to(torch::kInt64).clamp_max(classes - 1).contiguous();
    return std::make_shared<ShellsDataset>(inputs, targets);
  };
  kiln::Datasets out;
  out.train = make(config.get_int("data.num_samples"));
  out.val = make(config.get_int("data.val_samples"));
  out.identity = {{"kind", "shells"},
                  {"generator", "x = r u, u uniform on the sphere, r ~ U[0, C), class floor(r)"},
                  {"input_dim", dim},
                  {"num_classes", classes},
                  {"seed", seed},
                  {"train_samples", out.train->size()},
                  {"val_samples", out.val->size()}};
  return out;
}

// ---- 2. the model -------------------------------------------------------------------------------

// x + fc2(gelu(fc1(norm(x)))): [B, W] -> [B, W].
class ResidualBlockImpl : public nn::Module {
 public:
  explicit ResidualBlockImpl(int64_t width) {
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({width})));
    fc1 = register_module("fc1", nn::Linear(width, 2 * width));
    fc2 = register_module("fc2", nn::Linear(2 * width, width));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + fc2->forward(torch::gelu(fc1->forward(norm->forward(x))));
  }
  nn::LayerNorm norm{nullptr};
  nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ResidualBlock);

class ResidualMlp final : public kiln::Model {
 public:
  ResidualMlp(int64_t input_dim, int64_t width, int64_t blocks, int64_t classes,
              at::Generator& generator)
      : input_dim_(input_dim), width_(width), classes_(classes) {
    embed_ = register_module("embed", nn::Linear(input_dim, width));
    blocks_ = register_module("blocks", nn::ModuleList());
    for (int64_t k = 0; k < blocks; ++k) blocks_->push_back(ResidualBlock(width));
    head_ = register_module("head", nn::Linear(width, classes));
    // The initial weights come from kiln's generator (seeded by run.seed): the same config gives
    // the same bits in every process, which the checkpoint drill and the pilot rely on.
    torch::NoGradGuard no_grad;
    for (auto& module : modules(/*include_self=*/false)) {
      if (auto* linear = module->as<nn::Linear>()) {
        const double bound = 1.0 / std::sqrt(static_cast<double>(linear->weight.size(1)));
        linear->weight.uniform_(-bound, bound, generator);
        linear->bias.zero_();
      }
    }
  }

  // [B, D] -> [B, C] logits. Each block runs through run_unit, so kiln's unit wrappers
  // (activation checkpointing, FSDP's gather and free) reach it; the forward a unit gets
  // captures its block by value, so a copy of it stays callable while the model lives.
  torch::Tensor forward(const torch::Tensor& inputs) override {
    auto hidden = embed_->forward(inputs);  // [B, W]
    for (size_t k = 0; k < blocks_->size(); ++k) {
      auto block = blocks_->ptr<ResidualBlockImpl>(k);
      hidden = run_unit(
          static_cast<int>(k), [block](const torch::Tensor& x) { return block->forward(x); },
          hidden);
    }
    return head_->forward(hidden);  // [B, C]
  }
  // loss(): kiln's default, the mean cross-entropy of the logits against the targets.
  std::string architecture() const override { return "resmlp"; }
  nlohmann::json describe() const override {
    return {{"input_dim", input_dim_},
            {"width", width_},
            {"blocks", blocks_->size()},
            {"num_classes", classes_}};
  }
  double train_flops_per_sample(int64_t /*seq_len*/) const override {
    return 6.0 * static_cast<double>(kiln::parameter_count(*this));  // every weight multiplies
  }
  // One unit per block ("blocks.<k>"), named as named_parameters() names its parameters; the
  // embedding and the head form the root group.
  std::vector<kiln::ModelUnit> units() const override {
    std::vector<kiln::ModelUnit> out;
    for (size_t k = 0; k < blocks_->size(); ++k) {
      kiln::ModelUnit unit{"blocks." + std::to_string(k), {}};
      for (const auto& item : blocks_->ptr(k)->named_parameters()) {
        unit.parameters.push_back(unit.name + "." + item.key());
      }
      out.push_back(std::move(unit));
    }
    return out;
  }

 private:
  int64_t input_dim_, width_, classes_;
  nn::Linear embed_{nullptr}, head_{nullptr};
  nn::ModuleList blocks_{nullptr};
};

// ---- 3. the registrations -----------------------------------------------------------------------

void register_shells_and_resmlp() {
  // The dataset's own keys, in the [data] section, and the rules that tie them to the model:
  // `kiln config validate` refuses a mismatch before anything is built.
  kiln::DatasetSpec shells;
  shells.name = "shells";
  shells.description = "points on data.shells concentric shells in data.dim dimensions";
  shells.build = make_shells;
  shells.keys = {{"data",
                  "dim",
                  kiln::ValueType::kInt,
                  int64_t{8},
                  1.0,
                  4096.0,
                  {},
                  "shells: dimensions of a point (model.input_dim must match)"},
                 {"data",
                  "shells",
                  kiln::ValueType::kInt,
                  int64_t{4},
                  2.0,
                  1000.0,
                  {},
                  "shells: concentric shells, one class each (model.num_classes must match)"}};
  auto matches = [](const char* data_key, const char* model_key) {
    return [data_key, model_key](const kiln::Config& c) -> std::string {
      if (c.get_string("data.name") != "shells" || c.get_int(data_key) == c.get_int(model_key))
        return "";
      return std::string(data_key) + " = " + std::to_string(c.get_int(data_key)) + " but " +
             model_key + " = " + std::to_string(c.get_int(model_key)) + "; set them equal";
    };
  };
  shells.rules = {{"shells: model.input_dim = data.dim",
                   matches("data.dim", "model.input_dim"),
                   {"data.name=shells", "data.dim=3"}},
                  {"shells: model.num_classes = data.shells",
                   matches("data.shells", "model.num_classes"),
                   {"data.name=shells", "data.shells=3"}}};
  kiln::register_dataset(std::move(shells));
  kiln::ModelSpec spec;
  spec.name = "resmlp";
  spec.description = "residual MLP: input_dim -> hidden_dim, model.blocks residual blocks, head";
  spec.input = kiln::ModelInput::kFeatures;
  spec.build = [](const kiln::Config& config,
                  at::Generator& generator) -> std::shared_ptr<kiln::Model> {
    return std::make_shared<ResidualMlp>(
        config.get_int("model.input_dim"), config.get_int("model.hidden_dim"),
        config.get_int("model.blocks"), config.get_int("model.num_classes"), generator);
  };
  // Its size and cost without building it (kiln plan): W(D+1) + K(4W^2 + 5W) + C(W+1).
  spec.math = [](const kiln::Config& config) {
    const int64_t d = config.get_int("model.input_dim"), w = config.get_int("model.hidden_dim"),
                  k = config.get_int("model.blocks"), c = config.get_int("model.num_classes");
    kiln::ModelMath math;
    const int64_t block = 4 * w * w + 5 * w;  // norm 2W, fc1 2W^2 + 2W, fc2 2W^2 + W
    math.parameters = w * (d + 1) + k * block + c * (w + 1);
    math.largest_unit_parameters = std::max(block, w * (d + 1) + c * (w + 1));
    math.flop_parameters = math.parameters;
    // What autograd saves per sample, for the memory estimate (the pilot's gate): a block keeps
    // its input (LayerNorm's, with its mean and rstd), fc1's input, GELU's input and fc2's
    // input: W + 2 + W + 2W + 2W; outside the blocks, embed's input D, the head's input W and
    // the loss's log-softmax and logits, 2C. Under checkpointing a block keeps its input W.
    math.unit_activation_elements_per_sample = static_cast<double>(6 * w + 2);
    math.unit_input_elements_per_sample = static_cast<double>(w);
    math.activation_elements_per_sample = static_cast<double>(d + k * (6 * w + 2) + w + 2 * c);
    math.units = k;
    return math;
  };
  // A key of its own, in the [model] section (registered before the first config is read).
  spec.keys = {{"model",
                "blocks",
                kiln::ValueType::kInt,
                int64_t{2},
                1.0,
                64.0,
                {},
                "resmlp: residual blocks (each one unit)"}};
  // No python_twin: the compile rung refuses the model with one line (compile.backend = "eager").
  kiln::register_model(std::move(spec));
}

int usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s train CONFIG [--set KEY=VALUE]... [--resume auto|CHECKPOINT]\n"
               "       %s ladder CONFIG [--set KEY=VALUE]...\n",
               program, program);
  return kiln::kExitUserError;
}

}  // namespace

// ---- 4. main ------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  register_shells_and_resmlp();  // first: the config schema takes the dataset's and model's keys
  // `train`: kiln train on this program's model. The checkpoint drill and the pilot start this
  // program again with `train` for their fresh-process restores (KILN_EXECUTABLE is set to it).
  if (auto status = kiln::serve_training_command(argc, argv)) return *status;
  if (argc < 3 || std::strcmp(argv[1], "ladder") != 0) return usage(argv[0]);
  std::vector<std::string> overrides;
  for (int k = 3; k < argc; ++k) {
    if (std::strcmp(argv[k], "--set") != 0 || k + 1 == argc) return usage(argv[0]);
    overrides.emplace_back(argv[++k]);
  }
  try {
    const kiln::Config config = kiln::Config::load(argv[2], overrides);
    kiln::check_job_inputs(config);
    // baseline -> profile -> checkpoint drill -> pilot -> plan (compile and scale as the config
    // says); each rung prints its table and writes <run dir>/<rung>.json, and report.md at the end.
    const auto results =
        kiln::run_ladder(config, {.argv = std::vector<std::string>(argv, argv + argc)});
    for (const auto& result : results) {
      if (!result.passed) {
        std::fprintf(stderr, "%s: the %s rung failed: %s\n", argv[0], result.rung.c_str(),
                     result.verdict.c_str());
        return kiln::kExitGateFailed;
      }
    }
    std::printf("every rung passed: %zu rungs\n", results.size());
    return kiln::kExitOk;
  } catch (const kiln::UserError& e) {
    std::fprintf(stderr, "%s: error: %s\n", argv[0], e.what());
    return kiln::kExitUserError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return kiln::kExitGateFailed;
  }
}
