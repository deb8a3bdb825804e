// Unit tests of the distributed runtime: the launcher environment, bucket assignment, and DDP's
// logic with two ranks as two threads of this process (tests/ckpt/thread_comm.h: a failing rank
// poisons the group, so the other fails at once instead of hanging). The
// multi-process tests (torchrun, Gloo, faults) are in tests/dist/CMakeLists.txt.
#include "kiln/dist.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "ckpt/thread_comm.h"  // ThreadGroup / ThreadCommunicator: ranks as threads, fail-fast
#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/session.h"
#include "support/helpers.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;

// ---- the launcher's environment
// -------------------------------------------------------------------

DistEnvironment read_env(const std::map<std::string, std::string>& vars,
                         const Config& config = Config::defaults()) {
  return read_dist_environment(ProcessGroupOptions::from_config(config),
                               [&](const char* name) -> const char* {
                                 auto it = vars.find(name);
                                 return it == vars.end() ? nullptr : it->second.c_str();
                               });
}

std::string env_error(const std::map<std::string, std::string>& vars,
                      const Config& config = Config::defaults()) {
  try {
    read_env(vars, config);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

const std::map<std::string, std::string> kTorchrun = {{"RANK", "3"},
                                                      {"WORLD_SIZE", "4"},
                                                      {"LOCAL_RANK", "1"},
                                                      {"LOCAL_WORLD_SIZE", "2"},
                                                      {"MASTER_ADDR", "node7"},
                                                      {"MASTER_PORT", "29555"},
                                                      {"TORCHELASTIC_RESTART_COUNT", "2"},
                                                      {"TORCHELASTIC_USE_AGENT_STORE", "True"}};

TEST(DistEnvironment, NoLauncherIsOneProcess) {
  DistEnvironment env = read_env({});
  EXPECT_EQ(env.launcher, "none");
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.rank, 0);
}

TEST(DistEnvironment, AWorldOfOneGetsAProcessGroupOnlyUnderTorchrunWithAnExplicitBackend) {
  EXPECT_FALSE(read_env({}).process_group);
  EXPECT_TRUE(read_env(kTorchrun).process_group);  // world 4
  const std::map<std::string, std::string> one = {
      {"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29501"}};
  EXPECT_FALSE(read_env(one).process_group);  // dist.backend = "auto": no process group
  Config gloo = Config::defaults();
  gloo.set("dist.backend", std::string("gloo"));
  const DistEnvironment env = read_env(one, gloo);
  EXPECT_TRUE(env.process_group);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.master_port, 29501);
  auto no_master = one;
  no_master.erase("MASTER_ADDR");  // the process group needs the rendezvous
  EXPECT_THAT(env_error(no_master, gloo), HasSubstr("MASTER_ADDR"));
}

TEST(DistEnvironment, ReadsTorchrunVariables) {
  DistEnvironment env = read_env(kTorchrun);
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "node7");
  EXPECT_EQ(env.master_port, 29555);
  EXPECT_EQ(env.restart_count, 2);
  EXPECT_TRUE(env.agent_store);
  auto manual = kTorchrun;
  manual.erase("TORCHELASTIC_USE_AGENT_STORE");
  EXPECT_FALSE(read_env(manual).agent_store);  // rank 0 hosts the store then
}

TEST(DistEnvironment, WorldSizeWithoutMasterAddressIsAClearError) {
  const std::string error = env_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_THAT(error, HasSubstr("WORLD_SIZE=2"));
  EXPECT_THAT(error, HasSubstr("MASTER_ADDR"));
  EXPECT_THAT(error, HasSubstr("dist.master_addr"));
  // The config can name the master instead; the port then defaults to dist.master_port.
  Config config = Config::defaults();
  config.set_from_string("dist.master_addr=head-node");
  DistEnvironment env = read_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, config);
  EXPECT_EQ(env.master_addr, "head-node");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(DistEnvironment, BadValuesNameTheVariable) {
  auto vars = kTorchrun;
  vars["RANK"] = "4";
  EXPECT_THAT(env_error(vars), HasSubstr("rank 4 is outside the world of 4"));
  vars["RANK"] = "two";
  EXPECT_THAT(env_error(vars), HasSubstr("RANK=\"two\""));
  vars = kTorchrun;
  vars.erase("RANK");
  EXPECT_THAT(env_error(vars), HasSubstr("RANK is not set"));
  vars = kTorchrun;
  vars["MASTER_PORT"] = "70000";
  EXPECT_THAT(env_error(vars), HasSubstr("MASTER_PORT"));
}

