// One writer per run directory, across real processes (issue 16): two `kiln train` started
// together into one run name (alone and under torchrun), the torchrun agent killed alone, SIGTERM
// preemption at 1 and 2 ranks resumed bitwise, a torn metrics line repaired on resume, and
// checkpoint errors that name their cause.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <thread>

#include "ckpt/ckpt_helpers.h"
#include "kiln/checkpoint.h"
#include "kiln/error.h"
#include "kiln/run.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

// Every line of a metrics file as JSON; fails the test on a line that does not parse.
std::vector<nlohmann::json> jsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::json> records;
  std::ifstream in(path);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(record.is_discarded()) << path << " line " << number << ": " << line;
    if (!record.is_discarded()) records.push_back(record);
  }
  const std::string text = slurp(path);
  EXPECT_TRUE(text.empty() || text.back() == '\n') << path << " ends in a torn line";
  return records;
}

// The training steps recorded in a metrics file, in order (eval records have no "loss").
std::vector<int64_t> recorded_steps(const std::filesystem::path& path) {
  std::vector<int64_t> steps;
  for (const auto& r : jsonl(path)) {
    if (r.contains("loss") && r.contains("step")) steps.push_back(r["step"].get<int64_t>());
  }
  return steps;
}

std::vector<int64_t> one_to(int64_t n) {
  std::vector<int64_t> steps;
  for (int64_t s = 1; s <= n; ++s) steps.push_back(s);
  return steps;
}

bool bitwise_equal(const std::filesystem::path& a, const std::filesystem::path& b,
                   const std::string& prefix) {
  const auto x = read_checkpoint_tensors(a, prefix, true);
  const auto y = read_checkpoint_tensors(b, prefix, true);
  if (x.size() != y.size() || x.empty()) return false;
  for (size_t k = 0; k < x.size(); ++k) {
    if (x[k].first != y[k].first || x[k].second.nbytes() != y[k].second.nbytes() ||
        std::memcmp(x[k].second.data_ptr(), y[k].second.data_ptr(), x[k].second.nbytes()) != 0)
      return false;
  }
  return true;
}

