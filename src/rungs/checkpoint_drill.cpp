// The checkpoint rung: a restore drill across real processes (save, SIGKILL, restore in a fresh
// process, resume, compare bitwise with an uninterrupted run).
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>

#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "core/clock.h"
#include "core/files.h"
#include "core/process.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/results.h"
#include "kiln/run.h"
#include "kiln/rungs.h"
#include "rungs/options.h"

namespace kiln {
namespace {

using nlohmann::json;
using Clock = SteadyClock;

// Whether two lists of named tensors are equal bit for bit.
bool bitwise_equal(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                   const std::vector<std::pair<std::string, torch::Tensor>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    const auto& x = a[k].second;
    const auto& y = b[k].second;
    if (a[k].first != b[k].first || x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes())
      return false;
    if (std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) return false;
  }
  return true;
}

// The drill on rank 0; its outcome (passed, verdict) and every stage's figures as far as it got.
CheckpointResult drill(const Config& config) {
  CheckpointResult result;
  const auto drill_begin = Clock::now();
  const int64_t half = DrillRungOptions::from_config(config).drill_steps;
  const int64_t total = 2 * half;
  const std::filesystem::path run_dir = run_directory(config);
  const std::filesystem::path dir = std::filesystem::absolute(run_dir / "checkpoint-drill");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  write_file_atomic(dir / "config.toml", config.to_toml(/*with_docs=*/false));
  const std::string exe = kiln_executable().string();

  auto train_args = [&](const std::string& name, int64_t every_steps) {
    return std::vector<std::string>{exe,
                                    "train",
                                    (dir / "config.toml").string(),
                                    "--set",
                                    "run.dir=" + dir.string(),
                                    "--set",
                                    "run.name=" + name,
                                    "--set",
                                    "run.progress=log",
                                    "--set",
                                    "train.steps=" + std::to_string(total),
                                    "--set",
                                    "train.eval_every=0",
                                    "--set",
                                    "checkpoint.dir=" + (dir / name / "checkpoints").string(),
                                    "--set",
                                    "checkpoint.every_steps=" + std::to_string(every_steps)};
  };
  result.drill_steps = half;
  result.total_steps = total;
  result.directory = dir.string();
  auto fail = [&](const std::string& why) {
    result.status.passed = false;
    result.status.verdict = why;
    result.seconds = seconds_since(drill_begin);
    return result;
  };

  // 1. The reference: 2K uninterrupted steps, saved at the end.
  auto begin = Clock::now();
  int code = wait_process(spawn_process(train_args("reference", total), dir / "reference.log"));
  result.reference_seconds = seconds_since(begin);
  if (code != 0)
    return fail(fmt::format("the reference run exited with {} (see {})", code,
                            (dir / "reference.log").string()));

  // 2. A run that saves at step K and is killed once that checkpoint is committed.
  const std::filesystem::path killed_ckpt = dir / "killed" / "checkpoints";
  const std::filesystem::path step_k = checkpoint_step_dir(killed_ckpt, half);
  begin = Clock::now();
  const pid_t pid = spawn_process(train_args("killed", half), dir / "killed.log");
  bool killed = false;
  int killed_status = -1;
  while (true) {
    if (checkpoint_committed(step_k)) {
      killed = ::kill(pid, SIGKILL) == 0;
      killed_status = wait_process(pid);
      killed = killed && killed_status == 128 + SIGKILL;
      break;
    }
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      killed_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  result.killed = killed;
  result.killed_exit_status = killed_status;
  result.save_seconds = seconds_since(begin);
  if (!checkpoint_committed(step_k)) {
    return fail(fmt::format("the run to be killed exited with {} before committing {} (see {})",
                            killed_status, step_k.string(), (dir / "killed.log").string()));
  }

  // 3. The committed checkpoint verifies.
  const VerifyReport report = verify_checkpoint(step_k);
  result.verify_ok = report.ok();
  result.checkpoint_bytes = static_cast<double>(report.bytes_checked);
  if (!report.ok())
    return fail("the committed checkpoint does not verify: " + report.problems.front());
  const CheckpointIndex index = read_checkpoint_index(step_k);
  const json& loader = index.ranks.at(0).at("loader");
  result.resume_epoch = loader.at("epoch").get<int64_t>();
  result.resume_batch_in_epoch = loader.at("batch").get<int64_t>();

  // 4. A fresh process restores it and trains to 2K.
  std::vector<std::string> resume_args = train_args("resumed", total);
  resume_args.push_back("--resume");
  resume_args.push_back(step_k.string());
  begin = Clock::now();
  code = wait_process(spawn_process(resume_args, dir / "resumed.log"));
  result.resume_seconds = seconds_since(begin);
  if (code != 0)
    return fail(fmt::format("the resumed run exited with {} (see {})", code,
                            (dir / "resumed.log").string()));

  // 5. Compare with the reference.
  const auto reference_losses = read_step_losses(dir / "reference" / "metrics.jsonl");
  const auto resumed_losses = read_step_losses(dir / "resumed" / "metrics.jsonl");
  int64_t compared = 0, equal = 0;
  double max_difference = 0;
  for (int64_t step = half + 1; step <= total; ++step) {
    auto a = reference_losses.find(step), b = resumed_losses.find(step);
    if (a == reference_losses.end() || b == resumed_losses.end()) continue;
    ++compared;
    equal += a->second == b->second;
    max_difference = std::max(max_difference, std::abs(a->second - b->second));
  }
  const std::filesystem::path reference_final =
      checkpoint_step_dir(dir / "reference" / "checkpoints", total);
  const std::filesystem::path resumed_final =
      checkpoint_step_dir(dir / "resumed" / "checkpoints", total);
  const bool parameters_equal =
      bitwise_equal(read_checkpoint_tensors(reference_final, "model/", true),
                    read_checkpoint_tensors(resumed_final, "model/", true));
  const bool optimizer_equal =
      bitwise_equal(read_checkpoint_tensors(reference_final, "optim/", true),
                    read_checkpoint_tensors(resumed_final, "optim/", true));
  result.losses_compared = compared;
  result.losses_bitwise_equal = compared == half && equal == compared;
  result.max_abs_loss_difference = max_difference;
  result.parameters_bitwise_equal = parameters_equal;
  result.optimizer_state_bitwise_equal = optimizer_equal;
  result.seconds = seconds_since(drill_begin);
  result.status.passed =
      compared == half && equal == compared && parameters_equal && optimizer_equal;
  result.status.verdict =
      result.status.passed
          ? fmt::format(
                "restored step {} in a fresh process{}: {} losses, parameters and optimizer state "
                "bitwise equal to an uninterrupted run",
                half, killed ? " after SIGKILL" : "", compared)
          : fmt::format(
                "resume differs from the uninterrupted run: {}/{} losses equal (max |diff| "
                "{:.3g}), "
                "parameters {}, optimizer state {}",
                equal, half, max_difference, parameters_equal ? "equal" : "differ",
                optimizer_equal ? "equal" : "differ");
  return result;
}

}  // namespace

RungResult run_checkpoint_drill(const Config& config, const SessionOptions& options) {
  auto comm = options.comm ? options.comm : single_process_communicator();
  // The drill's processes write in <run dir>/checkpoint-drill/ under this lock.
  const auto lock =
      lock_run_directories(resolve_job(config, JobRequest{.argv = options.argv}),
                           options.comm ? *options.comm : *process_communicator(config));
  // Rank 0 runs the drill and writes checkpoint.json through its result's to_json; every rank
  // returns that result as rank 0 wrote it.
  CheckpointResult drilled;
  nlohmann::json written;
  if (comm->rank() == 0) {
    // Every failure on rank 0 becomes the rung's verdict, so the other ranks (waiting in the
    // all-gather below) always learn the outcome instead of timing out.
    try {
      drilled = drill(config);
    } catch (const std::exception& e) {
      drilled = {};
      drilled.status = {kResultSchemaVersion, false,
                        "the drill could not run: " + one_line_error(e), /*measured=*/false};
    }
    written = drilled;
    try {
      const std::filesystem::path path = run_directory(config) / "checkpoint.json";
      std::filesystem::create_directories(path.parent_path());
      write_file_atomic(path, written.dump(2) + "\n");
    } catch (const std::exception& e) {
      drilled.status.passed = false;
      drilled.status.verdict += "; and checkpoint.json could not be written: " + one_line_error(e);
      written = drilled;
    }
  }
  // The drill runs in single-process children started by rank 0; the other ranks learn its outcome.
  if (comm->world_size() > 1) {
    std::string shared_text;
    if (comm->rank() == 0) {
      try {
        shared_text = written.dump();
      } catch (const std::exception& e) {  // e.g. a verdict that is not UTF-8
        CheckpointResult unshared;
        unshared.status = {kResultSchemaVersion, false,
                           "the drill's outcome could not be shared: " + one_line_error(e),
                           /*measured=*/false};
        shared_text = json(unshared).dump(-1, ' ', false, json::error_handler_t::replace);
      }
    }
    written = json::parse(comm->all_gather_bytes(shared_text)[0]);
    drilled = written.get<CheckpointResult>();
  }
  RungResult result;
  result.rung = "checkpoint";
  result.passed = drilled.status.passed;
  result.verdict = drilled.status.verdict;
  result.numbers = drilled;
  result.table = result_rows(drilled);
  return result;
}

}  // namespace kiln
