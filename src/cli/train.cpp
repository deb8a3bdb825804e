#include <fmt/format.h>

#include "cli/commands.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/compile.h"
#include "kiln/dist.h"
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
  command->callback([&action, args, resume] {
    action = [args, resume] {
      Config config = args->load();
      check_compile_start(config);  // compile.backend: Python, torch, cache (writes nothing)
      // One run per directory: the lock comes first, so a second `kiln train` into the same
      // run.name is refused (naming the holder) before it reads or writes anything there.
      auto lock = lock_run_directories(config, *process_communicator(config), process_argv());
      // --resume is checked before the session opens: bad input writes nothing (metrics.jsonl
      // included), and a resumed run appends to its metrics.jsonl.
      const bool continues = check_train_start(config, *resume);
      auto session =
          open_session(config, SessionOptions{.argv = process_argv(), .append_metrics = continues});
      auto checkpointing =
          attach_checkpointing(*session->trainer, *session->comm, session->run->dir(),
                               *resume);  // --resume, [checkpoint]
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
