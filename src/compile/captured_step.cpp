// The captured step: per micro-batch shape, warm-up steps, one capture of the Trainer's whole
// device step into static input buffers, then replays. The capture mechanics are behind
// GraphRecorder (CUDA graphs in captured_step_cuda.cpp; a re-running recorder for CPU tests).
#include <fmt/format.h>

#include "compile/internal.h"
#include "core/clock.h"
#include "kiln/comm.h"
#include "kiln/compile.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {

#ifdef KILN_WITH_CUDA
GraphRecorderFactory make_cuda_graph_recorders(torch::Device device);  // captured_step_cuda.cpp
#endif

struct CapturedGraphStep::Graph {
  InputShapes shapes;
  std::unique_ptr<GraphRecorder> recorder;
  int64_t warmups_left = 0;
  bool captured = false;
  std::vector<Batch> inputs;  // the static buffers the capture reads
  torch::Tensor output;
  size_t report_index = 0;  // into report_.graphs
};

namespace {

class RerunRecorder final : public GraphRecorder {
 public:
  torch::Tensor warm_up(const std::function<torch::Tensor()>& work) override { return work(); }
  torch::Tensor capture(const std::function<torch::Tensor()>& work) override {
    output_ = work();
    return output_;
  }
  bool executed_on_capture() const override { return true; }
  void replay(const std::function<torch::Tensor()>& work) override { output_.copy_(work()); }

 private:
  torch::Tensor output_;
};

std::string sync_list(const std::vector<HostSync>& syncs) {
  std::string out;
  for (const HostSync& s : syncs) out += (out.empty() ? "" : "; ") + s.str();
  return out;
}

}  // namespace

GraphRecorderFactory rerun_recorders() {
  return [] { return std::make_unique<RerunRecorder>(); };
}

GraphRecorderFactory cuda_graph_recorders(torch::Device device) {
  if (!device.is_cuda()) {
    throw UserError(
        "compile.backend = \"cudagraphs\" captures GPU work and needs run.device = \"cuda\"; on "
        "the CPU use compile.backend = \"inductor\" or \"eager\"");
  }
#ifdef KILN_WITH_CUDA
  return make_cuda_graph_recorders(device);
#else
  throw UserError(
      "compile.backend = \"cudagraphs\": this kiln was built against a CPU-only LibTorch; build it "
      "against a CUDA LibTorch (docs/compile.md)");
#endif
}

CapturedGraphStep::CapturedGraphStep(const Config& config, Trainer& trainer,
                                     GraphRecorderFactory recorders)
    : options_(CompileOptions::from_config(config)),
      trainer_(trainer),
      recorders_(std::move(recorders)),
      probe_(std::make_shared<HostSyncProbe>()),
      tracker_(std::make_unique<ShapeTracker>(CompileOptions::Dynamic::kStatic,
                                              options_.recompile_limit, 0)) {
  // CUDA's fused kernels read a float32 rate (as they round a host one); the CPU kernels read the
  // tensor's value as a double, so a float64 tensor keeps the host rate's bits there.
  const torch::Device device = trainer.options().device;
  lr_ = torch::zeros({}, torch::TensorOptions()
                             .dtype(device.is_cuda() ? torch::kFloat : torch::kDouble)
                             .device(device));
  trainer.optimizer().use_lr_tensor(lr_);  // throws UserError without optim.fused
  trainer.add_hook(probe_);
  report_.backend = backend_name(options_.backend);
  report_.dynamic = "static";  // a CUDA graph replays fixed shapes: each new shape is a capture
}

CapturedGraphStep::~CapturedGraphStep() = default;

