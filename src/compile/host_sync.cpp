// Finding host synchronisations in a step: a thread-local RecordFunction callback (inherited by
// autograd's threads through ATen's thread-local state) that notes every operator known to make
// the host wait for the device, with the outermost operator it ran inside and the Trainer phase.
#include <ATen/record_function.h>
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <string_view>

#include "compile/internal.h"
#include "kiln/compile.h"

namespace kiln {

struct HostSyncProbe::State {
  std::mutex mutex;
  std::vector<HostSync> seen;
  std::vector<std::string> phases;  // open phases, outermost first
};

namespace {

// The active probes (RecordFunction callbacks are plain function pointers, so they find their
// probes here). Usually one; ranks run as threads of one process (tests) probe at once, and each
// probe then also sees the other probed threads' synchronisations.
std::vector<HostSyncProbe::State*> g_active;
std::mutex g_install;  // guards g_active

// Per thread: the operators currently running, outermost first.
thread_local std::vector<std::string> t_stack;

bool synchronises(std::string_view op) {
  return op == "aten::_local_scalar_dense" || op == "aten::nonzero" ||
         op == "aten::_assert_async" || op == "aten::nonzero_static";
}

// Operators whose CUDA kernels are capturable although their CPU kernels read a scalar: the fused
// optimizers with a tensor learning rate (the CPU kernel calls lr.item(), the CUDA one reads the
// tensor on the device).
bool capturable_caller(std::string_view op) {
  return op == "aten::_fused_adamw_" || op == "aten::_fused_adam_" || op == "aten::_fused_sgd_";
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  if (synchronises(name) && std::none_of(t_stack.begin(), t_stack.end(), [](const std::string& op) {
        return capturable_caller(op);
      })) {
    std::lock_guard install(g_install);
    for (HostSyncProbe::State* state : g_active) {
      HostSync sync{std::string(name), t_stack.empty() ? "" : t_stack.front(), ""};
      std::lock_guard lock(state->mutex);
      if (!state->phases.empty()) sync.phase = state->phases.back();
      const bool known =
          std::any_of(state->seen.begin(), state->seen.end(), [&](const HostSync& s) {
            return s.op == sync.op && s.caller == sync.caller && s.phase == sync.phase;
          });
      if (!known) state->seen.push_back(std::move(sync));
    }
  }
  t_stack.emplace_back(name);
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext*) {
  if (!t_stack.empty()) t_stack.pop_back();
}

}  // namespace

std::string HostSync::str() const {
  std::string out = op;
  if (!caller.empty() && caller != op) out += " in " + caller;
  if (!phase.empty()) out += fmt::format(" ({})", phase);
  return out;
}

HostSyncProbe::~HostSyncProbe() {
  if (active_) stop();
}

void HostSyncProbe::start() {
  std::lock_guard lock(g_install);
  if (active_) return;
  if (!state_) state_ = std::make_shared<State>();
  {
    std::lock_guard state_lock(state_->mutex);
    state_->seen.clear();
  }
  g_active.push_back(state_.get());
  t_stack.clear();
  handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_start, &on_end).scopes({at::RecordScope::FUNCTION}));
  active_ = true;
}

std::vector<HostSync> HostSyncProbe::stop() {
  std::lock_guard lock(g_install);
  if (!active_) return {};
  at::removeCallback(handle_);
  g_active.erase(std::find(g_active.begin(), g_active.end(), state_.get()));
  active_ = false;
  t_stack.clear();
  std::lock_guard state_lock(state_->mutex);
  return std::move(state_->seen);
}

void HostSyncProbe::on_phase_begin(Trainer&, Phase phase) {
  if (!state_) state_ = std::make_shared<State>();
  std::lock_guard lock(state_->mutex);
  state_->phases.emplace_back(phase_name(phase));
}

void HostSyncProbe::on_phase_end(Trainer&, Phase) {
  if (!state_) return;
  std::lock_guard lock(state_->mutex);
  if (!state_->phases.empty()) state_->phases.pop_back();
}

}  // namespace kiln