TEST(DistEnvironment, WorldOfOneNeedsNoMaster) {
  DistEnvironment env = read_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.world_size, 1);
}

TEST(DistEnvironment, ReadsSlurmVariables) {
  const std::map<std::string, std::string> slurm = {{"SLURM_PROCID", "5"},
                                                    {"SLURM_NTASKS", "8"},
                                                    {"SLURM_LOCALID", "1"},
                                                    {"SLURM_STEP_ID", "0"},
                                                    {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                                    {"MASTER_ADDR", "gpu001"}};
  DistEnvironment env = read_env(slurm);
  EXPECT_EQ(env.launcher, "slurm");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "gpu001");
  auto no_master = slurm;
  no_master.erase("MASTER_ADDR");
  EXPECT_THAT(env_error(no_master), HasSubstr("SLURM_NTASKS=8 is set but MASTER_ADDR is not"));
  // A batch script (no srun step) or a single task is one process.
  auto batch = slurm;
  batch.erase("SLURM_STEP_ID");
  EXPECT_EQ(read_env(batch).launcher, "none");
}

TEST(DistEnvironment, LauncherKeyForcesTheChoice) {
  Config none = Config::defaults();
  none.set_from_string("dist.launcher=none");
  EXPECT_EQ(read_env(kTorchrun, none).world_size, 1);
  Config slurm = Config::defaults();
  slurm.set_from_string("dist.launcher=slurm");
  EXPECT_THAT(env_error(kTorchrun, slurm), HasSubstr("SLURM_PROCID"));
  Config torchrun = Config::defaults();
  torchrun.set_from_string("dist.launcher=torchrun");
  EXPECT_THAT(env_error({}, torchrun), HasSubstr("WORLD_SIZE is not set"));
}

// ---- bucket assignment --------------------------------------------------------------------------

TEST(Buckets, FirstBucketIsSmallTheOthersFillToTheCap) {
  DataParallelOptions options;
  options.first_bucket_bytes = 100;
  options.bucket_bytes = 250;
  using Buckets = std::vector<std::vector<size_t>>;
  EXPECT_EQ(assign_buckets({60, 60, 100, 100, 100, 10}, options),
            (Buckets{{0, 1}, {2, 3, 4}, {5}}));
  // A parameter over the cap gets a bucket of its own; no empty trailing bucket.
  EXPECT_EQ(assign_buckets({1000, 10, 1000}, options), (Buckets{{0}, {1, 2}}));
  EXPECT_EQ(assign_buckets({100}, options), (Buckets{{0}}));
  EXPECT_TRUE(assign_buckets({}, options).empty());
}

TEST(Buckets, DefaultsAre25MiBAnd1MiB) {
  DataParallelOptions options = data_parallel_options(Config::defaults());
  EXPECT_EQ(options.bucket_bytes, 25 << 20);
  EXPECT_EQ(options.first_bucket_bytes, 1 << 20);
  Config config = Config::defaults();
  config.set_from_string("dist.bucket_mb=0.5");
  EXPECT_EQ(data_parallel_options(config).bucket_bytes, 512 << 10);
}

// ---- DDP with two ranks as two threads ----------------------------------------------------------

struct RunResult {
  std::vector<double> losses;
  std::vector<torch::Tensor> parameters;
  int64_t bucket_all_reduces = 0;
  size_t buckets = 0;
};

RunResult train_single(const Config& config, int64_t steps) {
  apply_runtime_settings(config);
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  RunResult out;
  for (int64_t k = 0; k < steps; ++k) out.losses.push_back(trainer.train_step().loss);
  for (const auto& p : trainer.model().parameters()) out.parameters.push_back(p.detach().clone());
  return out;
}

