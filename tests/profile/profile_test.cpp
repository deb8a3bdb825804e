#include "kiln/profile.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "kiln/error.h"
#include "kiln/rungs.h"
#include "kiln/session.h"
#include "profile/trace_io.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

// ---- schedule -----------------------------------------------------------------------------------

std::string actions_of(const ProfileSchedule& s, int steps) {
  std::string out;
  for (int k = 0; k < steps; ++k)
    out += std::string(k ? " " : "") + profiler_action_name(s.action(k));
  return out;
}

TEST(ProfileSchedule, FollowsTorchProfilerScheduleSemantics) {
  ProfileSchedule s{.skip_first = 2, .wait = 1, .warmup = 1, .active = 2, .repeat = 2};
  EXPECT_EQ(
      actions_of(s, 12),
      "none none none warmup record record_and_save none warmup record record_and_save none none");
  EXPECT_EQ(s.total_steps(), 10);
  ProfileSchedule unbounded{.wait = 0, .warmup = 0, .active = 1, .repeat = 0};
  EXPECT_EQ(actions_of(unbounded, 3), "record_and_save record_and_save record_and_save");
  EXPECT_EQ(unbounded.total_steps(), -1);
  EXPECT_THROW(ProfileSchedule{.active = 0}.action(0), std::invalid_argument);
}

// The same schedules, asked of torch.profiler.schedule itself.
TEST(ProfileSchedule, MatchesPythonTorchProfilerSchedule) {
  const std::vector<ProfileSchedule> schedules = {
      {.skip_first = 0, .wait = 0, .warmup = 0, .active = 1, .repeat = 0},
      {.skip_first = 3, .wait = 2, .warmup = 1, .active = 3, .repeat = 2},
      {.skip_first = 1, .wait = 0, .warmup = 2, .active = 1, .repeat = 3},
      {.skip_first = 0, .wait = 5, .warmup = 0, .active = 2, .repeat = 0},
  };
  std::string script =
      "import warnings; warnings.simplefilter('ignore')\n"
      "from torch.profiler import schedule, ProfilerAction as A\n"
      "names = {A.NONE: 'none', A.WARMUP: 'warmup', A.RECORD: 'record', A.RECORD_AND_SAVE: "
      "'record_and_save'}\n"
      "for sf, w, wu, a, r in [";
  for (const auto& s : schedules) {
    script +=
        fmt::format("({}, {}, {}, {}, {}),", s.skip_first, s.wait, s.warmup, s.active, s.repeat);
  }
  script +=
      "]:\n"
      "    f = schedule(skip_first=sf, wait=w, warmup=wu, active=a, repeat=r)\n"
      "    print(' '.join(names[f(k)] for k in range(30)))\n";
  TempDir dir;
  write_text(dir / "schedule.py", script);
  auto result = run_shell((source_dir() / ".venv/bin/python").string() + " " +
                          (dir / "schedule.py").string());
  ASSERT_EQ(result.exit_code, 0) << result.err;
  std::istringstream lines(result.out);
  for (const auto& s : schedules) {
    std::string line;
    ASSERT_TRUE(std::getline(lines, line));
    EXPECT_EQ(actions_of(s, 30), line) << "skip_first " << s.skip_first << " wait " << s.wait;
  }
}

// ---- capture ------------------------------------------------------------------------------------

std::vector<std::string> profile_overrides(std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"profile.skip_first=1", "profile.wait=1", "profile.warmup=1",
                                "profile.active=2", "profile.repeat=1"};
  o.insert(o.end(), extra.begin(), extra.end());
  return o;
}

std::vector<const json*> events_named(const json& trace, const std::string& name) {
  std::vector<const json*> out;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("name", "") == name) out.push_back(&e);
  }
  return out;
}