// Waits (polling) until `done` or `seconds` pass; false on timeout.
template <typename Done>
bool wait_until(Done done, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// The steps-every-1 MLP run of these tests: small enough for a few seconds, saving often.
std::vector<std::string> lock_args(const std::filesystem::path& dir, const std::string& name,
                                   int64_t steps, std::vector<std::string> extra = {}) {
  extra.insert(extra.begin(), {"train.steps=" + std::to_string(steps), "checkpoint.every_steps=10",
                               "checkpoint.keep_last_k=2", "model.hidden_dim=512"});
  return mlp_train_args(dir, name, extra);
}

std::vector<std::string> under_torchrun(int ranks, std::vector<std::string> kiln_args) {
  std::vector<std::string> argv = {KILN_TORCHRUN, "--standalone",
                                   fmt::format("--nproc-per-node={}", ranks), "--no-python",
                                   KILN_CLI};
  argv.insert(argv.end(), kiln_args.begin(), kiln_args.end());
  return argv;
}

// A process started with spawn_process (torchrun, or kiln), killed at scope exit if still running.
struct Child {
  pid_t pid = -1;
  int status = -1;
  Child(const std::vector<std::string>& argv, const std::filesystem::path& log)
      : pid(spawn_process(argv, log)) {}
  ~Child() {
    if (status < 0) {
      ::kill(pid, SIGKILL);
      wait();
    }
  }
  bool exited() {
    if (status >= 0) return true;
    int raw = 0;
    if (::waitpid(pid, &raw, WNOHANG) != pid) return false;
    status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    return true;
  }
  int wait() {
    if (status < 0) status = wait_process(pid);
    return status;
  }
};

// ---- two writers -------------------------------------------------------------------------------

// Runs two copies of `argv` at once into one run directory; checks that exactly one ran, that the
// other exited 2 (`refused_status` under torchrun, which reports its worker's failure) while the
// first still held the directory, naming the holder and writing nothing, and that the survivor's
// metrics hold every step once. The holder is stopped (SIGSTOP) as soon as its lock record
// appears and continued once the other has exited: under load a second torchrun can take longer
// to start than the first takes to finish, and the test would then see two runs one after the
// other instead of two at once.
void two_at_once(const std::vector<std::string>& argv, const std::filesystem::path& logs,
                 const std::filesystem::path& run_dir, int64_t steps, int refused_status) {
  Child a(argv, logs / "a.log");
  Child b(argv, logs / "b.log");
  pid_t holder_pid = -1;
  ASSERT_TRUE(wait_until(
      [&] {
        try {
          const auto record = nlohmann::json::parse(slurp(run_dir / kRunLockFile));
          holder_pid = static_cast<pid_t>(record.at("pid").get<int64_t>());
        } catch (const std::exception&) {
          return a.exited() && b.exited();  // not written yet (or both gone: fails below)
        }
        return true;
      },
      120))
      << "no lock record in " << run_dir;
  ASSERT_GT(holder_pid, 0) << slurp(logs / "a.log") << slurp(logs / "b.log");
  ASSERT_EQ(::kill(holder_pid, SIGSTOP), 0) << "the holder ended before it could be held";
  struct Resume {
    pid_t pid;
    ~Resume() { ::kill(pid, SIGCONT); }
  } resume{holder_pid};
  int first_exit = -1;  // which child exited first: the refused one, the holder being stopped
  ASSERT_TRUE(wait_until(
      [&] {
        if (first_exit < 0 && a.exited()) first_exit = 0;
        if (first_exit < 0 && b.exited()) first_exit = 1;
        return first_exit >= 0;
      },
      120));
  const bool a_ran = first_exit == 1;
  Child& winner = a_ran ? a : b;
  Child& loser = a_ran ? b : a;
  EXPECT_FALSE(winner.exited()) << "the refused run exits while the other still runs";
  ::kill(holder_pid, SIGCONT);
  const std::string loser_log = slurp(logs / (a_ran ? "b.log" : "a.log"));
  const std::string winner_log_name = a_ran ? "a.log" : "b.log";
  EXPECT_EQ(loser.wait(), refused_status) << loser_log;
  ASSERT_EQ(winner.wait(), 0) << slurp(logs / winner_log_name);
  // One line naming the holder (its pid is the winner's, or under torchrun its rank 0's) and the
  // fix.
  const auto holder = nlohmann::json::parse(slurp(run_dir / kRunLockFile));
  EXPECT_THAT(loser_log, HasSubstr("run directory " + run_dir.string() + " is in use by pid " +
                                   std::to_string(holder["pid"].get<int64_t>()) + " on host "));
  EXPECT_THAT(loser_log, HasSubstr("; wait for it, or set run.name"));
  EXPECT_THAT(holder["command_line"].get<std::string>(), HasSubstr("train"));
  // Nothing written by the refused run: the train.log holds no line of it, and the survivor's
  // records are whole, each step once.
  EXPECT_THAT(slurp(run_dir / "train.log"), Not(HasSubstr("is in use by")));
  EXPECT_EQ(recorded_steps(run_dir / "metrics.jsonl"), one_to(steps));
  const auto entries = list_checkpoints(run_dir / "checkpoints");
  ASSERT_FALSE(entries.empty());
  EXPECT_EQ(entries.back().step, steps);
  EXPECT_TRUE(entries.back().committed);
}

TEST(RunLock, TwoTrainsIntoOneRunNameOneRunsTheOtherExits2) {
  TempDir dir;
  std::vector<std::string> argv = {KILN_CLI};
  // A fraction of a second of steps: the holder is stopped while the other starts and is refused.
  for (const auto& a : lock_args(dir.path(), "same", 200)) argv.push_back(a);
  two_at_once(argv, dir.path(), dir / "same", 200, kExitUserError);
}

TEST(RunLock, TwoTorchrunJobsIntoOneRunNameOneRunsTheOtherFails) {
  TempDir dir;
  // torchrun reports a worker's failure as its own exit status 1.
  two_at_once(under_torchrun(2, lock_args(dir.path(), "same", 100, {"train.batch_size=16"})),
              dir.path(), dir / "same", 100, 1);
}

// ---- launcher death and preemption under torchrun ----------------------------------------------

// The pids of `parent`'s children.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}

// One test, so the uninterrupted 2-rank reference serves both interruptions:
//  1. SIGKILL of the torchrun agent alone: both workers exit non-zero at once (they were orphans
//     before issue 16); the next --resume auto launch removes the abandoned .tmp, resumes from the
//     newest committed checkpoint and ends bitwise equal to the reference.
//  2. SIGTERM to the agent (it forwards it to the workers): every rank finishes its step, a
//     checkpoint is committed, the workers exit 75; --resume auto ends bitwise equal.
TEST(RunLock, TorchrunAgentKilledAloneAndSigtermPreemptionResumeBitwise) {
  constexpr int64_t kSteps = 200;
  TempDir dir;
  auto args = [&](const std::string& name, std::vector<std::string> extra = {}) {
    extra.insert(extra.end(),
                 {"train.batch_size=16", "checkpoint.every_steps=5", "checkpoint.async=true"});
    return lock_args(dir.path(), name, kSteps, extra);
  };
  auto resume = [&](const std::string& name) {
    auto a = args(name);
    a.insert(a.end(), {"--resume", "auto"});
    return under_torchrun(2, a);
  };
  Child reference(under_torchrun(2, args("reference")), dir / "reference.log");

  // 1. The agent killed alone. This process adopts the orphaned workers (a subreaper) to learn
  // how they ended.
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  {
    Child agent(under_torchrun(2, args("killed")), dir / "killed.log");
    const auto ckpts = dir / "killed" / "checkpoints";
    ASSERT_TRUE(
        wait_until([&] { return checkpoint_committed(ckpts / "step-10") || agent.exited(); }, 120))
        << "no checkpoint committed";
    ASSERT_FALSE(agent.exited()) << slurp(dir / "killed.log");
    const std::vector<pid_t> workers = children_of(agent.pid);
    ASSERT_EQ(workers.size(), 2u);
    ::kill(agent.pid, SIGKILL);
    EXPECT_EQ(agent.wait(), 128 + SIGKILL);
    for (pid_t worker : workers) {
      int raw = 0;
      pid_t got = 0;
      // A generous hang guard: they must go at once (PR_SET_PDEATHSIG), not train on as orphans.
      ASSERT_TRUE(wait_until([&] { return (got = ::waitpid(worker, &raw, WNOHANG)) != 0; }, 30))
          << "worker " << worker << " outlived its torchrun agent";
      ASSERT_EQ(got, worker);
      EXPECT_TRUE(WIFSIGNALED(raw) || WEXITSTATUS(raw) != 0) << "worker exits non-zero";
    }
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  const auto killed_ckpts = dir / "killed" / "checkpoints";
  int64_t newest = 0;
  for (const auto& e : list_checkpoints(killed_ckpts)) {
    if (e.committed) newest = std::max(newest, e.step);
  }
  ASSERT_GE(newest, 10);
  ASSERT_LT(newest, kSteps) << "the killed run got past the reference's length";
  {
    Child resumed(resume("killed"), dir / "killed-resumed.log");
    ASSERT_EQ(resumed.wait(), 0) << slurp(dir / "killed-resumed.log");
  }
  const std::string resumed_log = slurp(dir / "killed-resumed.log");
  EXPECT_THAT(resumed_log, HasSubstr("resumed from " +
                                     (killed_ckpts / ("step-" + std::to_string(newest))).string()));
  for (const auto& e : list_checkpoints(killed_ckpts))
    EXPECT_TRUE(e.committed) << e.path << " left behind";
  jsonl(dir / "killed" / "metrics.jsonl");  // parses (an old run's fragment would not)

  // 2. SIGTERM preemption at 2 ranks.
  {
    Child agent(under_torchrun(2, args("preempted")), dir / "preempted.log");
    ASSERT_TRUE(wait_until(
        [&] {
          return agent.exited() || recorded_steps(dir / "preempted" / "metrics.jsonl").size() >= 12;
        },
        120));
    ASSERT_FALSE(agent.exited()) << slurp(dir / "preempted.log");
    ::kill(agent.pid, SIGTERM);
    EXPECT_NE(agent.wait(), 0);
  }
  const std::string preempted_log = slurp(dir / "preempted.log");
  EXPECT_THAT(preempted_log, HasSubstr("SIGTERM asked the run to stop"));
  size_t preempted_ranks = 0;  // torchrun passes both workers' stderr through
  for (size_t at = 0;
       (at = preempted_log.find("kiln: preempted: stopped at step", at)) != std::string::npos; ++at)
    ++preempted_ranks;
  EXPECT_EQ(preempted_ranks, 2u) << preempted_log;
  const auto steps_before = recorded_steps(dir / "preempted" / "metrics.jsonl");
  ASSERT_FALSE(steps_before.empty());
  const int64_t stopped_at = steps_before.back();
  ASSERT_LT(stopped_at, kSteps);
  EXPECT_TRUE(checkpoint_committed(dir / "preempted" / "checkpoints" /
                                   ("step-" + std::to_string(stopped_at))))
      << "the stop step is committed";
  {
    Child resumed(resume("preempted"), dir / "preempted-resumed.log");
    ASSERT_EQ(resumed.wait(), 0) << slurp(dir / "preempted-resumed.log");
  }
  EXPECT_EQ(recorded_steps(dir / "preempted" / "metrics.jsonl"), one_to(kSteps));

  ASSERT_EQ(reference.wait(), 0) << slurp(dir / "reference.log");
  const auto want = read_step_losses(dir / "reference" / "metrics.jsonl");
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  const auto final_ref = dir / "reference" / "checkpoints" / ("step-" + std::to_string(kSteps));
  for (const std::string name : {"killed", "preempted"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(read_step_losses(dir / name / "metrics.jsonl"), want);
    const auto final_dir = dir / name / "checkpoints" / ("step-" + std::to_string(kSteps));
    EXPECT_TRUE(bitwise_equal(final_ref, final_dir, "model/"));
    EXPECT_TRUE(bitwise_equal(final_ref, final_dir, "optim/"));
  }
}

// ---- one process -------------------------------------------------------------------------------

// SIGTERM at one rank: the step finishes, its checkpoint is committed, exit 75; --resume auto
// continues bitwise (every step recorded once). A torn last metrics line (a kill mid-write) is cut
// off on resume, with a warning.
TEST(RunLock, SigtermAtOneRankCommitsExits75AndResumesBitwiseATornLineIsRepaired) {
  constexpr int64_t kSteps = 150;
  TempDir dir;
  auto args = [&](const std::string& name) { return lock_args(dir.path(), name, kSteps); };
  KilnProcess reference(args("reference"), dir / "reference.log");
  {
    KilnProcess run(args("stopped"), dir / "stopped.log");
    ASSERT_TRUE(wait_until(
        [&] {
          return run.exited() || recorded_steps(dir / "stopped" / "metrics.jsonl").size() >= 15;
        },
        60));
    ASSERT_FALSE(run.exited()) << slurp(dir / "stopped.log");
    ::kill(run.pid(), SIGTERM);
    EXPECT_EQ(run.wait(), kExitPreempted) << slurp(dir / "stopped.log");
  }
  const std::string log = slurp(dir / "stopped.log");
  EXPECT_THAT(log, HasSubstr("kiln: preempted: stopped at step"));
  EXPECT_THAT(log, HasSubstr("continue with --resume auto"));
  const auto before = recorded_steps(dir / "stopped" / "metrics.jsonl");
  ASSERT_FALSE(before.empty());
  EXPECT_EQ(before, one_to(before.back()));
  EXPECT_LT(before.back(), kSteps);
  EXPECT_TRUE(checkpoint_committed(dir / "stopped" / "checkpoints" /
                                   ("step-" + std::to_string(before.back()))));

  // A record torn by a kill: a line without its newline.
  {
    std::ofstream out(dir / "stopped" / "metrics.jsonl", std::ios::app | std::ios::binary);
    out << "{\"step\": " << before.back() + 1 << ", \"loss\": 0.12";
  }
  auto resume = args("stopped");
  resume.insert(resume.end(), {"--resume", "auto"});
  KilnProcess resumed(resume, dir / "resumed.log");
  ASSERT_EQ(resumed.wait(), 0) << slurp(dir / "resumed.log");
  EXPECT_THAT(slurp(dir / "resumed.log"), HasSubstr("removed a torn last line"));
  EXPECT_EQ(recorded_steps(dir / "stopped" / "metrics.jsonl"), one_to(kSteps));

  ASSERT_EQ(reference.wait(), 0) << slurp(dir / "reference.log");
  EXPECT_EQ(read_step_losses(dir / "stopped" / "metrics.jsonl"),
            read_step_losses(dir / "reference" / "metrics.jsonl"));
  const std::string last = "step-" + std::to_string(kSteps);
  EXPECT_TRUE(bitwise_equal(dir / "reference" / "checkpoints" / last,
                            dir / "stopped" / "checkpoints" / last, "model/"));
  EXPECT_TRUE(bitwise_equal(dir / "reference" / "checkpoints" / last,
                            dir / "stopped" / "checkpoints" / last, "optim/"));
}

// A checkpoint directory removed under a running job (what a second writer does): the failed save
// says so, and does not advise on_save_error = "continue" (it would fail again).
TEST(RunLock, ACheckpointDirectoryRemovedUnderTheRunNamesASecondWriter) {
  TempDir dir;
  const auto ckpts = dir / "r" / "checkpoints";
  KilnProcess run(lock_args(dir.path(), "r", 1000000, {"checkpoint.every_steps=1"}), dir / "r.log");
  ASSERT_TRUE(
      wait_until([&] { return run.exited() || checkpoint_committed(ckpts / "step-2"); }, 60));
  ASSERT_FALSE(run.exited()) << slurp(dir / "r.log");
  ASSERT_TRUE(wait_until(
      [&] {
        std::error_code ec;
        std::filesystem::remove_all(ckpts, ec);
        return !ec && !std::filesystem::exists(ckpts);
      },
      10));
  ASSERT_TRUE(wait_until([&] { return run.exited(); }, 60)) << "the run stops on the failed save";
  const std::string log = slurp(dir / "r.log");
  EXPECT_EQ(run.wait(), kExitGateFailed) << log;
  EXPECT_THAT(log, HasSubstr(std::strerror(ENOENT)));
  EXPECT_THAT(log, HasSubstr("is a second run using this directory?"));
  EXPECT_THAT(log, Not(HasSubstr("on_save_error")));
  EXPECT_THAT(log, Not(HasSubstr("free space")));
}

TEST(RunLock, AdviceFollowsTheCause) {
  const std::filesystem::path dir = "/ckpt";
  EXPECT_THAT(checkpoint_error_advice(std::string("x: ") + std::strerror(ENOSPC), dir, true),
              HasSubstr("free space in /ckpt or set checkpoint.on_save_error"));
  EXPECT_THAT(checkpoint_error_advice(std::string("x: ") + std::strerror(EDQUOT), dir, false),
              Not(HasSubstr("on_save_error")));
  EXPECT_THAT(checkpoint_error_advice(std::string("x: ") + std::strerror(EACCES), dir, true),
              HasSubstr("permissions"));
  EXPECT_THAT(checkpoint_error_advice(std::string("x: ") + std::strerror(EROFS), dir, true),
              HasSubstr("mounted writable"));
  EXPECT_THAT(checkpoint_error_advice(std::string("x: ") + std::strerror(ENOENT), dir, true),
              HasSubstr("another process removed"));
}

// In one process: a directory already held is shared (the ladder's rungs); a child started by
// the holder runs under its lock inside the held directory and is refused outside it.
TEST(RunLock, AProcessSharesItsLockAndItsChildrenRunUnderIt) {
  TempDir dir;
  auto first = lock_directories({{dir / "run"}}, "test");
  auto again = lock_directories({{dir / "run"}}, "test");  // shared, not refused
  EXPECT_EQ(first->dirs(), again->dirs());
  const auto holder = nlohmann::json::parse(slurp(dir / "run" / kRunLockFile));
  EXPECT_EQ(holder["pid"].get<int64_t>(), ::getpid());
  EXPECT_EQ(holder["command_line"], "test");

  // A child (spawn_process hands it the lock) is refused outside the held directory and runs
  // inside it without a lock of its own.
  Child outside(
      {KILN_CLI, "train", (source_dir() / "configs/mlp.toml").string(), "--set",
       "run.dir=" + dir.path().string(), "--set", "run.name=other", "--set", "train.steps=2"},
      dir / "outside.log");
  EXPECT_EQ(outside.wait(), kExitUserError);
  EXPECT_THAT(slurp(dir / "outside.log"), HasSubstr("lies outside the directories its parent"));
  Child child({KILN_CLI, "train", (source_dir() / "configs/mlp.toml").string(), "--set",
               "run.dir=" + (dir / "run").string(), "--set", "run.name=child", "--set",
               "train.steps=2", "--set", "run.progress=off", "--set", "data.num_samples=64",
               "--set", "data.val_samples=32", "--set", "run.threads=1"},
              dir / "child.log");
  EXPECT_EQ(child.wait(), 0) << slurp(dir / "child.log");
  EXPECT_FALSE(std::filesystem::exists(dir / "run" / "child" / kRunLockFile))
      << "a child runs under its parent's lock";

  // Released with the last hold: another process may take it then.
  first.reset();
  again.reset();
  Child later({KILN_CLI, "train", (source_dir() / "configs/mlp.toml").string(), "--set",
               "run.dir=" + dir.path().string(), "--set", "run.name=run", "--set", "train.steps=2",
               "--set", "run.progress=off", "--set", "data.num_samples=64", "--set",
               "data.val_samples=32", "--set", "run.threads=1"},
              dir / "later.log");
  EXPECT_EQ(later.wait(), 0) << slurp(dir / "later.log");
}

}  // namespace
}  // namespace kiln::testing
