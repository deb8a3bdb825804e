// The composition root (kiln/job.h): a job resolved once, and the one place the pieces of a step
// and the hooks of a run are installed, in their written order.
#include "kiln/job.h"

#include <fmt/format.h>

#include "core/counters.h"
#include "core/files.h"
#include "core/records.h"
#include "core/strings.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/plan.h"
#include "kiln/session.h"
#include "kiln/tensorboard.h"
#include "rungs/plan_tracking.h"

namespace kiln {

Job resolve_job(const Config& given, const JobRequest& request) {
  if (request.overwrite && !request.resume.empty()) {
    throw UserError("--overwrite starts a run afresh and --resume continues one: give one");
  }
  // run.name resolved into the config the run saves, so its config.toml trains into the same
  // directory again (an empty name takes the file's stem, which is "config" there).
  Job job{with_resolved_run_name(given), request};
  job.run_dir = run_directory(job.config);
  // checkpoint.dir resolved once: a resume keeps the saved run's checkpoint settings, never its
  // directory, so the directory the resume is searched in is the one the run saves into.
  const std::filesystem::path checkpoint_dir = checkpoint_directory(job.config, job.run_dir);
  job.resume = locate_resume(request.resume, checkpoint_dir);
  // The saved run's checkpoint settings (except the keys set): what a resumed run saves with.
  if (job.resume.index) job.config = resume_config(job.config, job.resume, request.set_keys);
  const Config& config = job.config;
  job.checkpoint = training_checkpoint_options(config, job.run_dir, checkpoint_dir);
  job.runtime = RuntimeOptions::from_config(config);
  job.trainer = TrainerSetup::from_config(config);
  job.compile = CompileOptions::from_config(config);
  job.ddp = data_parallel_options(config);
  job.fsdp = fsdp_options(config);
  job.group = ProcessGroupOptions::from_config(config);
  return job;
}

namespace {

// The job's ranks for resolve_strategy: "auto" may choose tensor parallelism only where the
// [compile] rule would allow dist.tp > 1.
StrategyWorld strategy_world(const Job& job, const Communicator& comm, int production_world_size) {
  StrategyWorld world;
  world.production_world_size = production_world_size;
  world.world_size = comm.world_size();
  world.local_world_size = comm.local_world_size();
  world.tensor_parallel_allowed = job.compile.backend == CompileOptions::Backend::kEager;
  return world;
}

// The one combination the [compile] rules cannot decide from the config: dist.strategy = "auto"
// picks fsdp by the model's memory, and FSDP composes with a compiled step only per unit. Asked
// before anything is written, of the model the run will train; "" when it trains.
std::string auto_strategy_problem(const Job& job, const Model& model, const torch::Device& device,
                                  const Communicator& comm, int production_world_size) {
  const CompileOptions& compile = job.compile;
  if (!comm.parallel() || compile.backend == CompileOptions::Backend::kEager ||
      job.group.strategy != ProcessGroupOptions::Strategy::kAuto)
    return "";
  if (compile.inductor() && compile.granularity == CompileOptions::Granularity::kUnit) return "";
  const StrategyChoice choice =
      resolve_strategy(job.config, model, device, strategy_world(job, comm, production_world_size));
  if (choice.strategy != Parallelism::kFsdp) return "";
  return fmt::format("{}: {}; set dist.strategy = \"ddp\" or compile.backend = \"eager\"",
                     choice.reason, fsdp_with_compile_problem());
}

std::string one_process_tp_problem(int64_t tp) {
  return fmt::format(
      "dist.tp = {} splits each layer over {} ranks, but this is one process; launch {} or more "
      "with torchrun (docs/scale.md) or set dist.tp = 1",
      tp, tp, tp);
}

// Rank 0 runs `work` (which returns a problem or throws); every rank throws rank 0's problem.
void agree_on_rank0(Communicator& comm, const std::function<std::string()>& work) {
  std::string error;
  if (comm.rank() == 0) {
    try {
      error = work();
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
  }
  if (comm.world_size() > 1) error = comm.all_gather_bytes(error)[0];
  if (!error.empty()) throw UserError(error);
}

}  // namespace

std::shared_ptr<RunLock> lock_run_directories(const Job& job, Communicator& comm,
                                              const std::function<std::string()>& precheck) {
  std::shared_ptr<RunLock> lock;
  agree_on_rank0(comm, [&]() -> std::string {
    if (precheck) {
      if (std::string problem = precheck(); !problem.empty()) return problem;
    }
    std::vector<const char*> args;
    for (const auto& arg : job.request.argv) args.push_back(arg.c_str());
    lock = lock_directories(
        {{job.run_dir, "run directory", "run.name", "run.dir"},
         {job.checkpoint.store.dir, "checkpoint directory", "checkpoint.dir", "checkpoint.dir"}},
        join_command_line(static_cast<int>(args.size()), args.data()));
    return "";
  });
  return lock;
}

ComposedStep compose_step(const Job& job, std::shared_ptr<Model> model, Datasets data,
                          const TrainerOptions& options, const StepComposition& composition) {
  ComposedStep out;
  // The mesh first: tensor parallelism (dist.tp) makes the trainer's ranks, whose data shards
  // and loss it averages, the data-parallel ones (the ranks of one tensor-parallel group read
  // the same batches).
  const bool parallel = options.comm && options.comm->parallel();
  TrainerOptions trainer_options = options;
  DeviceMesh mesh;
  if (parallel) {
    // dist.tp as set, or the tp degree dist.strategy = "auto" chose (throws UserError naming
    // dist.tp when it does not divide the world).
    out.strategy =
        resolve_strategy(job.config, *model, options.device,
                         strategy_world(job, *options.comm, composition.production_world_size));
    const MeshShape& shape = out.strategy.mesh;
    out.mesh = shape;
    // Hybrid sharding's and tensor parallelism's groups are created here, on every rank.
    mesh = build_device_mesh(options.comm, shape);
    trainer_options.rank = mesh.dp_index();
    trainer_options.world_size = shape.dp_size();
    trainer_options.comm = mesh.dp;
  } else if (job.group.tp > 1) {
    throw UserError(one_process_tp_problem(job.group.tp));
  }
  out.trainer =
      std::make_unique<Trainer>(job.trainer, std::move(model), std::move(data), trainer_options);
  Trainer& trainer = *out.trainer;
  // 1. Activation checkpointing: the outermost unit wrapper.
  if (job.trainer.train.activation_checkpointing == TrainOptions::ActivationCheckpointing::kBlock) {
    install_activation_checkpointing(trainer);
  }
  // 2. The parallel layout: tensor parallelism (the model sliced), then DDP or FSDP over the
  // data-parallel ranks (rank 0's weights everywhere).
  if (parallel) {
    if (out.mesh.tp > 1) install_tensor_parallel(trainer, mesh);
    // fsdp with a compiled step: refused before this, by the [compile] rule (dist.strategy =
    // "fsdp") or by compose_training's pre-check (dist.strategy = "auto" resolving to fsdp).
    if (out.strategy.strategy == Parallelism::kFsdp) {
      out.fsdp = FullyShardedDataParallel::attach(trainer, mesh, job.fsdp);
    } else {
      out.ddp = DataParallel::attach(trainer, mesh.dp, job.ddp);
    }
    // The same initial weights everywhere, but each data-parallel rank's own random stream
    // (dropout, ...), shared by the ranks of a tensor-parallel group.
    torch::manual_seed(job.runtime.seed + static_cast<uint64_t>(mesh.dp_index()));
  }
  if (composition.before_compilation) composition.before_compilation(out);
  // 3 and 4. Compilation (the step's executor, or per-unit packages innermost) and capture.
  if (composition.compile) {
    out.compiled = attach_compiled_step(trainer, job.config);
    out.captured = attach_captured_step(trainer, job.config);
  }
  return out;
}

std::unique_ptr<Session> compose_training(const Job& job, std::shared_ptr<Communicator> comm,
                                          const TrainingComposition& composition) {
  auto session = std::make_unique<Session>(Session{nullptr, job});
  session->comm = comm ? std::move(comm) : process_communicator(job.config);
  Communicator& group = *session->comm;
  const int rank = group.rank(), world_size = group.world_size();
  const bool parallel = group.parallel();  // DDP or FSDP, a process group of one too

  // The model and the data, built once, before the lock (rank 0's pre-check of dist.strategy =
  // "auto" reads the model's size) and before anything is written.
  apply_runtime_settings(job.runtime);
  session->device = resolve_device(job.runtime.device);
  if (session->device.is_cuda() && parallel) {  // one process per device: LOCAL_RANK's
    session->device =
        torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(group.local_rank()));
  }
  Datasets data = make_datasets(job.config);
  std::shared_ptr<Model> model = make_model(job.config);

