// `kiln train` as a library function (kiln/training_run.h): the one path every training process
// takes, the CLI's, the rungs' child processes' and a program of one's own.
#include "kiln/training_run.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/strings.h"
#include "data/tokens.h"
#include "kiln/checkpoint.h"
#include "kiln/data.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/job.h"
#include "kiln/log.h"
#include "kiln/models.h"
#include "kiln/session.h"
#include "rungs/device_rate.h"

namespace kiln {

void check_job_inputs(const Config& config) {
  resolve_device(config);  // run.device = "cuda" without a device: the line the run stops with
  const DataSource source = DataSource::from_config(config);
  const std::string& data = source.name;
  const std::string& path = source.path;
  std::error_code ec;
  if (data == "text" && !path.empty() && !std::filesystem::exists(path, ec)) {
    throw UserError("data.path = \"" + path +
                    "\" does not exist; point it at a text file or directory");
  }
  if (data != "tokens") return;
  // A directory from `kiln data prepare`: its tokenizer must fit the model (data.json only).
  if (std::filesystem::is_directory(path, ec))
    check_prepared_vocabulary(path, model_vocab_size(config));
  for (const std::string& file : {path, source.val_path}) {
    if (file.empty() || std::filesystem::is_directory(file, ec)) continue;  // a prepared directory
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);  // opened, never read or hashed
    if (fd < 0) {
      throw UserError("token file " + file + " cannot be opened: " + std::strerror(errno) +
                      "; check data.path / data.val_path");
    }
    ::close(fd);
  }
}

TrainingRunResult run_training(const Config& config, const TrainingRunOptions& options) {
  // Resolved once, before anything is written: the directories, the resume target (located,
  // its index read, its checkpoint settings kept except the keys set), every options struct.
  const Job job = resolve_job(config, options);
  check_job_inputs(job.config);     // run.device, data.path: as `kiln config validate`
  check_compile_start(job.config);  // compile.backend: Python, torch, cache (writes nothing)
  // The run composed (kiln/job.h): one lock, one model, the resume checked before the run
  // directory opens (bad input writes nothing; a resumed run appends to its metrics.jsonl; a
  // fresh one does not mix with another run's records: refused, or moved aside with overwrite
  // and resume = "auto" finding no checkpoint), then the step and the hooks.
  TrainingComposition composition;
  composition.checkpointing = true;
  composition.preemption = true;
  composition.tensorboard = true;
  composition.plan_tracking = true;
  composition.check_records = true;
  auto session = compose_training(job, nullptr, composition);
  // A layout asked for where there is none to run: said, not silently trained alone.
  if (!session->comm->parallel() && job.group.strategy != ProcessGroupOptions::Strategy::kAuto) {
    log::warn(fmt::format(
        "dist.strategy = \"{}\" but this is one process without a launcher: it trains alone, "
        "unreplicated and unsharded; start it under torchrun (torchrun --no-python "
        "--nproc-per-node=N kiln train CONFIG) or kiln scale to run {}",
        to_string(job.group.strategy), to_string(job.group.strategy)));
  }
  TrainingRunResult result;
  result.run_dir = session->run->dir();
  result.saved_nothing = job.checkpoint.every_steps <= 0;
  if (session->trainer->step() >= job.last_step()) {
    // Resumed at (or past) the step it would train to: nothing to train, no record appended.
    result.already_at_step = session->trainer->step();
    result.summary.steps = 0;
    return result;
  }
  // train.stop_after_step: this process ends early (evaluation and final save as at the end);
  // the schedule, read from train.steps by the Trainer, still spans the whole job.
  result.summary = session->trainer->fit(job.last_step(), session->run.get());
  result.run_dir = session->run->dir();
  if (session->compiled) result.compile_report = session->compiled->report();
  // MFU on every device: against the catalog's peak where a row matches, and against the
  // job's GEMM timed here (on a CPU, the one that means something), after training.
  Trainer& trainer = *session->trainer;
  result.achieved_flops_per_second =
      trainer.model().train_flops_per_sample(trainer.data().train->tokens_per_sample()) *
      result.summary.samples_per_second;
  std::string source;
  result.catalog_peak_flops_per_second = run_catalog_peak_flops(
      job.config, session->run->dir() / session->run->manifest_file(), session->device, source);
  if (result.summary.seconds >= TrainingRunResult::kRateMinSeconds) {
    if (auto matmul = time_job_matmul(job.config, session->device, 0.05, "train"))
      result.matmul_peak_flops_per_second = matmul->flops_per_second;
  }
  return result;
}