torch::Tensor CapturedGraphStep::run_captured(const std::vector<Batch>& batches, double lr,
                                              const BatchWork& work) {
  using Kind = ShapeTracker::Decision::Kind;
  lr_.fill_(lr);  // outside any capture: the graph reads the tensor
  auto eager = [&] {
    ++eager_steps_;
    return work(batches);
  };
  if (report_.fallback_to_eager || batches.empty()) return eager();
  const InputShapes shapes = InputShapes::of(batches.front());
  for (const Batch& b : batches) {
    if (!(InputShapes::of(b) == shapes)) {  // one graph holds one shape for every micro-batch
      report_.eager_micro_steps += static_cast<int64_t>(batches.size());
      return eager();
    }
  }
  const ShapeTracker::Decision decision = tracker_->decide(shapes);
  if (decision.kind == Kind::kEager) {
    if (tracker_->eager_shapes().empty() || !(tracker_->eager_shapes().back() == shapes)) {
      tracker_->record(shapes, decision);
      report_.recompiles = tracker_->recompiles();
      log::warn(fmt::format("compile: {} runs eager: compile.recompile_limit = {} captures reached",
                            shapes.str(), options_.recompile_limit));
    }
    report_.eager_micro_steps += static_cast<int64_t>(batches.size());
    return eager();
  }
  Graph* graph = nullptr;
  if (decision.kind == Kind::kCompile) {
    tracker_->record(shapes, decision);
    report_.recompiles = tracker_->recompiles();
    auto fresh = std::make_unique<Graph>();
    fresh->shapes = shapes;
    fresh->recorder = recorders_();
    fresh->warmups_left = std::max<int64_t>(1, options_.warmup_steps);
    fresh->report_index = report_.graphs.size();
    CompileReport::Graph entry;
    entry.shape = GraphShape{shapes, {}};
    entry.cache_note = "CUDA graph (captured in this process)";
    report_.graphs.push_back(entry);
    graphs_.push_back(std::move(fresh));
    graph = graphs_.back().get();
  } else {
    graph = graphs_.at(decision.graph).get();
  }

  if (graph->warmups_left > 0) {  // eager warm-up (on the capture's stream), the first probed
    --graph->warmups_left;
    ++eager_steps_;
    if (probed_) return graph->recorder->warm_up([&] { return work(batches); });
    probe_->start();
    torch::Tensor out;
    try {
      out = graph->recorder->warm_up([&] { return work(batches); });
    } catch (...) {
      probe_->stop();
      throw;
    }
    const std::vector<HostSync> syncs = probe_->stop();
    probed_ = true;
    for (const HostSync& s : syncs) {
      report_.breaks.push_back(
          GraphBreak{.reason = fmt::format("host synchronisation {}", s.str()), .where = s.phase});
    }
    if (!syncs.empty()) {
      if (options_.fullgraph) {
        throw TrainingError(fmt::format(
            "compile.backend = \"{}\": the step synchronises with the host {} time(s), which a "
            "CUDA graph cannot capture: {}; remove them (no .item() or data-dependent branch in "
            "the model), or set compile.fullgraph = false to run the step eager",
            report_.backend, syncs.size(), sync_list(syncs)));
      }
      report_.fallback_to_eager = true;
      log::warn(
          fmt::format("compile: {} graph break(s) (host synchronisations: {}); every step "
                      "runs eager (compile.fullgraph = false)",
                      syncs.size(), sync_list(syncs)));
    }
    return out;
  }

  if (!graph->captured) {  // capture into static buffers holding this step's batches
    for (const Batch& b : batches) graph->inputs.push_back({b.inputs.clone(), b.targets.clone()});
    const auto begin = SteadyClock::now();
    graph->output = graph->recorder->capture([&] { return work(graph->inputs); });
    graph->captured = true;
    report_.graphs[graph->report_index].build_seconds = seconds_since(begin);
    log::info(fmt::format("compile: captured the step for {} in {:.2f} s", shapes.str(),
                          report_.graphs[graph->report_index].build_seconds));
    if (graph->recorder->executed_on_capture()) {
      ++replays_;
      return graph->output;
    }
  } else {
    for (size_t k = 0; k < batches.size(); ++k) {
      graph->inputs[k].inputs.copy_(batches[k].inputs, /*non_blocking=*/true);
      graph->inputs[k].targets.copy_(batches[k].targets, /*non_blocking=*/true);
    }
  }
  graph->recorder->replay([&] { return work(graph->inputs); });
  ++replays_;
  return graph->output;
}

std::shared_ptr<CapturedGraphStep> attach_captured_step(Trainer& trainer, const Config& config) {
  using B = CompileOptions::Backend;
  const B backend = CompileOptions::from_config(config).backend;
  if (backend != B::kCudaGraphs && backend != B::kInductorCudaGraphs) return nullptr;
  trainer.enter_composition_stage(CompositionStage::kCapture, "CUDA graph capture");
  if (trainer.options().comm && trainer.options().comm->parallel()) {
    log::info(
        "compile: DDP's bucket all-reduces (NCCL) are captured into the step's CUDA graph and "
        "replayed with it; the communication statistics count the capture, not the replays");
  }
  auto step = std::make_shared<CapturedGraphStep>(config, trainer,
                                                  cuda_graph_recorders(trainer.options().device));
  trainer.set_step_runner(step);
  return step;
}

}  // namespace kiln