  // One run per directory: locked once, for every rank, before anything is read or written
  // there. Before the lock (so a refused run leaves nothing behind), on rank 0: the compile
  // pre-check, and, when the run checkpoints, that a resume restores exactly the state this
  // model and optimizer make and that a saving run does not mix with another history in the
  // checkpoint directory.
  session->lock = lock_run_directories(job, group, [&] {
    if (composition.checkpointing)
      check_train_start(job.resume, job.checkpoint, *model, job.trainer.optim);
    // A mesh the world cannot hold (UserError naming dist.tp or dist.dp_replicate).
    if (parallel) {
      const int64_t tp = std::max<int64_t>(1, job.group.tp);  // 0: auto, at most one node's
      if (job.group.strategy == ProcessGroupOptions::Strategy::kFsdp) {
        fsdp_mesh_shape(job.group.dp_replicate, world_size, 1, tp);
      } else {
        ddp_mesh_shape(world_size, tp);
      }
      if (tp > group.local_world_size() && !job.group.tp_across_nodes) {
        return fmt::format(
            "dist.tp = {} is more than the {} ranks of one node (LOCAL_WORLD_SIZE): its "
            "all-reduces, two per layer each way, would cross the network; set dist.tp <= {} "
            "or dist.tp_across_nodes = true",
            job.group.tp, group.local_world_size(), group.local_world_size());
      }
    } else if (job.group.tp > 1) {
      return one_process_tp_problem(job.group.tp);
    }
    return auto_strategy_problem(job, *model, session->device, group,
                                 composition.step.production_world_size);
  });
  const bool continues = composition.checkpointing && job.resume.continues();
  RunOptions::Existing existing = composition.existing_records;
  if (composition.check_records) {
    existing = continues ? RunOptions::Existing::kReplace
               : (job.request.overwrite || job.resume.argument == "auto")
                   ? RunOptions::Existing::kMoveAside
                   : RunOptions::Existing::kRefuse;
    if (!continues) {
      agree_on_rank0(group, [&] {
        prepare_run_records(job.run_dir, composition.metrics_file, existing);
        return std::string();
      });
    }
  }

