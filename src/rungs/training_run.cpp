// `kiln train` as a library function (kiln/training_run.h): the one path every training process
// takes, the CLI's, the rungs' child processes' and a program of one's own.
#include "kiln/training_run.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/records.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/plan.h"
#include "kiln/report.h"
#include "kiln/session.h"
#include "rungs/plan_tracking.h"

namespace kiln {

void check_job_inputs(const Config& config) {
  resolve_device(config);  // run.device = "cuda" without a device: the line the run stops with
  const std::string& data = config.get_string("data.name");
  const std::string& path = config.get_string("data.path");
  std::error_code ec;
  if (data == "text" && !path.empty() && !std::filesystem::exists(path, ec)) {
    throw UserError("data.path = \"" + path +
                    "\" does not exist; point it at a text file or directory");
  }
  if (data != "tokens") return;
  for (const std::string& file : {path, config.get_string("data.val_path")}) {
    if (file.empty() || std::filesystem::is_directory(file, ec)) continue;  // a prepared directory
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);  // opened, never read or hashed
    if (fd < 0) {
      throw UserError("token file " + file + " cannot be opened: " + std::strerror(errno) +
                      "; check data.path / data.val_path");
    }
    ::close(fd);
  }
}

TrainingRunResult run_training(const Config& given, const TrainingRunOptions& options) {
  if (options.overwrite && !options.resume.empty()) {
    throw UserError("--overwrite starts a run afresh and --resume continues one: give one");
  }
  // Before anything is written: resume keeps the saved run's checkpoint settings (the caller's
  // set keys win) and must name a checkpoint; run.device and data.path as `kiln config validate`.
  const Config config = resume_config(given, options.resume, options.set_keys);
  check_job_inputs(config);
  check_compile_start(config);  // compile.backend: Python, torch, cache (writes nothing)
  // One run per directory: the lock comes first, so a second run into the same run.name is
  // refused (naming the holder) before it reads or writes anything there.
  const auto comm = process_communicator(config);
  auto lock = lock_run_directories(config, *comm, options.argv);
  // resume is checked before the session opens: bad input (a checkpoint of another model
  // included) writes nothing, and a resumed run appends to its metrics.jsonl. A fresh run does
  // not mix with another run's records: refused, or moved aside (overwrite, and resume = "auto"
  // finding no checkpoint to continue).
  const bool continues = check_train_start(config, options.resume);
  const auto existing = continues ? RunOptions::Existing::kReplace
                        : (options.overwrite || options.resume == "auto")
                            ? RunOptions::Existing::kMoveAside
                            : RunOptions::Existing::kRefuse;
  if (!continues) {
    std::string error;
    if (comm->rank() == 0) {
      try {
        prepare_run_records(run_directory(config), "metrics.jsonl", existing);
      } catch (const std::exception& e) {
        error = one_line_error(e);
      }
    }
    if (comm->world_size() > 1) error = comm->all_gather_bytes(error)[0];  // rank 0's
    if (!error.empty()) throw UserError(error);
  }
  auto session = open_session(config, SessionOptions{.argv = options.argv,
                                                     .comm = comm,
                                                     .append_metrics = continues,
                                                     .existing_records = existing});
  // The plan's forecast for this run (kiln/plan.h), and, when it forecasts the step time (a
  // pilot of this job on this device, or a catalog row), the run tracked against it: added
  // before the checkpoint hook, so a save after a step is time between steps, not inside one.
  std::shared_ptr<PlanTrackingHook> tracking;
  auto forecast = log_plan_forecast(config, session->run->dir(), session->comm->rank());
  if (forecast && forecast->step_seconds > 0) {
    tracking = std::make_shared<PlanTrackingHook>(
        *session->run, std::move(*forecast), config.get_int("train.steps"),
        session->comm->world_size(), config.get_int("train.metrics_every"),
        config.get_int("run.log_every"));
    session->trainer->add_hook(tracking);
  }
  auto checkpointing = attach_checkpointing(*session->trainer, *session->comm, session->run->dir(),
                                            options.resume);        // [checkpoint]
  auto compiled = attach_compiled_step(*session->trainer, config);  // [compile]
  // SIGTERM / SIGUSR1: finish the step, commit a checkpoint, throw Preempted (exit 75).
  attach_preemption(*session->trainer, *session->comm, checkpointing);
  session->trainer->add_hook(make_tensorboard_hook(*session->run));  // beside metrics.jsonl
  // The final plan record after the checkpoint hook's final save.
  if (tracking) session->trainer->add_hook(PlanTrackingHook::finisher(tracking));
  TrainingRunResult result;
  // train.stop_after_step: this process ends early (evaluation and final save as at the end);
  // the schedule, read from train.steps by the Trainer, still spans the whole job.
  const int64_t stop = config.get_int("train.stop_after_step");
  result.summary =
      session->trainer->fit(stop > 0 ? stop : config.get_int("train.steps"), session->run.get());
  result.run_dir = session->run->dir();
  if (compiled) result.compile_report = compiled->report();
  return result;
}

std::string training_summary_text(const TrainingRunResult& result) {
  const TrainSummary& s = result.summary;
  const bool tokens = s.tokens_per_second > 0;
  std::string out = fmt::format(
      "\ntrained {} steps in {} | loss {:.4f} -> {:.4f} | val_loss {:.4f}{} | {:.0f} {}\n", s.steps,
      format_duration(s.seconds), s.first_loss, s.last_loss, s.final_eval.loss,
      s.final_eval.accuracy >= 0
          ? fmt::format(" | val_accuracy {:.2f}%", 100 * s.final_eval.accuracy)
          : "",
      tokens ? s.tokens_per_second : s.samples_per_second, tokens ? "tokens/s" : "samples/s");
  if (s.skipped_steps > 0) out += fmt::format("skipped {} non-finite steps\n", s.skipped_steps);
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