TEST(Profiler, WritesOneGzippedTensorBoardTracePerWindowWithStepsPhasesAndOps) {
  TempDir dir;
  Config config = gpt_config(
      dir.path(), profile_overrides({"data.num_workers=2", "profile.repeat=2", "run.threads=1"}));
  auto session = open_session(config, {});
  RungResult result = run_profile(*session);
  ASSERT_TRUE(result.passed) << result.verdict;

  const auto traces_dir = session->run->dir() / "traces";
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(traces_dir))
    files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  ASSERT_EQ(files.size(), 2u);
  // TensorBoard's profiler plugin naming: <hostname>_<pid>.<ns>.pt.trace.json.gz
  const std::regex name(R"(.+_[0-9]+\.[0-9]{18,}\.pt\.trace\.json\.gz)");
  for (const auto& f : files) EXPECT_TRUE(std::regex_match(f.filename().string(), name)) << f;
  EXPECT_TRUE(profile_detail::is_gzip(slurp(files[0])));

  // Steps 0 skipped, 1 wait, 2 warm-up, 3-4 recorded; then 5 wait, 6 warm-up, 7-8 recorded.
  const json first = read_trace(files[0]);
  const json second = read_trace(files[1]);
  EXPECT_EQ(events_named(first, "ProfilerStep#3").size(), 1u);
  EXPECT_EQ(events_named(first, "ProfilerStep#4").size(), 1u);
  EXPECT_TRUE(events_named(first, "ProfilerStep#2").empty());  // warm-up is not recorded
  EXPECT_EQ(events_named(second, "ProfilerStep#8").size(), 1u);
  for (const char* phase : {"data_wait", "forward", "backward", "optimizer"}) {
    const auto scopes = events_named(first, phase);
    ASSERT_EQ(scopes.size(), 2u) << phase;
    EXPECT_EQ((*scopes[0])["cat"], "user_annotation");
  }
  std::set<std::string> op_threads;
  std::string step_thread;
  int aten_ops = 0;
  for (const auto& e : first["traceEvents"]) {
    const std::string n = e.value("name", "");
    if (n.rfind("ProfilerStep#", 0) == 0) step_thread = e["tid"].dump();
    if (e.value("cat", "") == "cpu_op" && n.rfind("aten::", 0) == 0) {
      ++aten_ops;
      op_threads.insert(e["tid"].dump());
    }
  }
  EXPECT_GT(aten_ops, 50);
  EXPECT_TRUE(events_named(first, "aten::mm").size() + events_named(first, "aten::addmm").size() >
              0);
  // The loader's worker threads are recorded too.
  op_threads.erase(step_thread);
  EXPECT_FALSE(op_threads.empty()) << "no operator from a loader worker thread in the trace";

  // profile.json holds the analysis and the verdict.
  const json report = json::parse(slurp(session->run->dir() / "profile.json"));
  EXPECT_EQ(report["analysis"]["steps"], 4);
  EXPECT_EQ(report["traces"].size(), 2u);
  EXPECT_FALSE(report["analysis"]["top_operators"].empty());
  EXPECT_FALSE(report["analysis"]["top_operators"][0]["input_shapes"].empty());
  EXPECT_THAT(report["verdict"]["bottleneck"].get<std::string>(),
              ::testing::AnyOf("data-bound", "host-bound", "compute-bound"));
}

TEST(Profiler, PlainJsonWhenGzipIsOffAndDistributedInfoWhenDistributed) {
  TempDir dir;
  Config config = mlp_config(dir.path(), profile_overrides({"data.num_workers=0"}));
  apply_runtime_settings(config);
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  ProfilerOptions options =
      profiler_options(config, dir / "traces", torch::kCPU, /*rank=*/1, /*world_size=*/2);
  options.gzip = false;
  options.backend = "gloo";
  auto profiler = std::make_shared<Profiler>(options);
  trainer.add_hook(profiler);
  for (int k = 0; k < 5; ++k) trainer.train_step();
  profiler->finish(trainer);
  ASSERT_EQ(profiler->traces().size(), 1u);
  const auto& path = profiler->traces()[0];
  EXPECT_TRUE(path.string().ends_with(".pt.trace.json"));
  const std::string bytes = slurp(path);
  ASSERT_FALSE(profile_detail::is_gzip(bytes));
  const json trace = json::parse(bytes);
  EXPECT_EQ(trace["distributedInfo"]["rank"], 1);
  EXPECT_EQ(trace["distributedInfo"]["world_size"], 2);
  EXPECT_EQ(trace["distributedInfo"]["backend"], "gloo");
}

TEST(Profiler, FinishSavesAWindowThatIsStillRecording) {
  TempDir dir;
  Config config =
      mlp_config(dir.path(), {"data.num_workers=0", "profile.skip_first=0", "profile.wait=0",
                              "profile.warmup=0", "profile.active=10", "profile.repeat=1"});
  apply_runtime_settings(config);
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  auto profiler =
      std::make_shared<Profiler>(profiler_options(config, dir / "traces", torch::kCPU, 0, 1));
  trainer.add_hook(profiler);
  for (int k = 0; k < 3; ++k) trainer.train_step();
  EXPECT_TRUE(profiler->traces().empty());
  profiler->finish(trainer);
  ASSERT_EQ(profiler->traces().size(), 1u);
  EXPECT_EQ(analyze_traces({read_trace(profiler->traces()[0])}).steps, 3);
  profiler->finish(trainer);  // idempotent
  EXPECT_EQ(profiler->traces().size(), 1u);
}