  // The run directory and its manifest.
  const nlohmann::json model_id = model_identity(*model);
  RunOptions run_options;
  run_options.argv = job.request.argv;
  run_options.writer = rank == 0;
  run_options.metrics_file = composition.metrics_file;
  run_options.append_metrics = continues;
  run_options.existing_records = existing;
  run_options.rung = composition.rung;
  session->run = std::make_unique<Run>(job.config, run_options);
  session->run->write_manifest(data.identity, model_id,
                               {{"device", session->device.str()}, {"world_size", world_size}});

  // The step: activation checkpointing -> layout -> (the state resumed, the first hooks) ->
  // compilation -> capture. The resume comes before compilation so the compiled step binds
  // restored tensors.
  TrainerOptions trainer_options;
  trainer_options.device = session->device;
  trainer_options.rank = rank;
  trainer_options.world_size = world_size;
  trainer_options.comm = session->comm;
  std::shared_ptr<PlanTrackingHook> tracking;
  StepComposition step_composition = composition.step;
  step_composition.before_compilation = [&](ComposedStep& step) {
    Trainer& trainer = *step.trainer;
    // Hooks, in this order. The plan's forecast for this run and, when it forecasts the step
    // time (a pilot of this job on this device, or a catalog row), the run tracked against it:
    // before the checkpoint hook, so a save after a step is time between steps, not inside one.
    // The layout resolved (dist.strategy = "auto" chose it, tp included): recorded beside the
    // manifest, where the forecast below and `kiln plan --actual` read the mesh.
    if (parallel) {
      StrategyRecord record;
      record.strategy = std::string(to_string(step.strategy.strategy));
      record.reason = step.strategy.reason;
      record.world_size = world_size;
      record.dp_replicate = step.mesh.dp_replicate;
      record.dp_shard = step.mesh.dp_shard;
      record.tp = step.mesh.tp;
      record.decision = step.strategy.decision;
      session->run->write_json("strategy.json", nlohmann::json(record));
    }
    if (composition.plan_tracking) {
      auto forecast = log_plan_forecast(job.config, session->run->dir(), rank);
      if (forecast && forecast->step_seconds > 0) {
        const TrainOptions& train = job.trainer.train;
        tracking =
            std::make_shared<PlanTrackingHook>(*session->run, std::move(*forecast), train.steps,
                                               world_size, train.metrics_every, train.log_every);
        trainer.add_hook(tracking);
        session->plan_tracking = tracking;
      }
    }
    // [checkpoint]: the resume, and the hook that saves.
    if (composition.checkpointing) {
      session->checkpoints = attach_checkpointing(trainer, group, job.checkpoint, job.resume);
    }
  };
  ComposedStep step =
      compose_step(job, std::move(model), std::move(data), trainer_options, step_composition);
  session->trainer = std::move(step.trainer);
  session->compiled = step.compiled;
  session->captured = step.captured;
  Trainer& trainer = *session->trainer;
  if (parallel) {
    session->strategy = step.strategy.strategy;
    session->strategy_reason = step.strategy.reason;
    session->strategy_decision = step.strategy.decision;
    session->mesh = step.mesh;
    session->fsdp = step.fsdp;
    log::info(
        fmt::format("strategy {}: {}", to_string(session->strategy), session->strategy_reason));
  }
  // SIGTERM / SIGUSR1: finish the step, commit a checkpoint, throw Preempted (exit 75).
  if (composition.preemption) {
    attach_preemption(trainer, group, session->checkpoints, job.checkpoint.preempt_timeout_seconds);
  }
  if (composition.tensorboard) trainer.add_hook(make_tensorboard_hook(*session->run));
  // The final plan record after the checkpoint hook's final save.
  if (tracking) trainer.add_hook(PlanTrackingHook::finisher(tracking));
  log::info("run directory " + session->run->dir().string() + " | " +
            model_id["architecture"].get<std::string>() + " with " +
            std::to_string(model_id["parameter_count"].get<int64_t>()) + " parameters on " +
            session->device.str());
  return session;
}

CompositionCounts composition_counts() {
  using counters::Event;
  return {counters::read(Event::kModelBuild), counters::read(Event::kCheckpointDirResolution),
          counters::read(Event::kDirectoryLock), counters::read(Event::kResumeIndexRead)};
}

void reset_composition_counts() {
  counters::reset();
}

}  // namespace kiln
