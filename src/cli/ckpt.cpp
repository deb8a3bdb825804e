// `kiln ckpt list|inspect|verify|consolidate|drill`: look at, check and export checkpoints
// (docs/checkpoint.md). Single-process; the checkpoint library does the work.
#include <fmt/format.h>

#include "cli/commands.h"
#include "core/files.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/error.h"
#include "kiln/rungs.h"
#include "kiln/safetensors.h"

namespace kiln::cli {

namespace {

int list_command(const std::string& dir) {
  const auto entries = list_checkpoints(dir);
  if (entries.empty()) throw UserError(dir + " holds no checkpoints (no step-<N>/ directories)");
  std::string latest;
  try {
    latest = std::string(trim(read_file(std::filesystem::path(dir) / "latest")));
  } catch (const UserError&) {
  }
  fmt::print("{:>10}  {:<10}  {:>5}  {:>10}  {}\n", "step", "state", "world", "size",
             "created (UTC)");
  for (const auto& entry : entries) {
    if (!entry.committed) {
      fmt::print("{:>10}  {:<10}  {:>5}  {:>10}  {}\n", entry.step, "incomplete", "-", "-",
                 "a save in progress or killed: never loaded");
      continue;
    }
    try {
      const CheckpointIndex index = read_checkpoint_index(entry.path);
      const bool is_latest = entry.path.filename().string() == latest;
      fmt::print("{:>10}  {:<10}  {:>5}  {:>10}  {}{}\n", entry.step, "committed", index.world_size,
                 format_bytes(static_cast<double>(index.total_file_bytes())), index.created_utc,
                 is_latest ? "  (latest)" : "");
    } catch (const std::exception& e) {
      fmt::print("{:>10}  {:<10}  {:>5}  {:>10}  {}\n", entry.step, "invalid", "-", "-",
                 one_line_error(e));
    }
  }
  return 0;
}

int inspect_command(const std::string& path) {
  const auto step_dir = resolve_checkpoint_path(path);
  const CheckpointIndex index = read_checkpoint_index(step_dir);
  fmt::print("checkpoint {}\n", step_dir.string());
  fmt::print("step {} | world size {} at save | format version {} | created {}\n", index.step,
             index.world_size, index.format_version, index.created_utc);
  // The training state is free-form JSON (checksummed, but written by whoever wrote the index):
  // show what is there, whatever its type.
  auto show = [](const nlohmann::json& object, const char* key) -> std::string {
    if (!object.is_object() || !object.contains(key)) return "?";
    const auto& v = object[key];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number_float()) return fmt::format("{:.6g}", v.get<double>());
    return v.dump();
  };
  const auto& state = index.training_state;
  const nlohmann::json lr = state.contains("lr_schedule") ? state["lr_schedule"] : nlohmann::json();
  const nlohmann::json manifest =
      state.contains("run_manifest") ? state["run_manifest"] : nlohmann::json();
  fmt::print(
      "training state: epoch {} | optimizer steps {} | next lr {} ({}) | config {} | manifest {}\n",
      show(state, "epoch"), show(state, "optimizer_steps"), show(lr, "next_lr"),
      show(lr, "schedule"), show(state, "config_hash"), show(manifest, "path"));
  for (size_t r = 0; r < index.ranks.size(); ++r) {
    const nlohmann::json loader = index.ranks[r].is_object() && index.ranks[r].contains("loader")
                                      ? index.ranks[r]["loader"]
                                      : nlohmann::json();
    if (loader.is_object()) {
      fmt::print("rank {}: loader at epoch {} batch {}\n", r, show(loader, "epoch"),
                 show(loader, "batch"));
    }
  }
  fmt::print("\nfiles ({}):\n", format_bytes(static_cast<double>(index.total_file_bytes())));
  for (const auto& f : index.files) {
    fmt::print("  {:<24} rank {:<4} {:>12}  xxh3 {}\n", f.name, f.rank,
               format_bytes(static_cast<double>(f.size_bytes)), hex64(f.xxh3));
  }
  uint64_t total = 0;
  for (const auto& t : index.tensors) total += t.bytes();
  fmt::print("\ntensors ({}, {}):\n", index.tensors.size(),
             format_bytes(static_cast<double>(total)));
  for (const auto& t : index.tensors) {
    std::string where;
    for (const auto& c : t.chunks) {
      if (!where.empty()) where += ",";
      where.append(c.file, 0, std::min(c.file.size(), c.file.find(".safetensors")));
    }
    fmt::print("  {:<48} {:<5} {:<16} {:>10}  {} in {}\n", t.name, safetensors_dtype(t.dtype),
               shape_text(t.shape), format_bytes(static_cast<double>(t.bytes())),
               t.placement == Placement::kReplicated ? "replicated"
                                                     : fmt::format("sharded x{}", t.chunks.size()),
               where);
  }
  return 0;
}

int verify_command(const std::string& path) {
  const auto step_dir = resolve_checkpoint_path(path);
  const VerifyReport report = verify_checkpoint(step_dir);
  if (!report.ok()) {
    for (const auto& problem : report.problems) fmt::print("FAILED: {}\n", problem);
    const size_t n = report.problems.size();
    throw UserError(step_dir.string() + " failed verification (" + std::to_string(n) +
                    (n == 1 ? " problem" : " problems") +
                    "); resume would skip it and fall back to an older checkpoint");
  }
  const CheckpointIndex index = read_checkpoint_index(step_dir);
  fmt::print("ok: {} | {} files, {} checked (xxh3, headers, {} tensors)\n", step_dir.string(),
             index.files.size(), format_bytes(static_cast<double>(report.bytes_checked)),
             index.tensors.size());
  return 0;
}

void add_ckpt_command(CLI::App& app, Action& action) {
  auto* ckpt = app.add_subcommand(
      "ckpt", "list, inspect, verify and consolidate checkpoints; the restore drill");
  ckpt->require_subcommand(1);

  auto list_dir = std::make_shared<std::string>();
  auto* list =
      ckpt->add_subcommand("list", "the checkpoints in a directory: step, state, world size, size");
  list->add_option("dir", *list_dir, "checkpoint directory (e.g. runs/<name>/checkpoints)")
      ->required();
  list->callback([&action, list_dir] { action = [list_dir] { return list_command(*list_dir); }; });

  auto inspect_path = std::make_shared<std::string>();
  auto* inspect =
      ckpt->add_subcommand("inspect", "tensors, shapes, bytes, step, world size, training state");
  inspect
      ->add_option("ckpt", *inspect_path,
                   "a step-<N> directory, or a checkpoint directory (its newest)")
      ->required();
  inspect->callback([&action, inspect_path] {
    action = [inspect_path] { return inspect_command(*inspect_path); };
  });

  auto verify_path = std::make_shared<std::string>();
  auto* verify = ckpt->add_subcommand(
      "verify", "check every file's size and xxh3 and every header; non-zero exit on a mismatch");
  verify
      ->add_option("ckpt", *verify_path,
                   "a step-<N> directory, or a checkpoint directory (its newest)")
      ->required();
  verify->callback(
      [&action, verify_path] { action = [verify_path] { return verify_command(*verify_path); }; });

  struct ConsolidateArgs {
    std::string path, out;
    bool optimizer = false;
  };
  auto consolidate_args = std::make_shared<ConsolidateArgs>();
  auto* consolidate =
      ckpt->add_subcommand("consolidate", "the whole model in one standard safetensors file");
  consolidate
      ->add_option("ckpt", consolidate_args->path,
                   "a step-<N> directory, or a checkpoint directory")
      ->required();
  consolidate->add_option("out", consolidate_args->out, "output .safetensors file")->required();
  consolidate->add_flag("--optimizer", consolidate_args->optimizer,
                        "also write the optimizer state (optim/...)");
  consolidate->callback([&action, consolidate_args] {
    action = [consolidate_args] {
      const auto step_dir = resolve_checkpoint_path(consolidate_args->path);
      const int64_t n =
          consolidate_checkpoint(step_dir, consolidate_args->out, consolidate_args->optimizer);
      fmt::print("wrote {} tensors of {} to {}\n", n, step_dir.string(), consolidate_args->out);
      return 0;
    };
  });

  auto drill_args = std::make_shared<ConfigArgs>();
  auto* drill = ckpt->add_subcommand(
      "drill", "the checkpoint rung: save, SIGKILL, restore in a fresh process, compare");
  drill_args->add_to(*drill);
  drill->callback([&action, drill_args] {
    action = [drill_args] {
      RungResult result = run_checkpoint_drill(drill_args->load(), {process_argv()});
      print_rung(result);
      if (!result.passed) throw TrainingError("checkpoint drill failed: " + result.verdict);
      return 0;
    };
  });
}

const Registration ckpt_registration{60, add_ckpt_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
