// `kiln model import` exports a PyTorch model (a Python factory, or a Hugging Face causal LM) into
// a data-only package; `kiln model inspect` prints one (docs/models.md "your PyTorch model").
#include <fmt/format.h>

#include <memory>

#include "cli/commands.h"
#include "kiln/compile.h"
#include "kiln/error.h"
#include "models/exported.h"

namespace kiln::cli {

namespace {

struct ImportArgs {
  std::string module, hf, options = "{}", weights, out, units;
  int64_t max_seq = 0, max_batch = 0;
};

int import_command(const ImportArgs& args) {
  ImportOptions options;
  options.module = args.module;
  options.hf = args.hf;
  try {
    options.options = nlohmann::json::parse(args.options);
  } catch (const nlohmann::json::exception&) {
    throw UserError(fmt::format("--options '{}' is not a JSON object (e.g. '{{\"width\": 64}}')",
                                args.options));
  }
  if (!options.options.is_object()) {
    throw UserError(fmt::format("--options '{}' is not a JSON object", args.options));
  }
  options.weights = args.weights;
  options.out = args.out;
  options.max_seq = args.max_seq;
  options.max_batch = args.max_batch;
  options.units = args.units;
  // The Python the compile step uses: compile.python's default, $KILN_PYTHON, the build's.
  options.python = CompileOptions::from_config(Config::defaults()).python;
  const nlohmann::json manifest = import_model(options);
  const nlohmann::json& graph = manifest["graphs"][0];
  fmt::print(
      "imported into {}: {} graph nodes, {} operators, {} weight tensors, vocabulary {}, "
      "in {:.1f} s\n",
      std::filesystem::absolute(args.out).lexically_normal().string(), graph.value("nodes", 0),
      graph["ops"].size(), manifest["weights"].value("tensors", 0),
      manifest["input"].value("vocab_size", int64_t{0}), manifest.value("export_seconds", 0.0));
  if (const nlohmann::json& units = manifest["units"]; units.is_object()) {
    fmt::print("units: {} x {} (activation checkpointing and FSDP wrap each)\n",
               units.value("prefix", ""), units.value("count", 0));
  } else {
    fmt::print("units: none ({})\n",
               manifest.value("units_problem", std::string("--units none, or no module list")));
  }
  fmt::print("train with --set model.name=exported --set model.package={}\n",
             std::filesystem::absolute(args.out).lexically_normal().string());
  return 0;
}

void add_model_command(CLI::App& app, Action& action) {
  auto* model = app.add_subcommand("model", "import a PyTorch model as a package kiln trains");
  model->require_subcommand(1);
  auto* import = model->add_subcommand(
      "import",
      "export a Python model (--module file.py:factory) or a Hugging Face causal LM (--hf DIR) "
      "with torch.export into a data-only package (docs/models.md)");
  auto args = std::make_shared<ImportArgs>();
  auto* source = import->add_option_group("source");
  source->add_option("--module", args->module,
                     "path/to/model.py:factory, called with --options; returns an nn.Module "
                     "whose forward maps token ids [B, T] to logits [B, T, V]");
  source->add_option("--hf", args->hf,
                     "a Hugging Face directory (config.json + safetensors) of a causal LM");
  source->require_option(1);
  import->add_option("--options", args->options, "the factory's keyword arguments, as JSON")
      ->capture_default_str();
  import->add_option("--weights", args->weights,
                     "a safetensors file whose tensors replace the initial weights by name");
  import->add_option("--out", args->out, "the package directory")->required();
  import->add_option("--max-seq", args->max_seq,
                     "the longest sequence the package takes (default: the HF config's context)");
  import->add_option("--max-batch", args->max_batch, "the largest batch (default 4096)");
  import->add_option("--units", args->units,
                     "the nn.ModuleList whose entries are the units activation checkpointing "
                     "and FSDP wrap (default: the list holding the most parameters; none: the "
                     "model whole)");
  import->callback([&action, args] { action = [args] { return import_command(*args); }; });

  auto* inspect = model->add_subcommand("inspect", "print what a model package holds");
  auto dir = std::make_shared<std::string>();
  inspect->add_option("package", *dir, "a directory `kiln model import` wrote")->required();
  inspect->callback([&action, dir] {
    action = [dir] {
      fmt::print("{}", inspect_package(*dir));
      return 0;
    };
  });
}

const Registration model_registration{91, add_model_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