std::string training_summary_text(const TrainingRunResult& result) {
  if (result.already_at_step >= 0) {
    return fmt::format(
        "\nnothing to train: the run resumed at step {}, the step it trains to; raise "
        "train.steps (--set train.steps=N) to train on, or start afresh with --overwrite\nrun "
        "directory: {}\n",
        result.already_at_step, result.run_dir.string());
  }
  const TrainSummary& s = result.summary;
  const bool tokens = s.tokens_per_second > 0;
  // The loss at the end: one step's is noisy, so the mean of the last steps, saying so.
  const std::string end_loss =
      s.last_loss_mean_steps > 1
          ? fmt::format("{:.4f} (mean of the last {} steps; the last {:.4f})", s.last_loss_mean,
                        s.last_loss_mean_steps, s.last_loss)
          : fmt::format("{:.4f}", s.last_loss);
  std::string out = fmt::format(
      "\ntrained {} steps in {} | loss {:.4f} -> {} | val_loss {:.4f}{} | {:.0f} {}\n", s.steps,
      format_duration(s.seconds), s.first_loss, end_loss, s.final_eval.loss,
      s.final_eval.accuracy >= 0
          ? fmt::format(" | val_accuracy {:.2f}%", 100 * s.final_eval.accuracy)
          : "",
      tokens ? s.tokens_per_second : s.samples_per_second, tokens ? "tokens/s" : "samples/s");
  if (s.skipped_steps > 0) out += fmt::format("skipped {} non-finite steps\n", s.skipped_steps);
  if (result.achieved_flops_per_second > 0 &&
      (result.catalog_peak_flops_per_second > 0 || result.matmul_peak_flops_per_second > 0)) {
    std::vector<std::string> against;
    if (result.catalog_peak_flops_per_second > 0) {
      against.push_back(fmt::format(
          "MFU {:.1f}% of the catalog peak",
          100 * result.achieved_flops_per_second / result.catalog_peak_flops_per_second));
    }
    if (result.matmul_peak_flops_per_second > 0) {
      against.push_back(
          fmt::format("{:.1f}% of this device's measured matmul ({:.3g} FLOP/s)",
                      100 * result.achieved_flops_per_second / result.matmul_peak_flops_per_second,
                      result.matmul_peak_flops_per_second));
    }
    out += fmt::format("{:.3g} FLOP/s per device: {}\n", result.achieved_flops_per_second,
                       fmt::join(against, ", "));
  }
  if (result.compile_report) {
    const CompileReport& report = *result.compile_report;
    if (report.granularity == "unit") {  // per-unit packages, the root's pieces (compile.root)
      size_t pairs = 0, root_entries = 0, root_pieces = 0;
      for (const auto& u : report.unit_graphs) {
        pairs += u.shared ? 0 : 1;
        root_entries += u.unit.starts_with("root.") ? 1 : 0;
        root_pieces += u.unit.starts_with("root.") && !u.eager ? 1 : 0;
      }
      out += fmt::format(
          "compiled units: {}, {} unit(s) (per input shape) on {} forward/backward package "
          "pair(s), {} "
          "compiled unit forward(s), {} eager unit call(s), {} unit recompile(s); the root "
          "(embeddings, head, loss) {}\n",
          report.backend, report.unit_graphs.size() - root_entries, pairs,
          report.compiled_unit_forwards, report.eager_unit_calls, report.unit_recompiles,
          root_pieces ? fmt::format("compiled ({} piece(s))", root_pieces) : "eager");
    } else {
      out += fmt::format(
          "compiled step: {}, {} graph(s), {} recompile(s); eval: {} graph(s), {} recompile(s){}\n",
          report.backend, report.graphs.size(), report.recompiles.size(), report.eval_graphs.size(),
          report.eval_recompiles.size(),
          report.fallback_to_eager ? ", graph breaks: ran eager" : "");
    }
  }
  if (result.saved_nothing) {
    out +=
        "nothing saved (checkpoint.every_steps = 0): add --set checkpoint.every_steps=N to keep "
        "the trained state (the last step is saved too) for kiln export and --resume\n";
  }
  out += fmt::format("run directory: {}\n", result.run_dir.string());
  return out;
}

