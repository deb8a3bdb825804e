#include "kiln/session.h"

#include <fmt/format.h>

#include <fstream>
#include <string>

#include "core/files.h"
#include "core/strings.h"
#include "kiln/checkpoint.h"
#include "kiln/compile.h"
#include "kiln/error.h"
#include "kiln/log.h"

namespace kiln {
namespace {

// A field of /proc/self/status in bytes ("VmHWM:  123 kB"), or -1.
double proc_status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return 1024.0 * std::stod(line.substr(field.size() + 1));
  }
  return -1;
}

// The one combination the [compile] rules cannot decide from the config: dist.strategy = "auto"
// picks fsdp by the model's memory, and FSDP does not compose with a compiled or captured step.
// Asked here, where a run starts and before anything is written; "" when it trains.
std::string auto_strategy_problem(const Config& config, const Communicator& comm) {
  if (!comm.parallel() || config.get_string("compile.backend") == "eager" ||
      config.get_string("dist.strategy") != "auto")
    return "";
  // Per-unit compilation composes with FSDP.
  if (config.get_string("compile.backend") == "inductor" && compiles_per_unit(config)) return "";
  torch::Device device = resolve_device(config);
  if (device.is_cuda()) device = torch::Device(torch::kCUDA, comm.local_rank());
  const StrategyChoice choice =
      resolve_strategy(config, *make_model(config), device, comm.world_size());
  if (choice.strategy != "fsdp") return "";
  return fmt::format("{}: {}; set dist.strategy = \"ddp\" or compile.backend = \"eager\"",
                     choice.reason, fsdp_with_compile_problem());
}

}  // namespace

std::shared_ptr<RunLock> lock_run_directories(const Config& config, Communicator& comm,
                                              const std::vector<std::string>& argv) {
  std::shared_ptr<RunLock> lock;
  std::string error;
  if (comm.rank() == 0) {
    try {
      error = auto_strategy_problem(config, comm);
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
  }
  if (comm.rank() == 0 && error.empty()) {
    try {
      std::vector<const char*> args;
      for (const auto& arg : argv) args.push_back(arg.c_str());
      const std::filesystem::path run_dir = run_directory(config);
      lock = lock_directories({{run_dir, "run directory", "run.name", "run.dir"},
                               {checkpoint_options(config, run_dir).dir, "checkpoint directory",
                                "checkpoint.dir", "checkpoint.dir"}},
                              join_command_line(static_cast<int>(args.size()), args.data()));
    } catch (const std::exception& e) {
      error = one_line_error(e);
    }
  }
  if (comm.world_size() > 1) error = comm.all_gather_bytes(error)[0];  // rank 0's outcome
  if (!error.empty()) throw UserError(error);
  return lock;
}

std::unique_ptr<Session> open_session(const Config& config, const SessionOptions& options) {
  auto session = std::make_unique<Session>(Session{nullptr, config, torch::kCPU, options.comm,
                                                   nullptr, nullptr, "none", "", nullptr, nullptr});
  // Without a communicator: this process's (torchrun / Slurm environment; else a world of one).
  if (!session->comm) session->comm = process_communicator(config);
  const int rank = session->comm->rank(), world_size = session->comm->world_size();
  const bool parallel = session->comm->parallel();  // DDP or FSDP, a process group of one too
  session->lock = lock_run_directories(config, *session->comm, options.argv);
  apply_runtime_settings(config);
  session->device = resolve_device(config);
  if (session->device.is_cuda() && parallel) {  // one process per device: LOCAL_RANK's
    const auto local_rank = static_cast<c10::DeviceIndex>(session->comm->local_rank());
    session->device = torch::Device(torch::kCUDA, local_rank);
  }
  Datasets data = make_datasets(config);
  auto model = make_model(config);
  nlohmann::json model_id = model_identity(*model);
  RunOptions run_options;
  run_options.argv = options.argv;
  run_options.writer = rank == 0;
  run_options.metrics_file = options.metrics_file;
  run_options.append_metrics = options.append_metrics;
  run_options.existing_records = options.existing_records;
  session->run = std::make_unique<Run>(config, run_options);
  session->run->write_manifest(data.identity, model_id,
                               {{"device", session->device.str()}, {"world_size", world_size}});
  TrainerOptions trainer_options;
  trainer_options.device = session->device;
  trainer_options.rank = rank;
  trainer_options.world_size = world_size;
  trainer_options.comm = session->comm;
  session->trainer =
      std::make_unique<Trainer>(config, std::move(model), std::move(data), trainer_options);
  if (parallel) {  // DDP or FSDP: rank 0's weights everywhere, gradients averaged
    const StrategyChoice choice =
        resolve_strategy(config, session->trainer->model(), session->device, world_size);
    session->strategy = choice.strategy;
    session->strategy_reason = choice.reason;
    session->strategy_decision = choice.decision;
    // fsdp with a compiled step: refused before this, by the [compile] rule (dist.strategy =
    // "fsdp") or by lock_run_directories (dist.strategy = "auto" resolving to fsdp).
    if (session->strategy == "fsdp") {
      session->fsdp =
          FullyShardedDataParallel::attach(*session->trainer, session->comm, fsdp_options(config));
    } else {
      DataParallel::attach(*session->trainer, session->comm, data_parallel_options(config));
    }
    log::info("strategy " + session->strategy + ": " + session->strategy_reason);
    // The same initial weights everywhere, but each rank's own random stream (dropout, ...).
    torch::manual_seed(static_cast<uint64_t>(config.get_int("run.seed")) +
                       static_cast<uint64_t>(rank));
  }
  log::info("run directory " + session->run->dir().string() + " | " +
            model_id["architecture"].get<std::string>() + " with " +
            std::to_string(model_id["parameter_count"].get<int64_t>()) + " parameters on " +
            session->device.str());
  return session;
}

#ifdef KILN_WITH_CUDA
void reset_cuda_peak_memory(const torch::Device& device);  // session_cuda.cpp
PeakMemory read_cuda_peak_memory(const torch::Device& device);
#endif

void reset_peak_memory(const torch::Device& device) {
#ifdef KILN_WITH_CUDA
  if (device.is_cuda()) return reset_cuda_peak_memory(device);
#endif
  if (device.is_cpu()) {
    // Writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0).
    std::ofstream out("/proc/self/clear_refs");
    out << "5";
  }
}

PeakMemory read_peak_memory(const torch::Device& device) {
#ifdef KILN_WITH_CUDA
  if (device.is_cuda()) return read_cuda_peak_memory(device);
#endif
  PeakMemory peak;
  if (device.is_cpu()) {
    peak.method =
        "CPU: process peak resident set size (VmHWM) over the region, reset through "
        "/proc/self/clear_refs; includes allocator caches, code and libraries";
    peak.allocated_bytes = proc_status_bytes("VmHWM");
    peak.resident_after_bytes = proc_status_bytes("VmRSS");
  } else {
    peak.method = "not measured on " + device.str() + " (this build has no CUDA allocator access)";
  }
  return peak;
}

}  // namespace kiln
