// kiln's side of the checkpoint benchmark (bench/ckpt/run.py drives it and the Python side).
//
//   kiln_ckpt_bench save-load <dir> <megabytes> <repeats>
//     A model-like state of float32 tensors (seeded): sync saves (write + fsync + commit), each
//     timed, then loads of the same checkpoint with its pages evicted from the page cache first.
//     Prints one JSON object. The checkpoint of the last repeat stays in <dir> for run.py.
//   kiln_ckpt_bench stall <config> <run dir> <saves> <steps between saves> [key=value ...]
//     What a save costs training, sync against async (staging in save(), and staging in the
//     background fenced before the next optimizer step), on a real Trainer (gpt small): every
//     moment the training thread is blocked by checkpointing (save(), poll(), fences) plus how much
//     longer than without checkpointing the steps take that run while a background save writes.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "kiln/checkpoint.h"
#include "kiln/session.h"

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point begin) {
  return std::chrono::duration<double>(Clock::now() - begin).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty()
             ? 0
             : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

// Drops a file's (clean, fsynced) pages from the page cache, so the next read comes from disk.
void evict(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// A GPT-like state: per layer 4 C x C-ish weights plus biases, in float32, ~`megabytes` MB.
std::vector<kiln::StateTensor> model_like_state(int64_t megabytes) {
  auto gen = at::detail::createCPUGenerator(1234);
  std::vector<kiln::StateTensor> out;
  const int64_t width = 1024;
  int64_t bytes = 0;
  for (int layer = 0; bytes < megabytes * 1000 * 1000; ++layer) {
    const std::string p = "model/h." + std::to_string(layer) + ".";
    for (auto [name, rows] : {std::pair{"attn.c_attn.weight", 3 * width},
                              {"attn.c_proj.weight", width},
                              {"mlp.c_fc.weight", 4 * width},
                              {"mlp.c_proj.weight", width}}) {
      const int64_t cols = std::string(name) == "mlp.c_proj.weight" ? 4 * width : width;
      out.emplace_back(p + name, torch::randn({rows, cols}, gen));
      out.emplace_back(p + std::string(name).replace(std::string(name).size() - 6, 6, "bias"),
                       torch::randn({rows}, gen));
      bytes += (rows * cols + rows) * 4;
    }
  }
  return out;
}

int save_load(const std::filesystem::path& dir, int64_t megabytes, int repeats) {
  auto comm = kiln::single_process_communicator();
  auto state = model_like_state(megabytes);
  uint64_t state_bytes = 0;
  for (const auto& t : state) state_bytes += t.tensor.nbytes();
  std::vector<double> save_seconds, load_seconds;
  std::filesystem::path last;
  for (int r = 0; r < repeats; ++r) {
    std::filesystem::remove_all(dir);
    kiln::Checkpointer checkpointer(kiln::CheckpointOptions{dir, 1000, 0, /*async=*/false}, *comm);
    kiln::SaveRequest request;
    request.step = r + 1;
    request.tensors = state;
    const auto begin = Clock::now();
    auto handle = checkpointer.save(request);
    save_seconds.push_back(seconds_since(begin));
    handle->rethrow_if_failed();
    last = dir / ("step-" + std::to_string(r + 1));
  }
  auto targets = state;
  for (auto& t : targets) t.tensor = torch::empty_like(t.tensor);
  for (int r = 0; r < repeats; ++r) {
    for (const auto& item : std::filesystem::directory_iterator(last)) evict(item.path());
    const auto begin = Clock::now();
    kiln::load_checkpoint(last, targets, *comm);  // verifies every file's xxh3 while reading
    load_seconds.push_back(seconds_since(begin));
  }
  for (size_t k = 0; k < state.size(); ++k) {
    if (!torch::equal(state[k].tensor, targets[k].tensor))
      throw std::runtime_error("load differs: " + state[k].name);
  }
  const uint64_t file_bytes = kiln::read_checkpoint_index(last).total_file_bytes();
  json out = {{"state_bytes", state_bytes},
              {"file_bytes", file_bytes},
              {"tensors", state.size()},
              {"save_seconds", save_seconds},
              {"load_seconds", load_seconds},
              {"save_bytes_per_second", static_cast<double>(file_bytes) / median(save_seconds)},
              {"load_bytes_per_second", static_cast<double>(file_bytes) / median(load_seconds)},
              {"checkpoint", last.string()}};
  std::cout << out.dump() << std::endl;
  return 0;
}

// Fences on a background save's staging before the optimizer step, as kiln's CheckpointHook does,
// and counts the time it blocks.
class StagingFence : public kiln::TrainerHook {
 public:
  kiln::Checkpointer* checkpointer = nullptr;
  double blocked_seconds = 0;
  void on_gradients_ready(kiln::Trainer&) override {
    if (checkpointer) blocked_seconds += checkpointer->wait_for_staging();
  }
};

// One step, timed; `blocked` gets the time the staging fence held it (part of the step's time).
double timed_step(kiln::Trainer& trainer, StagingFence& fence, double& blocked) {
  fence.blocked_seconds = 0;
  const auto begin = Clock::now();
  trainer.train_step();
  blocked = fence.blocked_seconds;
  return seconds_since(begin);
}

int stall(const std::string& config_path, const std::string& run_dir, int saves, int steps_between,
          std::vector<std::string> overrides) {
  for (const char* o : {"run.name=stall", "run.progress=off", "train.eval_every=0"})
    overrides.emplace_back(o);
  overrides.push_back("run.dir=" + run_dir);
  kiln::Config config = kiln::Config::load(config_path, overrides);
  auto session = kiln::open_session(config, {{"kiln_ckpt_bench"}});
  kiln::Trainer& trainer = *session->trainer;
  kiln::Communicator& comm = *session->comm;
  auto fence = std::make_shared<StagingFence>();
  trainer.add_hook(fence);
  for (int k = 0; k < 2; ++k) trainer.train_step();  // optimizer state exists
  json out = {{"config", config_path},
              {"overrides", overrides},
              {"parameters", kiln::parameter_count(trainer.model())},
              {"saves_per_mode", saves},
              {"steps_between_saves", steps_between}};
  // The step time with no checkpointing at all, as many steps as a mode runs: the reference for
  // how much the steps that run beside a background write slow down.
  std::vector<double> plain_step_seconds;
  for (int k = 0; k < (saves + 1) * steps_between; ++k) {
    const auto begin = Clock::now();
    trainer.train_step();
    plain_step_seconds.push_back(seconds_since(begin));
  }
  const double plain_step = median(plain_step_seconds);
  out["no_checkpointing"] = {{"step_seconds", plain_step_seconds},
                             {"median_step_seconds", plain_step}};
  for (std::string mode : {"sync", "async_staging_in_save", "async"}) {
    auto options = kiln::checkpoint_options(config, session->run->dir());
    options.dir = session->run->dir() / ("ckpt-" + mode);
    options.async = mode != "sync";
    options.background_staging = mode == "async";
    std::filesystem::remove_all(options.dir);
    kiln::Checkpointer checkpointer(options, comm);
    fence->checkpointer = &checkpointer;
    // Per save: `blocked` = save() plus every fence and poll of the steps after it (until the next
    // save); `slowdown` = what the steps that started while it was in flight took beyond the
    // median step without checkpointing (the write and the staging copy compete for the cores).
    std::vector<double> blocked(static_cast<size_t>(saves), 0.0);
    std::vector<double> slowdown(static_cast<size_t>(saves), 0.0);
    std::vector<int> steps_in_flight(static_cast<size_t>(saves), 0);
    std::vector<double> busy_step_seconds, idle_step_seconds;
    std::vector<std::shared_ptr<const kiln::SaveHandle>> handles;
    // Steps, then a save; after the last save, steps once more, so every save has steps after it.
    for (int s = 0; s <= saves; ++s) {
      for (int k = 0; k < steps_between; ++k) {
        const bool busy = checkpointer.in_flight();
        double fenced = 0;
        const double step = timed_step(trainer, *fence, fenced);
        const auto poll_begin = Clock::now();
        checkpointer.poll();
        const double polled = seconds_since(poll_begin);
        (busy ? busy_step_seconds : idle_step_seconds).push_back(step - fenced);
        if (s == 0) continue;  // before the first save
        const auto last = static_cast<size_t>(s - 1);
        blocked[last] += fenced + polled;
        if (busy) {
          slowdown[last] += step - fenced - plain_step;
          ++steps_in_flight[last];
        }
      }
      if (s == saves) break;
      const auto begin = Clock::now();
      handles.push_back(checkpointer.save(kiln::capture_training_state(trainer, comm, {})));
      blocked[static_cast<size_t>(s)] += seconds_since(begin);
    }
    const auto wait_begin = Clock::now();
    checkpointer.wait();
    const double final_wait = seconds_since(wait_begin);
    fence->checkpointer = nullptr;
    std::vector<double> cost(blocked.size());
    for (size_t k = 0; k < cost.size(); ++k) cost[k] = blocked[k] + slowdown[k];
    std::vector<double> total_seconds, write_seconds, staging_seconds, wait_previous_seconds;
    for (const auto& h : handles) {
      h->rethrow_if_failed();
      total_seconds.push_back(h->stats().total_seconds);
      write_seconds.push_back(h->stats().write_seconds);
      staging_seconds.push_back(h->stats().staging_seconds);
      wait_previous_seconds.push_back(h->stats().wait_previous_seconds);
    }
    const uint64_t bytes = handles.back()->stats().total_bytes;
    auto steady = [](const std::vector<double>& v) {
      return median(std::vector<double>(v.begin() + 1, v.end()));
    };
    out[mode] = {{"stall_seconds_per_save", blocked},
                 {"median_stall_seconds", median(blocked)},
                 {"first_stall_seconds", blocked.front()},
                 {"median_steady_stall_seconds", steady(blocked)},
                 {"slowdown_seconds_per_save", slowdown},
                 {"steps_in_flight_per_save", steps_in_flight},
                 {"cost_seconds_per_save", cost},
                 {"median_steady_cost_seconds", steady(cost)},
                 {"final_wait_seconds", final_wait},
                 {"checkpoint_bytes", bytes},
                 {"step_seconds_while_writing", busy_step_seconds},
                 {"step_seconds_otherwise", idle_step_seconds},
                 {"median_step_seconds_while_writing", median(busy_step_seconds)},
                 {"median_step_seconds_otherwise", median(idle_step_seconds)},
                 {"save_to_commit_seconds", total_seconds},
                 {"write_seconds", write_seconds},
                 {"staging_seconds", staging_seconds},
                 {"wait_previous_seconds", wait_previous_seconds}};
  }
  const double sync_save = out["sync"]["median_steady_cost_seconds"].get<double>();
  for (std::string mode : {"async_staging_in_save", "async"}) {
    // The claim: what a save costs training (blocked + slowed steps) against a sync save's.
    out[mode + "_cost_over_sync_save"] =
        out[mode]["median_steady_cost_seconds"].get<double>() / sync_save;
    out[mode + "_cost_over_sync_save_per_save"] = json::array();
    for (size_t k = 1; k < static_cast<size_t>(saves); ++k) {
      out[mode + "_cost_over_sync_save_per_save"].push_back(
          out[mode]["cost_seconds_per_save"][k].get<double>() / sync_save);
    }
    // The blocking part alone (what this bench reported before it counted the slowdown).
    out[mode + "_blocking_stall_over_sync_save"] =
        out[mode]["median_steady_stall_seconds"].get<double>() /
        out["sync"]["median_steady_stall_seconds"].get<double>();
  }
  out["modes"] = {
      {"sync", "the save writes, fsyncs and commits while training waits"},
      {"async_staging_in_save", "save() copies the state to CPU, a thread writes"},
      {"async",
       "kiln's default: save() returns at once; the writer thread copies the state to CPU, "
       "fenced before the next optimizer step (overlapping data, forward, backward), then "
       "writes"}};
  out["cost"] =
      "per save: the time save(), the staging fence and poll() blocked the training thread in the "
      "steps after it, plus each step that started while the save was in flight minus the median "
      "step without checkpointing (no_checkpointing); steady = every save but the first";
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "save-load" && argc == 5)
      return save_load(argv[2], std::stoll(argv[3]), std::stoi(argv[4]));
    if (mode == "stall" && argc >= 6)
      return stall(argv[2], argv[3], std::stoi(argv[4]), std::stoi(argv[5]),
                   std::vector<std::string>(argv + 6, argv + argc));
    std::cerr << "usage: kiln_ckpt_bench save-load <dir> <megabytes> <repeats>\n"
                 "       kiln_ckpt_bench stall <config> <run dir> <saves> <steps between saves> "
                 "[key=value ...]\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "kiln_ckpt_bench: " << e.what() << "\n";
    return 1;
  }
}
