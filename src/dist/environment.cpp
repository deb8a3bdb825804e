// The launcher's environment: torchrun's and Slurm's variables -> DistEnvironment.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <optional>
#include <string>

#include "kiln/config.h"
#include "kiln/dist.h"
#include "kiln/error.h"

namespace kiln {
namespace {

class Variables {
 public:
  explicit Variables(const EnvLookup& env) : env_(env) {}

  std::optional<std::string> text(const char* name) const {
    const char* value = env_(name);
    if (value == nullptr || *value == '\0') return std::nullopt;
    return std::string(value);
  }

  bool has(const char* name) const { return text(name).has_value(); }

  /// The variable as an integer in [lo, hi]; `fallback` when unset.
  int integer(const char* name, std::optional<int> fallback, int lo, int hi,
              const std::string& launcher) const {
    auto value = text(name);
    if (!value) {
      if (fallback) return *fallback;
      throw UserError(std::string("environment variable ") + name + " is not set but " + launcher +
                      " needs it; start kiln with the launcher (docs/scale.md), or set " + name);
    }
    int parsed = 0;
    const char* end = value->data() + value->size();
    auto [ptr, ec] = std::from_chars(value->data(), end, parsed);
    if (ec != std::errc() || ptr != end || parsed < lo || parsed > hi) {
      throw UserError(std::string("environment variable ") + name + "=\"" + *value +
                      "\" is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                      "]; fix the launch environment");
    }
    return parsed;
  }

 private:
  const EnvLookup& env_;
};

constexpr int kMaxRanks = 1 << 24;

// Slurm's SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE look like "4" or "4(x2),3": the first count.
std::optional<int> leading_count(const std::optional<std::string>& text) {
  if (!text) return std::nullopt;
  int value = 0;
  auto [ptr, ec] = std::from_chars(text->data(), text->data() + text->size(), value);
  if (ec != std::errc() || ptr == text->data() || value < 1) return std::nullopt;
  return value;
}

void resolve_master(DistEnvironment& out, const Variables& vars, const ProcessGroupOptions& options,
                    const std::string& world_variable) {
  out.master_addr = vars.text("MASTER_ADDR").value_or(options.master_addr);
  if (out.master_addr.empty()) {
    throw UserError(world_variable + "=" + std::to_string(out.world_size) +
                    " is set but MASTER_ADDR is not, and dist.master_addr is empty: kiln cannot "
                    "find rank 0's rendezvous store; launch with torchrun, or set MASTER_ADDR "
                    "(and MASTER_PORT) to rank 0's host, or set dist.master_addr");
  }
  out.master_port = vars.integer("MASTER_PORT", options.master_port, 1, 65535, out.launcher);
}

void check_ranks(const DistEnvironment& env) {
  if (env.rank >= env.world_size) {
    throw UserError("rank " + std::to_string(env.rank) + " is outside the world of " +
                    std::to_string(env.world_size) + " processes; fix the launch environment");
  }
  if (env.local_rank >= env.local_world_size) {
    throw UserError("local rank " + std::to_string(env.local_rank) + " is outside the " +
                    std::to_string(env.local_world_size) +
                    " processes of this node; fix LOCAL_RANK / LOCAL_WORLD_SIZE");
  }
}

}  // namespace

void die_with_launcher() {
  const char* local_rank = std::getenv("LOCAL_RANK");
  if (local_rank == nullptr || *local_rank == '\0') return;
  const pid_t parent = ::getppid();
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return;
  // The parent may have died before the prctl: then this process was already reparented.
  if (::getppid() != parent || parent == 1) ::_exit(128 + SIGKILL);
}

DistEnvironment read_dist_environment(const ProcessGroupOptions& options, const EnvLookup& env) {
  const Variables vars(env);
  using Launcher = ProcessGroupOptions::Launcher;
  Launcher chosen = options.launcher;
  const bool torchrun_vars = vars.has("WORLD_SIZE");
  const bool slurm_vars =
      vars.has("SLURM_PROCID") && vars.has("SLURM_NTASKS") && vars.has("SLURM_STEP_ID");
  if (chosen == Launcher::kAuto) {
    if (torchrun_vars) {
      chosen = Launcher::kTorchrun;
    } else if (slurm_vars && vars.integer("SLURM_NTASKS", 1, 1, kMaxRanks, "slurm") > 1) {
      chosen = Launcher::kSlurm;
    } else {
      chosen = Launcher::kNone;
    }
  }
  const std::string launcher = chosen == Launcher::kTorchrun ? "torchrun"
                               : chosen == Launcher::kSlurm  ? "slurm"
                                                             : "none";
  DistEnvironment out;
  out.launcher = launcher;
  if (chosen == Launcher::kNone) return out;

  if (chosen == Launcher::kTorchrun) {
    if (!torchrun_vars) {
      throw UserError(
          "dist.launcher = \"torchrun\" but WORLD_SIZE is not set; start kiln with "
          "torchrun --no-python --nproc-per-node=N kiln <command> <config>");
    }
    out.world_size = vars.integer("WORLD_SIZE", std::nullopt, 1, kMaxRanks, launcher);
    out.rank = vars.integer("RANK", std::nullopt, 0, kMaxRanks, launcher);
    out.local_rank = vars.integer("LOCAL_RANK", out.rank, 0, kMaxRanks, launcher);
    out.local_world_size = vars.integer("LOCAL_WORLD_SIZE", out.world_size, 1, kMaxRanks, launcher);
    out.restart_count = vars.integer("TORCHELASTIC_RESTART_COUNT", 0, 0, 1 << 30, launcher);
    out.agent_store = vars.text("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
    check_ranks(out);
    out.process_group =
        out.world_size > 1 || options.backend != ProcessGroupOptions::Backend::kAuto;
    if (out.process_group) resolve_master(out, vars, options, "WORLD_SIZE");
    return out;
  }

  // Slurm (srun): one task per process.
  if (!slurm_vars) {
    throw UserError(
        "dist.launcher = \"slurm\" but SLURM_PROCID / SLURM_NTASKS are not set; "
        "start kiln with srun inside an allocation (docs/scale.md)");
  }
  out.world_size = vars.integer("SLURM_NTASKS", std::nullopt, 1, kMaxRanks, launcher);
  out.rank = vars.integer("SLURM_PROCID", std::nullopt, 0, kMaxRanks, launcher);
  out.local_rank = vars.integer("SLURM_LOCALID", 0, 0, kMaxRanks, launcher);
  out.local_world_size =
      leading_count(vars.text("SLURM_NTASKS_PER_NODE"))
          .value_or(leading_count(vars.text("SLURM_TASKS_PER_NODE")).value_or(1));
  out.local_world_size = std::max(out.local_world_size, out.local_rank + 1);
  out.restart_count = vars.integer("SLURM_RESTART_COUNT", 0, 0, 1 << 30, launcher);
  check_ranks(out);
  out.process_group = out.world_size > 1;
  if (out.process_group) resolve_master(out, vars, options, "SLURM_NTASKS");
  return out;
}

}  // namespace kiln
