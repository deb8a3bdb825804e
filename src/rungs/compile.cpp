// The compile rung: eager against the compiled step (compile.backend, or "inductor" when that is
// eager) in one process, from the same initial weights on the same batches. Compile time apart
// (cold or cached), warm-up untimed, then interleaved timed steps, the shape probe (recompiles),
// the numerics gate (losses, eval losses through the eval graph, parameters), peak memory of a
// step on each side, the verdict.
#include "kiln/compile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/clock.h"
#include "core/strings.h"
#include "kiln/dist.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/models.h"
#include "kiln/results.h"
#include "kiln/rungs.h"
#include "rungs/compile_parts.h"
#include "rungs/device_rate.h"

namespace kiln {
namespace {

using nlohmann::json;

double relative_difference(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return INFINITY;
  return std::abs(a - b) / std::max(std::abs(b), 1e-12);
}

// Parameters after the same steps: the relative difference over all of them, ||a - b|| / ||b||
// with every tensor in one vector, and the tensor that differs most relative to its own norm
// (informative: a tensor whose gradient is zero in exact arithmetic, like an attention key bias,
// follows rounding noise that Adam normalises, and can differ more on its own).
struct ParameterDifference {
  double overall = 0;
  double worst_tensor = 0;
  std::string worst_name;
};

// The eval loss (and correct predictions) of one batch, eager, with the model in eval mode.
StepExecutor::EvalOutputs eager_eval(Model& model, const Batch& batch) {
  torch::NoGradGuard no_grad;
  model.eval();
  const torch::Tensor logits = model.forward(batch.inputs);
  StepExecutor::EvalOutputs out{model.loss(logits, batch.targets), {}};
  out.correct = model.correct_predictions(logits, batch.targets);  // undefined: no accuracy
  model.train();
  return out;
}

// The same through the compiled step's eval graph (eager when the batch must run eager).
StepExecutor::EvalOutputs compiled_eval(CompiledStep& step, Model& model, const Batch& batch) {
  StepExecutor::EvalOutputs out;
  {
    torch::NoGradGuard no_grad;
    model.eval();
    out = step.evaluate(batch);
    model.train();
  }
  return out.loss.defined() ? out : eager_eval(model, batch);
}

ParameterDifference parameter_difference(Model& compiled, Model& eager) {
  ParameterDifference out;
  double diff_squared = 0, norm_squared = 0;
  auto theirs = eager.named_parameters();
  for (const auto& item : compiled.named_parameters()) {
    const torch::Tensor& b = theirs[item.key()];
    const double diff = (item.value() - b).norm().item<double>();
    const double norm = b.norm().item<double>();
    diff_squared += diff * diff;
    norm_squared += norm * norm;
    const double relative = diff / std::max(norm, 1e-12);
    if (!(relative <= out.worst_tensor)) {
      out.worst_tensor = std::isnan(relative) ? INFINITY : relative;
      out.worst_name = item.key();
    }
  }
  out.overall = std::sqrt(diff_squared) / std::max(std::sqrt(norm_squared), 1e-12);
  if (std::isnan(out.overall)) out.overall = INFINITY;
  return out;
}

// Under DDP: per timed step, the wall time the training thread spent in Phase::kComm (waiting
// for the gradient buckets and the loss mean: communication not hidden behind compute), the
// collectives' busy time, and the collectives started before the gradients were ready (from
// autograd's hooks, during backward: the ones that can overlap it).
class CommMeter final : public TrainerHook {
 public:
  explicit CommMeter(const Communicator& comm) : comm_(comm) {}
  bool measuring = false;
  double exposed_seconds = 0, busy_seconds = 0;
  int64_t steps = 0, launched_in_backward = 0;

  void on_step_begin(Trainer&, int64_t) override {
    before_ = comm_.stats();
    in_step_ = true;
    seen_comm_ = false;
  }
  void on_phase_begin(Trainer&, Phase phase) override {
    if (phase != Phase::kComm) return;
    begun_ = SteadyClock::now();
    if (in_step_ && !seen_comm_ && measuring) {
      launched_in_backward += comm_.stats().collectives - before_.collectives;
    }
    seen_comm_ = true;
  }
  void on_phase_end(Trainer&, Phase phase) override {
    if (phase == Phase::kComm && measuring) exposed_seconds += seconds_since(begun_);
  }
  void on_step_end(Trainer&, const StepStats&) override {
    in_step_ = false;
    if (!measuring) return;
    busy_seconds += comm_.stats().busy_seconds - before_.busy_seconds;
    ++steps;
  }