namespace {

// The training command a rung's child process runs: `train CONFIG [--set K=V]... [--resume R]
// [--overwrite]` (argv[1] onwards). Throws UserError for anything else after "train".
struct TrainingCommandLine {
  std::string config_path;
  std::vector<std::string> overrides;
  TrainingRunOptions options;
};

TrainingCommandLine parse_training_command_line(int argc, char** argv) {
  TrainingCommandLine out;
  for (int k = 0; k < argc; ++k) out.options.argv.emplace_back(argv[k]);
  for (int k = 2; k < argc; ++k) {
    const std::string arg = argv[k];
    auto value = [&](const std::string& flag) -> std::string {
      if (arg.size() > flag.size() && arg.starts_with(flag + "="))
        return arg.substr(flag.size() + 1);
      if (k + 1 >= argc) throw UserError(flag + " needs a value");
      return argv[++k];
    };
    if (arg == "--set" || arg.starts_with("--set=")) {
      out.overrides.push_back(value("--set"));
      const std::string& o = out.overrides.back();
      out.options.set_keys.emplace_back(trim(o.substr(0, o.find('='))));
    } else if (arg == "--resume" || arg.starts_with("--resume=")) {
      out.options.resume = value("--resume");
    } else if (arg == "--overwrite") {
      out.options.overwrite = true;
    } else if (out.config_path.empty() && !arg.starts_with("-")) {
      out.config_path = arg;
    } else {
      throw UserError(
          fmt::format("{} train: unknown argument '{}' (train CONFIG [--set "
                      "KEY=VALUE]... [--resume auto|CHECKPOINT] [--overwrite])",
                      argv[0], arg));
    }
  }
  if (out.config_path.empty()) throw UserError(fmt::format("{} train: give a config", argv[0]));
  return out;
}

}  // namespace

std::optional<int> serve_training_command(int argc, char** argv) {
  // The rungs start this program for their child training processes (kiln_executable()).
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) ::setenv("KILN_EXECUTABLE", self.c_str(), /*overwrite=*/0);
  if (argc < 2 || std::string(argv[1]) != "train") return std::nullopt;
  const std::string program = std::filesystem::path(argv[0]).filename().string();
  try {
    const TrainingCommandLine command = parse_training_command_line(argc, argv);
    const Config config = Config::load(command.config_path, command.overrides);
    const TrainingRunResult result = run_training(config, command.options);
    std::fputs(training_summary_text(result).c_str(), stdout);
    std::fflush(stdout);
    return kExitOk;
  } catch (const Preempted& e) {
    std::fprintf(stderr, "%s: preempted: %s\n", program.c_str(), one_line_error(e).c_str());
    return kExitPreempted;
  } catch (const UserError& e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), one_line_error(e).c_str());
    return kExitUserError;
  } catch (const TrainingError& e) {
    std::fprintf(stderr, "%s: stopped: %s\n", program.c_str(), one_line_error(e).c_str());
    return kExitGateFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", program.c_str(), one_line_error(e).c_str());
    return kExitInternal;
  }
}

}  // namespace kiln
