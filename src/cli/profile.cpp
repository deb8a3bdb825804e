#include "kiln/profile.h"

#include <fmt/format.h>

#include <algorithm>

#include "cli/commands.h"
#include "kiln/error.h"
#include "kiln/rungs.h"
#include "kiln/train.h"

namespace kiln::cli {

namespace {

// Trace files named on the command line: files as given, directories searched for
// *.pt.trace.json and *.pt.trace.json.gz (sorted by name, i.e. by time for one worker).
std::vector<std::filesystem::path> trace_files(const std::vector<std::string>& paths) {
  std::vector<std::filesystem::path> files;
  for (const auto& given : paths) {
    std::error_code ec;
    if (std::filesystem::is_directory(given, ec)) {
      std::vector<std::filesystem::path> found;
      for (const auto& entry : std::filesystem::directory_iterator(given, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.ends_with(".pt.trace.json") || name.ends_with(".pt.trace.json.gz"))
          found.push_back(entry.path());
      }
      if (found.empty())
        throw UserError(
            fmt::format("--analyze {}: no *.pt.trace.json[.gz] files in this directory", given));
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (std::filesystem::exists(given, ec)) {
      files.emplace_back(given);
    } else {
      throw UserError(fmt::format("--analyze {}: no such file or directory", given));
    }
  }
  return files;
}

void add_profile_command(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("profile",
                                     "Kineto traces on a wait/warmup/active schedule, top "
                                     "operators, step phases, bottleneck verdict");
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(*command, /*config_required=*/false);
  auto analyze = std::make_shared<std::vector<std::string>>();
  command
      ->add_option("--analyze", *analyze,
                   "analyse a trace file or directory (kiln's or torch.profiler's) instead of "
                   "training; repeatable")
      ->allow_extra_args(false);
  command->callback([&action, args, analyze] {
    action = [args, analyze] {
      if (!analyze->empty()) {
        const Config config = args->load();
        std::vector<nlohmann::json> traces;
        for (const auto& path : trace_files(*analyze)) {
          try {
            traces.push_back(read_trace(path));
            (void)analyze_traces({traces.back()});  // name the file that is not a schedule trace
          } catch (const UserError& e) {
            if (std::string(e.what()).find(path.string()) != std::string::npos) throw;
            throw UserError(fmt::format("{}: {}", path.string(), e.what()));
          }
        }
        const TraceAnalysis analysis = analyze_traces(traces);
        VerdictContext context;  // the job's settings are known only when its config is given
        if (!args->path.empty()) {
          const TrainerSetup setup = TrainerSetup::from_config(config);
          context = verdict_context(setup.train, setup.loader);
        }
        context.cuda = analysis.has_gpu;
        const Verdict verdict =
            decide_bottleneck(analysis, VerdictThresholds::from_config(config), context);
        const int top = profiler_options(config, {}, torch::kCPU, 0, 1).top_operators;
        fmt::print("{}", format_profile_tables(analysis, verdict, top));
        return 0;
      }
      if (args->path.empty())
        throw UserError("kiln profile: give a config file, or --analyze <traces>");
      auto session =
          open_session(args->load_for_run(), {.argv = process_argv(), .rung = "profile"});
      std::string tables;
      RungResult result = run_profile(*session, &tables);
      fmt::print("{}", tables);
      print_rung(result);
      fmt::print("profile.json and traces: {}\n", session->run->dir().string());
      if (!result.passed) throw TrainingError("profile gate failed: " + result.verdict);
      return 0;
    };
  });
}

const Registration profile_registration{30, add_profile_command};  // named apart: unity batches

}  // namespace

}  // namespace kiln::cli