// Profiling observes; it must not change a single bit of the results.
TEST(Profiler, LossesAreBitwiseEqualWithAndWithoutTheProfiler) {
  TempDir dir;
  for (const char* workers : {"data.num_workers=0", "data.num_workers=2"}) {
    Config config =
        mlp_config(dir.path(), profile_overrides({workers, "profile.repeat=0", "run.threads=1"}));
    auto losses = [&](bool profiled) {
      apply_runtime_settings(config);
      Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
      std::shared_ptr<Profiler> profiler;
      if (profiled) {
        profiler =
            std::make_shared<Profiler>(profiler_options(config, dir / "traces", torch::kCPU, 0, 1));
        trainer.add_hook(profiler);
      }
      std::vector<double> out;
      for (int k = 0; k < 12; ++k) out.push_back(trainer.train_step().loss);
      if (profiler) {
        // Cycles of 4 after one skipped step: windows end at steps 4 and 8; step 11 is
        // recording when finish() saves it.
        profiler->finish(trainer);
        EXPECT_EQ(profiler->traces().size(), 3u);
      }
      return out;
    };
    EXPECT_EQ(losses(false), losses(true)) << workers;
  }
}

// The profiler pauses and resumes the loader's workers around each window: the batches and their
// order must not change.
TEST(Profiler, PausingTheLoaderWorkersKeepsTheBatchSequence) {
  TempDir dir;
  const Config config = mlp_config(dir.path());
  const Datasets data = make_datasets(config);
  LoaderOptions options;
  options.batch_size = 16;
  options.num_workers = 3;
  options.prefetch = 2;
  options.seed = 5;
  Loader reference(data.train, options), paused(data.train, options);
  for (int k = 0; k < 40; ++k) {
    if (k % 7 == 3) {
      paused.pause_workers();
      paused.pause_workers();  // idempotent
      paused.resume_workers();
      paused.resume_workers();
    }
    const Batch a = reference.next(), b = paused.next();
    ASSERT_TRUE(torch::equal(a.inputs, b.inputs)) << "batch " << k;
    ASSERT_TRUE(torch::equal(a.targets, b.targets)) << "batch " << k;
  }
  EXPECT_EQ(reference.position(), paused.position());
}

// ---- bad input ----------------------------------------------------------------------------------

TEST(Profiler, ActiveZeroIsAConfigError) {
  TempDir dir;
  EXPECT_THROW(mlp_config(dir.path(), {"profile.active=0"}), UserError);
  write_text(dir / "cfg.toml", "[profile]\nactive = 0\n");
  auto result = run_kiln("profile " + (dir / "cfg.toml").string());
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_THAT(result.err, HasSubstr("profile.active"));
  EXPECT_THAT(result.err, HasSubstr("cfg.toml:2"));
}

TEST(Profiler, UnwritableTraceDirectoryFailsBeforeTrainingStarts) {
  TempDir dir;
  write_text(dir / "a-file", "x");
  const std::string bad = (dir / "a-file" / "traces").string();  // a path under a regular file
  Config config = mlp_config(dir.path(), profile_overrides({"profile.dir=" + bad}));
  auto session = open_session(config, {});
  try {
    run_profile(*session);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_THAT(e.what(), HasSubstr("profile.dir"));
    EXPECT_THAT(e.what(), HasSubstr(bad));
    EXPECT_THAT(e.what(), HasSubstr("--set profile.dir="));
  }
  EXPECT_EQ(session->trainer->step(), 0);  // not one step ran
  auto cli = run_kiln("profile --set run.dir=" + dir.path().string() + " --set profile.dir=" + bad +
                      " --set run.progress=off " + (source_dir() / "configs/mlp.toml").string());
  EXPECT_EQ(cli.exit_code, 2) << cli.err;
  const auto error_line = cli.err.find("kiln: error: profile.dir");
  ASSERT_NE(error_line, std::string::npos) << cli.err;
  EXPECT_EQ(cli.err.find('\n', error_line), cli.err.size() - 1) << cli.err;  // one line, the last
  EXPECT_FALSE(std::filesystem::exists(dir / "mlp" / "metrics.jsonl") &&
               !slurp(dir / "mlp" / "metrics.jsonl").empty());  // no step ran
}