// Each rank's trainer in its own thread; rank 1's model is built from another seed, so the
// initial broadcast is what makes the replicas equal.
std::vector<RunResult> train_two_threads(const Config& config, int64_t steps,
                                         DataParallelOptions options = {}) {
  std::vector<RunResult> results(2);
  apply_runtime_settings(config);
  run_ranks(2, [&](Communicator& borrowed) {
    const int rank = borrowed.rank();
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    Config model_config = config;
    if (rank == 1) model_config.set("run.seed", int64_t{777});
    Trainer trainer(TrainerSetup::from_config(config), make_model(model_config),
                    make_datasets(config), TrainerOptions{torch::kCPU, rank, 2, comm});
    auto ddp = DataParallel::attach(trainer, comm, options);
    for (int64_t k = 0; k < steps; ++k) results[rank].losses.push_back(trainer.train_step().loss);
    for (const auto& p : trainer.model().parameters())
      results[rank].parameters.push_back(p.detach().clone());
    results[rank].bucket_all_reduces = ddp->bucket_all_reduces();
    results[rank].buckets = ddp->bucket_bytes().size();
  });
  return results;
}

double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

void expect_equivalent(const RunResult& single, const RunResult& rank0, double tolerance) {
  ASSERT_EQ(single.losses.size(), rank0.losses.size());
  for (size_t k = 0; k < single.losses.size(); ++k) {
    EXPECT_NEAR(rank0.losses[k], single.losses[k], tolerance * std::abs(single.losses[k]))
        << "step " << k + 1;
  }
  ASSERT_EQ(single.parameters.size(), rank0.parameters.size());
  for (size_t k = 0; k < single.parameters.size(); ++k) {
    EXPECT_LE(relative_difference(rank0.parameters[k], single.parameters[k]), tolerance)
        << "parameter " << k;
  }
}

TEST(DataParallel, TwoRanksOfHalfTheBatchMatchOneProcess) {
  TempDir dir;
  // Small buckets, so several all-reduces start during backward.
  DataParallelOptions options;
  options.first_bucket_bytes = 4096;
  options.bucket_bytes = 64 << 10;
  RunResult single =
      train_single(mlp_config(dir.path(), {"train.batch_size=32", "data.num_workers=0"}), 20);
  auto ranks = train_two_threads(
      mlp_config(dir.path(), {"train.batch_size=16", "data.num_workers=0"}), 20, options);
  expect_equivalent(single, ranks[0], 1e-5);
  // The replicas stay bit-identical.
  for (size_t k = 0; k < ranks[0].parameters.size(); ++k) {
    EXPECT_TRUE(torch::equal(ranks[0].parameters[k], ranks[1].parameters[k])) << "parameter " << k;
  }
  EXPECT_EQ(ranks[0].losses, ranks[1].losses);
  EXPECT_GT(ranks[0].buckets, 1u);
  EXPECT_EQ(ranks[0].bucket_all_reduces, 20 * static_cast<int64_t>(ranks[0].buckets));
}

TEST(DataParallel, AccumulationAllReducesOnlyOnTheLastMicroStep) {
  TempDir dir;
  DataParallelOptions options;
  options.first_bucket_bytes = 64 << 10;
  options.bucket_bytes = 256 << 10;
  // SGD with momentum: AdamW divides each gradient element by its own running magnitude, so for
  // elements whose gradient is ~0 (a cancelling sum) fp32 summation-order noise becomes a visible
  // update difference; SGD keeps parameter differences at the gradients' own ~1e-7 level.
  const std::vector<std::string> gpt = {
      "train.grad_accum_steps=2", "data.num_workers=0", "train.clip_grad_norm=0.5",
      "optim.name=sgd",           "optim.lr=0.3",       "optim.momentum=0.9"};
  auto with = [&](const std::string& batch) {
    auto extra = gpt;
    extra.push_back(batch);
    return gpt_config(dir.path(), extra);
  };
  RunResult single = train_single(with("train.batch_size=8"), 8);
  auto ranks = train_two_threads(with("train.batch_size=4"), 8, options);
  expect_equivalent(single, ranks[0], 1e-5);
  // One all-reduce per bucket per optimizer step, not per micro-step.
  EXPECT_GT(ranks[0].buckets, 1u);
  EXPECT_EQ(ranks[0].bucket_all_reduces, 8 * static_cast<int64_t>(ranks[0].buckets));
}

