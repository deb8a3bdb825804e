// kiln_dist_replica: one data-parallel training run for the multi-process equivalence tests.
//   kiln_dist_replica <config.toml> <steps> <out dir> [section.key=value ...]
// Trains <steps> optimizer steps under whatever launched it (torchrun: data-parallel; nothing: one
// process), through the same open_session path as `kiln train`, and on rank 0 writes
// <out>/losses.json (per-step global mean loss) and <out>/params.safetensors (final weights).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/error.h"
#include "kiln/safetensors.h"
#include "kiln/session.h"

int main(int argc, char** argv) {
  using namespace kiln;
  if (argc < 4) {
    std::fprintf(
        stderr,
        "usage: kiln_dist_replica <config.toml> <steps> <out dir> [section.key=value ...]\n");
    return kExitUserError;
  }
  try {
    std::vector<std::string> overrides(argv + 4, argv + argc);
    Config config = Config::load(argv[1], overrides);
    const int64_t steps = std::stoll(argv[2]);
    const std::filesystem::path out = argv[3];
    auto session = open_session(config, {});
    std::vector<double> losses;
    for (int64_t k = 0; k < steps; ++k) losses.push_back(session->trainer->train_step().loss);
    if (session->comm->rank() == 0) {
      std::filesystem::create_directories(out);
      NamedTensors params;
      for (const auto& item : session->trainer->model().named_parameters()) {
        params.emplace_back(item.key(), item.value().detach().cpu().contiguous());
      }
      write_safetensors(out / "params.safetensors", params);
      std::ofstream(out / "losses.json")
          << nlohmann::json{{"losses", losses}, {"world_size", session->comm->world_size()}}.dump();
    }
    return kExitOk;
  } catch (const UserError& e) {
    std::fprintf(stderr, "kiln_dist_replica: error: %s\n", e.what());
    return kExitUserError;
  } catch (const TrainingError& e) {
    std::fprintf(stderr, "kiln_dist_replica: stopped: %s\n", e.what());
    return kExitGateFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln_dist_replica: internal error: %s\n", e.what());
    return kExitInternal;
  }
}