TEST(Profiler, CorruptOrForeignTraceFilesAreUserErrors) {
  TempDir dir;
  write_text(dir / "cut.pt.trace.json.gz",
             profile_detail::gzip_compress("{\"traceEvents\": []}").substr(0, 12));
  EXPECT_THROW(read_trace(dir / "cut.pt.trace.json.gz"), UserError);
  write_text(dir / "bad.pt.trace.json", "{not json");
  EXPECT_THROW(read_trace(dir / "bad.pt.trace.json"), UserError);
  EXPECT_THROW(analyze_traces({json::object()}), UserError);
  EXPECT_THROW(analyze_traces({json{{"traceEvents", json::array()}}}), UserError);  // no steps
  EXPECT_EQ(profile_detail::gzip_decompress(profile_detail::gzip_compress("abc"), "x"), "abc");
}

TEST(Profiler, GzipFeedsZlibInChunks) {
  // zlib counts in 32 bits; traces over 4 GiB go through in chunks. Small chunks here exercise
  // the same loop: every chunking round-trips, and a cut stream is still a UserError.
  std::string text;
  for (int k = 0; k < 40000; ++k) text += fmt::format("{{\"ts\": {}, \"name\": \"aten::mm\"}},", k);
  const std::string whole = profile_detail::gzip_compress(text);
  for (size_t chunk : {size_t{1}, size_t{7}, size_t{4096}}) {
    const std::string chunked = profile_detail::gzip_compress(text, chunk);
    EXPECT_EQ(profile_detail::gzip_decompress(chunked, "x"), text) << "chunk " << chunk;
    EXPECT_EQ(profile_detail::gzip_decompress(whole, "x", chunk), text) << "chunk " << chunk;
    EXPECT_THROW(profile_detail::gzip_decompress(whole.substr(0, whole.size() / 2), "x", chunk),
                 UserError);
  }
  EXPECT_GT(text.size(), size_t{1} << 20);  // more than one output buffer
  EXPECT_EQ(profile_detail::gzip_decompress(profile_detail::gzip_compress(""), "x", 3), "");
}

// ---- the ladder ---------------------------------------------------------------------------------

TEST(Profiler, LadderRunsCompileThenProfileRightAfterBaseline) {
  // The rungs kiln/rungs.h declares (each a run_* entry point); the ladder holds each once.
  const std::set<std::string> declared = {"baseline",   "compile", "profile", "scale",
                                          "checkpoint", "pilot",   "plan"};
  std::vector<std::string> names;
  for (const auto& rung : ladder_rungs()) {
    EXPECT_TRUE(declared.count(rung.name)) << rung.name << " is not a rung kiln/rungs.h declares";
    EXPECT_TRUE(rung.enabled) << rung.name << " has no enabled()";
    EXPECT_TRUE(rung.run) << rung.name << " has no run()";
    EXPECT_EQ(std::count(names.begin(), names.end(), rung.name), 0) << rung.name << " twice";
    names.push_back(rung.name);
  }
  for (const auto& name : declared) {
    EXPECT_EQ(std::count(names.begin(), names.end(), name), 1)
        << name << " is declared in kiln/rungs.h but is not in ladder_rungs()";
  }
  auto baseline = std::find(names.begin(), names.end(), "baseline");
  auto profile = std::find(names.begin(), names.end(), "profile");
  ASSERT_NE(baseline, names.end()) << "the ladder has no baseline rung";
  ASSERT_NE(profile, names.end()) << "the ladder has no profile rung";
  // The guide's order: baseline, compile (when a compiled step is asked for), then profile,
  // which explains the step the user will run, with nothing else between.
  std::string order;
  for (const auto& name : names) order += (order.empty() ? "" : ", ") + name;
  auto compile = std::find(names.begin(), names.end(), "compile");
  EXPECT_EQ(compile - baseline, 1) << "ladder order: " << order;
  EXPECT_EQ(profile - compile, 1) << "ladder order: " << order;
  // The compile rung runs only when compile.backend asks for a compiled step.
  TempDir dir;
  const auto& compile_rung = ladder_rungs()[static_cast<size_t>(compile - names.begin())];
  EXPECT_FALSE(compile_rung.enabled(mlp_config(dir.path())));
  EXPECT_TRUE(compile_rung.enabled(mlp_config(dir.path(), {"compile.backend=inductor"})));
}

}  // namespace
}  // namespace kiln::testing