// The MLP plus a bias `gate` added to its logits only while `gate_open`: a parameter that gets
// gradient on some micro-steps of a step and not on others.
class GatedModel final : public Model {
 public:
  GatedModel(std::shared_ptr<Model> inner, int64_t num_classes)
      : inner_(register_module("inner", std::move(inner))),
        gate(register_parameter("gate", torch::zeros({num_classes}))) {}
  torch::Tensor forward(const torch::Tensor& inputs) override {
    torch::Tensor logits = inner_->forward(inputs);
    return gate_open ? logits + gate : logits;
  }
  std::string architecture() const override { return inner_->architecture(); }
  nlohmann::json describe() const override { return inner_->describe(); }
  double train_flops_per_sample(int64_t seq_len) const override {
    return inner_->train_flops_per_sample(seq_len);
  }
  std::vector<ModelUnit> units() const override {  // the inner model's, under "inner."
    std::vector<ModelUnit> out = inner_->units();
    for (auto& unit : out) {
      unit.name = "inner." + unit.name;
      for (auto& name : unit.parameters) name = "inner." + name;
    }
    return out;
  }

 private:
  std::shared_ptr<Model> inner_;

 public:
  torch::Tensor gate;
  bool gate_open = true;
};

// Opens the gate on micro-step 0 only, and records the gate's gradient when gradients are ready.
class GateProbe final : public TrainerHook {
 public:
  GateProbe(GatedModel* model, bool drives_gate) : model_(model), drives_gate_(drives_gate) {}
  void on_micro_step_begin(Trainer&, int micro_step, bool) override {
    if (drives_gate_) model_->gate_open = micro_step == 0;
  }
  void on_gradients_ready(Trainer&) override {
    const torch::Tensor& grad = model_->gate.grad();
    grads.push_back(grad.defined() ? grad.detach().clone() : torch::Tensor());
  }
  std::vector<torch::Tensor> grads;

 private:
  GatedModel* model_;
  bool drives_gate_;
};

TEST(DataParallel, AGradientFromAnEarlierMicroStepOnlyIsAveragedNotDropped) {
  // The gate is used on micro-step 0 of 2: on the last micro-step its hook never fires, yet its
  // accumulated gradient must enter the all-reduce (not be replaced by zeros).
  TempDir dir;
  const Config config =
      mlp_config(dir.path(), {"train.grad_accum_steps=2", "train.batch_size=4",
                              "data.num_workers=0", "optim.name=sgd", "optim.lr=0.1"});
  apply_runtime_settings(config);
  constexpr int64_t kSteps = 3;
  std::vector<std::shared_ptr<GateProbe>> before(2), after(2);
  std::vector<torch::Tensor> final_gate(2);
  run_ranks(2, [&](Communicator& borrowed) {
    const int rank = borrowed.rank();
    std::shared_ptr<Communicator> comm(&borrowed, [](Communicator*) {});
    auto model =
        std::make_shared<GatedModel>(make_model(config), config.get_int("model.num_classes"));
    Trainer trainer(TrainerSetup::from_config(config), model, make_datasets(config),
                    TrainerOptions{torch::kCPU, rank, 2, comm});
    // Hooks run in order: the local gradient, DDP's averaging, then the averaged gradient.
    before[rank] = std::make_shared<GateProbe>(model.get(), /*drives_gate=*/true);
    trainer.add_hook(before[rank]);
    DataParallel::attach(trainer, comm, {});
    after[rank] = std::make_shared<GateProbe>(model.get(), /*drives_gate=*/false);
    trainer.add_hook(after[rank]);
    for (int64_t k = 0; k < kSteps; ++k) trainer.train_step();
    final_gate[rank] = model->gate.detach().clone();
  });
  for (int64_t k = 0; k < kSteps; ++k) {
    const torch::Tensor& local0 = before[0]->grads[k];
    const torch::Tensor& local1 = before[1]->grads[k];
    ASSERT_TRUE(local0.defined() && local1.defined()) << "step " << k + 1;
    EXPECT_GT(local0.abs().max().item<double>(), 0) << "step " << k + 1;
    const torch::Tensor expected = (local0 + local1) / 2;
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(after[r]->grads[k].defined());
      EXPECT_TRUE(torch::allclose(after[r]->grads[k], expected, 1e-6, 1e-9))
          << "rank " << r << " step " << k + 1 << ": " << after[r]->grads[k] << " vs " << expected;
    }
  }
  EXPECT_GT(final_gate[0].abs().max().item<double>(), 0);  // the gate trained
  EXPECT_TRUE(torch::equal(final_gate[0], final_gate[1]));
}