 private:
  const Communicator& comm_;
  CommunicationStats before_;
  SteadyClock::time_point begun_{};
  bool in_step_ = false, seen_comm_ = false;
};

CompileSide compile_side(const std::vector<double>& seconds, int64_t tokens_per_step,
                         int64_t samples_per_step, const PeakMemory& peak, double flops_per_sample,
                         const std::optional<MatmulPeak>& matmul) {
  CompileSide side;
  side.median_seconds = percentile(seconds, 0.5);
  side.p90_seconds = percentile(seconds, 0.9);
  side.samples_per_second = static_cast<double>(samples_per_step) / side.median_seconds;
  if (tokens_per_step > 0)
    side.tokens_per_second = static_cast<double>(tokens_per_step) / side.median_seconds;
  side.peak_memory_bytes = peak.allocated_bytes;
  if (flops_per_sample > 0) {
    side.achieved_flops_per_second = flops_per_sample * side.samples_per_second;
    if (matmul && matmul->flops_per_second > 0)
      side.share_of_matmul_peak = *side.achieved_flops_per_second / matmul->flops_per_second;
  }
  return side;
}

}  // namespace

RungResult run_compile(Session& session) {
  const Config& config = session.job.config;
  CompileOptions options = session.job.compile;
  Config compiled_config = config;
  if (options.backend == CompileOptions::Backend::kEager) {
    compiled_config.set("compile.backend", std::string("inductor"));
    // The [compile] rules (train.activation_checkpointing, dist.strategy, ...) for the compiled
    // side: the line `kiln config validate` prints for compile.backend = "inductor".
    compiled_config.validate();
    options.backend = CompileOptions::Backend::kInductor;
  }
  const bool distributed = session.strategy != Parallelism::kNone;  // over a process group
  if (distributed && session.strategy != Parallelism::kDdp) {
    throw UserError(fmt::format(
        "the compile rung under torchrun measures the compiled step under DDP, but dist.strategy "
        "resolved to \"{}\" ({}); set dist.strategy = \"ddp\"",
        to_string(session.strategy), session.strategy_reason));
  }
  RungResult result;
  result.rung = "compile";
  Trainer& eager = *session.trainer;
  // The compiled side: the same job built again (same seed: same initial weights and batches),
  // composed as the eager side (activation checkpointing, DDP under torchrun: its gradients come
  // back from the package, and DDP reduces its buckets after it returns) plus the compiled step.
  Job compiled_job = session.job;
  compiled_job.config = compiled_config;
  compiled_job.compile = options;
  ComposedStep composed = compose_step(compiled_job, make_model(compiled_config),
                                       make_datasets(compiled_config), eager.options());
  Trainer& compiled = *composed.trainer;
  std::shared_ptr<CompiledStep> step = composed.compiled;           // AOTInductor
  std::shared_ptr<CapturedGraphStep> captured = composed.captured;  // CUDA graphs
  // The report of the compiler that decides graphs and recompiles: AOTInductor's when it runs
  // (the capture's is written beside it), else the capture's.
  auto report_of = [&]() -> const CompileReport& {
    return step ? step->report() : captured->report();
  };
  auto eager_log = std::make_shared<StepLog>();
  auto compiled_log = std::make_shared<StepLog>();
  eager.add_hook(eager_log);
  compiled.add_hook(compiled_log);
  eager.add_hook(std::make_shared<MetricsHook>(
      *session.run, [](json& record) { record["side"] = "eager"; }, /*record_evals=*/false));
  std::shared_ptr<CommMeter> eager_comm, compiled_comm;
  if (distributed) {
    eager_comm = std::make_shared<CommMeter>(*session.comm);
    compiled_comm = std::make_shared<CommMeter>(*session.comm);
    eager.add_hook(eager_comm);
    compiled.add_hook(compiled_comm);
  }

  // compile.json, filled as the rung goes and written once through its typed result.
  CompileResult out;
  out.backend = backend_name(options.backend);
  out.precision = precision_name(session.job.trainer.train.precision);
  out.dynamic = dynamic_name(options.dynamic);
  out.fullgraph = options.fullgraph;
  out.recompile_limit = options.recompile_limit;
  out.device = session.device.str();
  out.world_size = distributed ? session.comm->world_size() : 1;
  auto finish = [&](bool passed, const std::string& verdict) {
    out.status = {kResultSchemaVersion, passed, verdict, /*measured=*/true};
    out.compile_report = report_of().to_json();  // src/compile's layout
    if (step && captured) out.capture_report = captured->report().to_json();
    result.passed = passed;
    result.verdict = verdict;
    result.numbers = out;
    session.run->write_json("compile.json", json(out));
    return result;
  };

  // 1. Compile (or load from the cache) the training shape's graph, timed apart.
  std::vector<int64_t> first_indices(static_cast<size_t>(eager.train_options().batch_size));
  for (size_t k = 0; k < first_indices.size(); ++k) first_indices[k] = static_cast<int64_t>(k);
  const Batch example = eager.data().train->get(first_indices);
  const InputShapes train_shapes = InputShapes::of(example);
  // The eval graph's shape: a validation batch (Trainer::evaluate's batches have the train
  // batch size).
  std::optional<InputShapes> eval_shapes;
  if (eager.data().val->size() >= static_cast<int64_t>(first_indices.size())) {
    eval_shapes = InputShapes::of(eager.data().val->get(first_indices));
  }
  log::info(fmt::format("compile: {} step for {} (dynamic = {}, cache {})",
                        backend_name(options.backend), train_shapes.str(),
                        dynamic_name(options.dynamic), options.cache_dir.string()));
  const auto compile_begin = SteadyClock::now();
  try {
    if (step) step->prepare(train_shapes, eval_shapes);  // both at once when both are cold
    // A capture warms up, probes for host synchronisations and captures on its first steps:
    // take them (both sides, untimed) before timing.
    for (int64_t k = 0; captured && k <= options.warmup_steps; ++k) {
      eager.train_step(/*sync=*/true);
      compiled.train_step(/*sync=*/true);
    }
  } catch (const TrainingError& e) {  // graph breaks with compile.fullgraph = true
    result.table.emplace_back("graph breaks", describe_breaks(report_of().breaks));
    return finish(false, e.what());
  }
  const double compile_seconds =
      captured && !step
          ? (report_of().graphs.empty() ? 0.0 : report_of().graphs.front().build_seconds)
          : seconds_since(compile_begin);
  const auto& graphs = report_of().graphs;
  const auto& units = report_of().unit_graphs;  // per-unit mode: the pairs, no step graph
  const bool any_graph = !graphs.empty() || !units.empty();
  const bool cold = !graphs.empty()  ? !graphs.front().cache_hit
                    : !units.empty() ? std::any_of(units.begin(), units.end(),
                                                   [](const auto& u) { return !u.cache_hit; })
                                     : false;
  out.built = true;
  out.compile_seconds = compile_seconds;
  out.cache = any_graph ? (cold ? "cold" : "cached") : "n/a";
  if (report_of().fallback_to_eager) {
    result.table.emplace_back("graph breaks", describe_breaks(report_of().breaks));
    return finish(true,
                  fmt::format("stay eager: the step has {} graph break(s) and "
                              "compile.fullgraph = false, so it runs eager: {}",
                              report_of().breaks.size(), describe_breaks(report_of().breaks)));
  }

  // 2. Warm-up (untimed), then timed steps, interleaved so both sides see the same machine.
  //    Both sides take the same batches from their own loaders (same seed).
  std::vector<double> eager_seconds, compiled_seconds, loss_differences;
  std::vector<double> eager_losses, compiled_losses;
  double worst_loss_difference = 0;
  int64_t worst_loss_step = 0;
  for (int64_t k = 0; k < options.warmup_steps + options.steps; ++k) {
    if (distributed) eager_comm->measuring = compiled_comm->measuring = k >= options.warmup_steps;
    const StepStats e = eager.train_step(/*sync=*/true);
    const StepStats c = compiled.train_step(/*sync=*/true);
    eager_losses.push_back(e.loss);
    compiled_losses.push_back(c.loss);
    const double diff = relative_difference(c.loss, e.loss);
    if (!(diff <= worst_loss_difference)) {
      worst_loss_difference = diff;
      worst_loss_step = e.step;
    }
    if (k < options.warmup_steps) continue;
    eager_seconds.push_back(e.step_seconds);
    compiled_seconds.push_back(c.step_seconds);
  }
  if (distributed) eager_comm->measuring = compiled_comm->measuring = false;
  const int64_t samples_per_step = eager_log->steps.back().samples;
  const int64_t tokens_per_step = eager_log->steps.back().tokens;

  // 3. Peak memory of one step on each side (not timed).
  reset_peak_memory(session.device);
  eager.train_step(/*sync=*/true);
  const PeakMemory eager_peak = read_peak_memory(session.device);
  reset_peak_memory(session.device);
  compiled.train_step(/*sync=*/true);
  const PeakMemory compiled_peak = read_peak_memory(session.device);
  {
    const double diff =
        relative_difference(compiled_log->steps.back().loss, eager_log->steps.back().loss);
    if (!(diff <= worst_loss_difference)) {
      worst_loss_difference = diff;
      worst_loss_step = eager_log->steps.back().step;
    }
  }

  // 3b. Evaluation on both sides (the compiled side through its eval graph, as kiln train
  //     evaluates): the same validation batches, after the same steps.
  double worst_eval_difference = 0;
  std::string worst_eval_where;
  if (eval_shapes) {
    const EvalStats e = eager.evaluate();
    const EvalStats c = compiled.evaluate();
    worst_eval_difference = relative_difference(c.loss, e.loss);
    worst_eval_where = fmt::format("the validation batches after step {}", eager.step());
    out.eval = CompileEval{e.loss, c.loss, worst_eval_difference, e.samples, {}, {}};
    if (e.accuracy >= 0) {
      out.eval->accuracy_eager = e.accuracy;
      out.eval->accuracy_compiled = c.accuracy;
    }
  }

  // 4. The shape probe: shorter sequences stand in for variable-length data. Each is one more
  //    step on both sides (same truncated batch), so numerics are checked on every graph.
  const bool tokens = example.inputs.dim() == 2 && example.targets.dim() == 2;
  if (tokens) {
    Batch next = eager.data().train->get(first_indices);
    for (int64_t length : options.probe_seq_lens) {
      if (length >= example.inputs.size(1)) continue;
      const size_t recompiles_before = report_of().recompiles.size();
      const size_t graphs_before = report_of().graphs.size();
      const size_t eval_recompiles_before = step ? step->report().eval_recompiles.size() : 0;
      const size_t eval_graphs_before = step ? step->report().eval_graphs.size() : 0;
      const Batch truncated{next.inputs.narrow(1, 0, length).contiguous(),
                            next.targets.narrow(1, 0, length).contiguous()};
      // A new shape's train and eval graphs build at once, as the first ones did.
      if (step) step->prepare(InputShapes::of(truncated), InputShapes::of(truncated));
      const StepStats e = eager.train_step_on({truncated});
      const StepStats c = compiled.train_step_on({truncated});
      const double diff = relative_difference(c.loss, e.loss);
      if (!(diff <= worst_loss_difference)) {
        worst_loss_difference = diff;
        worst_loss_step = e.step;
      }
      const auto& recompiles = report_of().recompiles;
      CompileProbe entry;
      entry.seq_len = length;
      entry.train = {
          recompiles.size() > recompiles_before, report_of().graphs.size() > graphs_before,
          recompiles.size() > recompiles_before && !recompiles.back().compiled, e.loss, c.loss};
      if (step) {  // the eval graph on the same batch: eval's own recompiles
        const double want = eager_eval(eager.model(), truncated).loss.item<double>();
        const double got = compiled_eval(*step, compiled.model(), truncated).loss.item<double>();
        const auto& eval_recompiles = step->report().eval_recompiles;
        const bool recompiled = eval_recompiles.size() > eval_recompiles_before;
        entry.eval =
            CompileProbeStep{recompiled, step->report().eval_graphs.size() > eval_graphs_before,
                             recompiled && !eval_recompiles.back().compiled, want, got};
        const double eval_diff = relative_difference(got, want);
        if (!(eval_diff <= worst_eval_difference)) {
          worst_eval_difference = eval_diff;
          worst_eval_where = fmt::format("the probe's batch of length {}", length);
        }
      }
      out.probe.push_back(entry);
    }
  }

  // 5. Numerics: losses of every step and the parameters after all of them.
  const ParameterDifference parameters = parameter_difference(compiled.model(), eager.model());
  const auto& report = report_of();
  out.timed = true;
  out.graphs = static_cast<int64_t>(report.graphs.size());  // the training step's; eval's apart
  out.eval_graphs = step ? static_cast<int64_t>(step->report().eval_graphs.size()) : 0;
  // src/compile's layouts of the breaks and recompiles.
  out.graph_breaks = report.to_json()["graph_breaks"];
  out.recompiles = report.to_json()["recompiles"];
  out.eval_recompiles = step ? step->report().to_json()["eval"]["recompiles"] : json::array();
  out.warmup_steps = options.warmup_steps;
  out.timed_steps = options.steps;
  // Each side's rate against this device's matmul, timed now as the baseline rung times it (the
  // job's largest GEMM in its precision; CPU has no catalog peak): informational.
  const double flops_per_sample =
      eager.model().train_flops_per_sample(eager.data().train->tokens_per_sample());
  const std::optional<MatmulPeak> matmul = time_job_matmul(config, session.device, 0.05, "compile");
  if (flops_per_sample > 0) out.flops_per_sample = flops_per_sample;
  if (matmul && matmul->flops_per_second > 0) {
    out.matmul_peak = matmul_peak_record(*matmul);
  }
  out.eager = compile_side(eager_seconds, tokens_per_step, samples_per_step, eager_peak,
                           flops_per_sample, matmul);
  out.compiled = compile_side(compiled_seconds, tokens_per_step, samples_per_step, compiled_peak,
                              flops_per_sample, matmul);
  out.peak_memory_method = eager_peak.method;
  out.speedup = out.eager.median_seconds / out.compiled.median_seconds;
  out.min_speedup = options.min_speedup;
  out.tolerance = options.tolerance;
  out.max_relative_loss_difference = worst_loss_difference;
  out.worst_loss_step = worst_loss_step;
  out.max_relative_parameter_difference = parameters.overall;
  out.worst_parameter = parameters.worst_name;
  out.worst_parameter_relative_difference = parameters.worst_tensor;
  out.max_relative_eval_loss_difference = worst_eval_difference;
  out.worst_eval = worst_eval_where;
  out.eager_losses = eager_losses;
  out.compiled_losses = compiled_losses;

  // Under DDP: the overlap the compiled step loses (every rank's numbers, averaged).
  if (distributed) {
    torch::Tensor sums = torch::tensor({eager_comm->exposed_seconds, eager_comm->busy_seconds,
                                        static_cast<double>(eager_comm->launched_in_backward),
                                        compiled_comm->exposed_seconds, compiled_comm->busy_seconds,
                                        static_cast<double>(compiled_comm->launched_in_backward),
                                        static_cast<double>(eager_comm->steps)},
                                       torch::kFloat64)
                             .to(session.device);
    session.comm->all_reduce_sum(sums);
    sums = sums.cpu();
    const double world = session.comm->world_size();
    const double per = world * std::max(1.0, sums[6].item<double>() / world);  // rank-steps
    auto side = [&](int base) {
      CompileDdpSide d;
      d.comm_exposed_seconds_per_step = sums[base].item<double>() / per;
      d.comm_busy_seconds_per_step = sums[base + 1].item<double>() / per;
      d.comm_overlapped_share =
          d.comm_busy_seconds_per_step > 0
              ? std::clamp(1.0 - d.comm_exposed_seconds_per_step / d.comm_busy_seconds_per_step,
                           0.0, 1.0)
              : 0.0;
      d.collectives_started_in_backward_per_step = sums[base + 2].item<double>() / per;
      return d;
    };
    CompileDdp ddp;
    ddp.world_size = session.comm->world_size();
    ddp.backend = session.comm->backend_name();
    ddp.bucket_bytes = composed.ddp->bucket_bytes();
    ddp.eager = side(0);
    // A captured step replays its bucket all-reduces inside the CUDA graph, where the host sees
    // neither their start nor their end: only the eager side is measured then.
    if (!captured) {
      ddp.compiled = side(3);
      const double lost =
          ddp.compiled->comm_exposed_seconds_per_step - ddp.eager.comm_exposed_seconds_per_step;
      ddp.overlap_lost_seconds_per_step = lost;
      ddp.overlap_lost_share_of_compiled_step =
          out.compiled.median_seconds > 0 ? lost / out.compiled.median_seconds : 0.0;
    }
    ddp.method =
        captured
            ? "per timed step, averaged over ranks, eager side only: the captured step's bucket "
              "all-reduces are nodes of its CUDA graph, issued during the captured backward as "
              "eager issues them, and invisible to the host on replay"
            : "per timed step, averaged over ranks: comm_exposed = wall time in the comm phase "
              "(waiting for the gradient buckets and the loss mean), comm_busy = time with a "
              "collective in flight; the compiled step returns its gradients at once, so its "
              "buckets start only after it (no overlap with backward)";
    log::info("compile: DDP overlap: " + compile_rung::ddp_overlap_text(ddp));
    out.ddp = std::move(ddp);
  }

  result.table =
      compile_rung::compile_table(out, report, step ? &step->report() : nullptr, options);
  const auto [passed, verdict] = compile_rung::compile_verdict(out, eager.step());
  return finish(passed, verdict);
}

}  // namespace kiln
