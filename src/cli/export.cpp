// `kiln export RUN_OR_CKPT --format hf OUT_DIR`: a run's newest checkpoint (or a given one) as a
// Hugging Face directory: GPT2LMHeadModel for gpt, LlamaForCausalLM for llama (docs/models.md).
// Single-process.
#include <fmt/format.h>

#include "cli/commands.h"
#include "core/files.h"
#include "kiln/checkpoint.h"
#include "kiln/comm.h"
#include "kiln/error.h"
#include "kiln/hf.h"
#include "kiln/models.h"

namespace kiln::cli {

namespace {

namespace fs = std::filesystem;

struct ExportArgs {
  std::string source, format = "hf", out;
  bool force = false;
};

// The run's config: the training run's own config.toml. The weights come from the checkpoint;
// model.init_from stays while its directory is there, since the shape may be its config.json's,
// and is dropped when it is gone (the shape is then the keys', checked against the checkpoint).
Config run_config(const fs::path& config_file) {
  try {
    return Config::load(config_file);
  } catch (const UserError&) {
    return Config::load(config_file, {"model.init_from="});
  }
}

int export_command(const ExportArgs& args) {
  const fs::path source = args.source;
  fs::path step_dir, config_file, manifest_file;
  std::error_code ec;
  if (fs::is_regular_file(source / "config.toml", ec)) {  // a run directory
    config_file = source / "config.toml";
    manifest_file = source / "manifest.json";
    const fs::path checkpoints = checkpoint_options(run_config(config_file), source).dir;
    if (list_checkpoints(checkpoints).empty()) {
      throw UserError(fmt::format(
          "export: run {} has no checkpoint in {}; train it with checkpoint.every_steps > 0 "
          "(the last step is saved too), or give a checkpoint directory",
          source.string(), checkpoints.string()));
    }
    step_dir = resolve_checkpoint_path(checkpoints);
  } else {  // a checkpoint directory or step-<N>: its run's config.toml, from the training state
    step_dir = resolve_checkpoint_path(source);
    const CheckpointIndex index = read_checkpoint_index(step_dir);
    const nlohmann::json& state = index.training_state;
    if (state.contains("run_manifest") && state["run_manifest"].contains("path") &&
        state["run_manifest"]["path"].is_string()) {
      manifest_file = state["run_manifest"]["path"].get<std::string>();
      config_file = manifest_file.parent_path() / "config.toml";
    }
    if (config_file.empty() || !fs::is_regular_file(config_file, ec)) {
      throw UserError(fmt::format(
          "export: cannot find the config.toml of the run that saved {} (looked for {}); give "
          "the run directory instead",
          step_dir.string(), config_file.empty() ? "<none recorded>" : config_file.string()));
    }
  }
  const Config config = run_config(config_file);
  auto model = make_model(config);
  std::vector<StateTensor> targets;
  for (const auto& item : model->named_parameters()) {
    targets.emplace_back("model/" + item.key(), item.value());
  }
  {
    torch::NoGradGuard no_grad;
    load_checkpoint(step_dir, targets, *single_process_communicator());
  }
  save_hf(*model, args.out, args.force);
  const nlohmann::json manifest =
      fs::is_regular_file(manifest_file, ec)
          ? nlohmann::json::parse(read_file(manifest_file), nullptr, /*allow_exceptions=*/false)
          : nlohmann::json();
  const std::string carried = write_hf_generation_files(args.out, manifest, model->init_from);
  fmt::print(
      "exported {} as a Hugging Face {} to {} (config.json, generation_config.json, "
      "model.safetensors); {}\n",
      step_dir.string(), model->architecture() == "llama" ? "LlamaForCausalLM" : "GPT2LMHeadModel",
      args.out, carried);
  return 0;
}

void add_export_command(CLI::App& app, Action& action) {
  auto args = std::make_shared<ExportArgs>();
  auto* command = app.add_subcommand(
      "export", "a run's newest checkpoint as a Hugging Face directory (gpt, llama)");
  command
      ->add_option("source", args->source,
                   "a run directory (its newest checkpoint), a checkpoint directory or step-<N>")
      ->required();
  command->add_option("--format", args->format, "export format")
      ->check(CLI::IsMember({"hf"}))
      ->required();
  command->add_option("out", args->out, "output directory (new or empty)")->required();
  command->add_flag("--force", args->force,
                    "write into a non-empty directory, replacing an earlier export there");
  command->callback([&action, args] { action = [args] { return export_command(*args); }; });
}

const Registration export_registration{70, add_export_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