TEST(DataParallel, AFailingRankStopsTheOtherInsteadOfHanging) {
  TempDir dir;
  const Config config = mlp_config(dir.path(), {"data.num_workers=0"});
  EXPECT_THROW(run_ranks(2,
                         [&](Communicator& comm) {
                           if (comm.rank() == 1) throw TrainingError("rank 1 failed on purpose");
                           // Rank 0 enters the initial broadcast, which rank 1 never joins.
                           std::shared_ptr<Communicator> borrowed(&comm, [](Communicator*) {});
                           Trainer trainer(TrainerSetup::from_config(config), make_model(config),
                                           make_datasets(config),
                                           TrainerOptions{torch::kCPU, 0, 2, borrowed});
                           DataParallel::attach(trainer, borrowed, {});
                         }),
               TrainingError);
}

TEST(DataParallel, WorldOfOneAddsNothing) {
  TempDir dir;
  Config config = mlp_config(dir.path());
  Trainer trainer(TrainerSetup::from_config(config), make_model(config), make_datasets(config));
  auto ddp = DataParallel::attach(trainer, single_process_communicator(), {});
  trainer.train_step();
  EXPECT_EQ(ddp->bucket_all_reduces(), 0);
}

// ---- the scale rung's launch from one process (kiln scale / the ladder)
// --------------------------

// The last non-empty line of stderr, and whether it is the only "kiln: error" line.
std::string last_error_line(const std::string& err) {
  const auto begin = err.rfind("kiln: error:");
  if (begin == std::string::npos) return "(no kiln: error line) " + err;
  return err.substr(begin, err.find('\n', begin) - begin);
}

TEST(ScaleLaunch, AnUnwritableRunDirectoryIsAUserErrorNotAnInternalOne) {
  TempDir dir;
  write_text(dir / "file", "not a directory");
  const auto cli =
      run_kiln("scale " + (source_dir() / "configs/mlp.toml").string() +
               " --set dist.scale_processes=2 --set run.dir=" + (dir / "file").string() +
               " --set run.progress=off");
  EXPECT_EQ(cli.exit_code, 2) << cli.err;
  EXPECT_THAT(last_error_line(cli.err), HasSubstr("cannot create")) << cli.err;
  EXPECT_THAT(last_error_line(cli.err), HasSubstr("run.dir")) << cli.err;
  EXPECT_THAT(cli.err, ::testing::Not(HasSubstr("internal error")));
}

TEST(ScaleLaunch, APartialScaleJsonFromTheRanksIsAUserError) {
  // A stand-in for torchrun that leaves a cut scale.json where the ranks write theirs
  // (<run dir>/scale/, next to scale-launch.toml) and fails.
  TempDir dir;
  const auto fake = dir / "fake-torchrun";
  write_text(fake,
             "#!/bin/sh\n"
             "for a; do case \"$a\" in *scale-launch.toml) d=$(dirname \"$a\");; esac; done\n"
             "printf '{\"passed\": tr' > \"$d/scale.json\"\n"
             "exit 1\n");
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  const auto cli = run_kiln("scale " + (source_dir() / "configs/mlp.toml").string() +
                            " --set dist.scale_processes=2 --set dist.torchrun=" + fake.string() +
                            " --set run.dir=" + dir.path().string() +
                            " --set run.name=job --set run.progress=off");
  EXPECT_EQ(cli.exit_code, 2) << cli.err;
  EXPECT_THAT(last_error_line(cli.err), HasSubstr((dir / "job" / "scale" / "scale.json").string()))
      << cli.err;
  EXPECT_THAT(last_error_line(cli.err), HasSubstr("rerun")) << cli.err;
  EXPECT_THAT(cli.err, ::testing::Not(HasSubstr("internal error")));
  // The ranks were told to be their own run under the caller's.
  EXPECT_TRUE(std::filesystem::exists(dir / "job" / "scale" / "scale-launch.toml"));
}

TEST(Communicator, DefaultAsyncAllReduceRunsTheBlockingOne) {
  auto comm = single_process_communicator();
  auto t = torch::ones({3});
  auto pending = comm->all_reduce_sum_async(t);
  pending->wait();
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));
  EXPECT_EQ(comm->backend_name(), "none");
  EXPECT_EQ(comm->stats().collectives, 0);
}

}  // namespace
}  // namespace kiln::testing
