#include <fmt/format.h>

#include "cli/commands.h"
#include "core/records.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/compile.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/report.h"
#include "kiln/session.h"

namespace kiln::cli {

namespace {

void add_train_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("train", "train a model from a TOML config");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command);
  auto resume = std::make_shared<std::string>();
  command->add_option(
      "--resume", *resume,
      "auto (the newest valid checkpoint in checkpoint.dir, if any) or a checkpoint path");
  auto overwrite = std::make_shared<bool>(false);
  command->add_flag("--overwrite", *overwrite,
                    "start afresh in a run directory that holds another run's records: move them "
                    "into <run dir>/previous-<UTC time>/ first");
  command->callback([&action, args, resume, overwrite] {
    action = [args, resume, overwrite] {
      Config config = args->load();
      if (*overwrite && !resume->empty()) {
        throw UserError("--overwrite starts a run afresh and --resume continues one: give one");
      }
      // Before anything is written: --resume keeps the saved run's checkpoint settings (--set
      // wins) and must name a checkpoint; run.device and data.path as `kiln config validate`.
      config = resume_config(config, *resume, args->set_keys());
      check_run_inputs(config);
      check_compile_start(config);  // compile.backend: Python, torch, cache (writes nothing)
      // One run per directory: the lock comes first, so a second `kiln train` into the same
      // run.name is refused (naming the holder) before it reads or writes anything there.
      const auto comm = process_communicator(config);
      auto lock = lock_run_directories(config, *comm, process_argv());
      // --resume is checked before the session opens: bad input (a checkpoint of another model
      // included) writes nothing, and a resumed run appends to its metrics.jsonl. A fresh run
      // does not mix with another run's records: refused, or moved aside (--overwrite, and
      // --resume auto finding no checkpoint to continue).
      const bool continues = check_train_start(config, *resume);
      const auto existing = continues                           ? RunOptions::Existing::kReplace
                            : (*overwrite || *resume == "auto") ? RunOptions::Existing::kMoveAside
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
      auto session = open_session(config, SessionOptions{.argv = process_argv(),
                                                         .append_metrics = continues,
                                                         .existing_records = existing});
      auto checkpointing =
          attach_checkpointing(*session->trainer, *session->comm, session->run->dir(),
                               *resume);                                // --resume, [checkpoint]
      auto compiled = attach_compiled_step(*session->trainer, config);  // [compile]
      // SIGTERM / SIGUSR1: finish the step, commit a checkpoint, exit 75 (kExitPreempted).
      attach_preemption(*session->trainer, *session->comm, checkpointing);
      // TensorBoard scalars beside metrics.jsonl (kiln/report.h).
      session->trainer->add_hook(make_tensorboard_hook(*session->run));
      TrainSummary s = session->trainer->fit(config.get_int("train.steps"), session->run.get());
      const bool tokens = s.tokens_per_second > 0;
      fmt::print(
          "\ntrained {} steps in {} | loss {:.4f} -> {:.4f} | val_loss {:.4f}{} | {:.0f} {}\n",
          s.steps, format_duration(s.seconds), s.first_loss, s.last_loss, s.final_eval.loss,
          s.final_eval.accuracy >= 0
              ? fmt::format(" | val_accuracy {:.2f}%", 100 * s.final_eval.accuracy)
              : "",
          tokens ? s.tokens_per_second : s.samples_per_second, tokens ? "tokens/s" : "samples/s");
      if (s.skipped_steps > 0) fmt::print("skipped {} non-finite steps\n", s.skipped_steps);
      if (compiled) {
        const CompileReport& report = compiled->report();
        fmt::print(
            "compiled step: {}, {} graph(s), {} recompile(s); eval: {} graph(s), {} "
            "recompile(s){}\n",
            report.backend, report.graphs.size(), report.recompiles.size(),
            report.eval_graphs.size(), report.eval_recompiles.size(),
            report.fallback_to_eager ? ", graph breaks: ran eager" : "");
      }
      fmt::print("run directory: {}\n", session->run->dir().string());
      return 0;
    };
  });
}

const Registration registration{10, add_train_command};

}  // namespace

}  // namespace kiln::cli
