// Typed rung results (kiln/results.h): from_json/to_json for each rung file, through one strict
// reader that names the key path of whatever is missing or mistyped.
#include "kiln/results.h"

#include <fmt/format.h>

#include <cmath>

#include "core/files.h"
#include "core/strings.h"
#include "report/result_reader.h"

namespace kiln {
using namespace result_json;
using nlohmann::json;

// ---- baseline ----------------------------------------------------------------------------------

void from_json(const json& j, BaselineResult& b) {
  const Reader r(j, "");
  b = {};
  b.status = read_status(r, j, "samples_per_second");
  if (!b.status.measured) return;
  b.device = r.req<std::string>("device");
  b.warmup_steps = r.req<int64_t>("warmup_steps");
  b.measured_steps = r.req<int64_t>("measured_steps");
  b.batch_size = r.req<int64_t>("batch_size");
  b.seq_len = r.req<int64_t>("seq_len");
  b.samples_per_second = r.req<double>("samples_per_second");
  b.tokens_per_second = r.nullable<double>("tokens_per_second");
  const Reader t = r.obj("step_seconds");
  b.step_seconds = {t.req<double>("median"), t.req<double>("p10"), t.req<double>("p90"),
                    t.req<double>("mean")};
  b.data_wait_share = r.req<double>("data_wait_share");
  const Reader peak = r.obj("peak_memory");
  b.peak_memory_method = peak.req<std::string>("method");
  b.peak_allocated_bytes = peak.req<double>("allocated_bytes");
  const Reader state = r.obj("state_bytes");
  b.parameters_bytes = state.req<double>("parameters");
  b.gradients_bytes = state.req<double>("gradients");
  b.optimizer_bytes = state.req<double>("optimizer");
  b.flops_per_sample = r.req<double>("flops_per_sample");
  b.achieved_flops_per_second = r.req<double>("achieved_flops_per_second");
  b.mfu = r.nullable<double>("mfu");
  b.peak_flops_per_second = r.nullable<double>("peak_flops_per_second");
  b.loss_start = r.req<double>("loss_start");
  b.loss_end = r.req<double>("loss_end");
  b.val_loss_initial = r.req<double>("val_loss_initial");
  b.val_loss_final = r.req<double>("val_loss_final");
}

void to_json(json& j, const BaselineResult& b) {
  j = json::object();
  write_status(j, b.status);
  if (!b.status.measured) return;
  j.update({{"device", b.device},
            {"warmup_steps", b.warmup_steps},
            {"measured_steps", b.measured_steps},
            {"batch_size", b.batch_size},
            {"seq_len", b.seq_len},
            {"samples_per_second", b.samples_per_second},
            {"tokens_per_second", opt_json(b.tokens_per_second)},
            {"step_seconds",
             {{"median", b.step_seconds.median},
              {"p10", b.step_seconds.p10},
              {"p90", b.step_seconds.p90},
              {"mean", b.step_seconds.mean}}},
            {"data_wait_share", b.data_wait_share},
            {"peak_memory",
             {{"method", b.peak_memory_method}, {"allocated_bytes", b.peak_allocated_bytes}}},
            {"state_bytes",
             {{"parameters", b.parameters_bytes},
              {"gradients", b.gradients_bytes},
              {"optimizer", b.optimizer_bytes}}},
            {"flops_per_sample", b.flops_per_sample},
            {"achieved_flops_per_second", b.achieved_flops_per_second},
            {"mfu", opt_json(b.mfu)},
            {"peak_flops_per_second", opt_json(b.peak_flops_per_second)},
            {"loss_start", b.loss_start},
            {"loss_end", b.loss_end},
            {"val_loss_initial", b.val_loss_initial},
            {"val_loss_final", b.val_loss_final}});
}

// ---- compile -----------------------------------------------------------------------------------

namespace {
CompileSide read_side(const Reader& r) {
  return {r.req<double>("median_seconds"), r.req<double>("p90_seconds"),
          r.req<double>("samples_per_second"), r.nullable<double>("tokens_per_second"),
          r.req<double>("peak_memory_bytes")};
}
json side_json(const CompileSide& s) {
  return {{"median_seconds", s.median_seconds},
          {"p90_seconds", s.p90_seconds},
          {"samples_per_second", s.samples_per_second},
          {"tokens_per_second", opt_json(s.tokens_per_second)},
          {"peak_memory_bytes", s.peak_memory_bytes}};
}
}  // namespace

void from_json(const json& j, CompileResult& c) {
  const Reader r(j, "");
  c = {};
  c.status = read_status(r, j, "backend");
  if (!c.status.measured) return;
  c.backend = r.req<std::string>("backend");
  c.dynamic = r.req<std::string>("dynamic");
  c.device = r.req<std::string>("device");
  c.fullgraph = r.req<bool>("fullgraph");
  c.world_size = r.req<int64_t>("world_size");
  c.timed = j.contains("eager");
  if (!c.timed) return;
  c.compile_seconds = r.req<double>("compile_seconds");
  c.cache = r.req<std::string>("cache");
  c.graphs = r.req<int64_t>("graphs");
  c.warmup_steps = r.req<int64_t>("warmup_steps");
  c.timed_steps = r.req<int64_t>("timed_steps");
  c.eager = read_side(r.obj("eager"));
  c.compiled = read_side(r.obj("compiled"));
  c.speedup = r.nullable<double>("speedup");
  c.min_speedup = r.req<double>("min_speedup");
  const Reader n = r.obj("numerics");
  c.tolerance = n.req<double>("tolerance");
  c.max_relative_loss_difference = n.req<double>("max_relative_loss_difference");
  c.max_relative_parameter_difference = n.req<double>("max_relative_parameter_difference");
}

void to_json(json& j, const CompileResult& c) {
  j = json::object();
  write_status(j, c.status);
  if (!c.status.measured) return;
  j.update({{"backend", c.backend},
            {"dynamic", c.dynamic},
            {"device", c.device},
            {"fullgraph", c.fullgraph},
            {"world_size", c.world_size}});
  if (!c.timed) return;
  j.update({{"compile_seconds", c.compile_seconds},
            {"cache", c.cache},
            {"graphs", c.graphs},
            {"warmup_steps", c.warmup_steps},
            {"timed_steps", c.timed_steps},
            {"eager", side_json(c.eager)},
            {"compiled", side_json(c.compiled)},
            {"speedup", opt_json(c.speedup)},
            {"min_speedup", c.min_speedup},
            {"numerics",
             {{"tolerance", c.tolerance},
              {"max_relative_loss_difference", c.max_relative_loss_difference},
              {"max_relative_parameter_difference", c.max_relative_parameter_difference}}}});
}

// ---- profile -----------------------------------------------------------------------------------

void from_json(const json& j, ProfileResult& p) {
  const Reader r(j, "");
  p = {};
  p.status = read_status(r, j, "analysis", /*verdict_inside=*/true);
  if (!p.status.measured) return;
  p.device = r.req<std::string>("device");
  const Reader v = r.obj("verdict");
  p.status.verdict = v.req<std::string>("reason");
  p.bottleneck = v.req<std::string>("bottleneck");
  p.actions = v.strings("actions");
  const Reader a = r.obj("analysis");
  p.windows = a.req<int64_t>("windows");
  p.steps = a.req<int64_t>("steps");
  p.step_seconds_mean = a.req<double>("step_seconds_mean");
  for (const Reader& x : a.list("phases")) {
    p.phases.push_back(
        {x.req<std::string>("phase"), x.req<double>("seconds"), x.req<double>("share")});
  }
  for (const Reader& x : a.list("top_operators")) {
    p.top_operators.push_back({x.req<std::string>("name"), x.req<int64_t>("calls"),
                               x.req<double>("self_cpu_us"), x.req<double>("total_cpu_us")});
  }
  for (const Reader& x : a.list("memory_by_phase")) {
    p.memory_by_phase.push_back({x.req<std::string>("phase"), x.req<std::string>("device"),
                                 x.req<double>("peak_allocated_bytes"),
                                 x.req<double>("growth_bytes")});
  }
  p.traces = r.strings("traces");
}

void to_json(json& j, const ProfileResult& p) {
  j = json::object();
  j["schema_version"] = kResultSchemaVersion;
  j["passed"] = p.status.passed;
  if (!p.status.measured) {
    j["reason"] = p.status.verdict;
    return;
  }
  json phases = json::array(), operators = json::array(), memory = json::array();
  for (const auto& x : p.phases) {
    phases.push_back({{"phase", x.phase}, {"seconds", x.seconds}, {"share", x.share}});
  }
  for (const auto& x : p.top_operators) {
    operators.push_back({{"name", x.name},
                         {"calls", x.calls},
                         {"self_cpu_us", x.self_cpu_us},
                         {"total_cpu_us", x.total_cpu_us}});
  }
  for (const auto& x : p.memory_by_phase) {
    memory.push_back({{"phase", x.phase},
                      {"device", x.device},
                      {"peak_allocated_bytes", x.peak_allocated_bytes},
                      {"growth_bytes", x.growth_bytes}});
  }
  j.update({{"device", p.device},
            {"verdict",
             {{"reason", p.status.verdict}, {"bottleneck", p.bottleneck}, {"actions", p.actions}}},
            {"analysis",
             {{"windows", p.windows},
              {"steps", p.steps},
              {"step_seconds_mean", p.step_seconds_mean},
              {"phases", phases},
              {"top_operators", operators},
              {"memory_by_phase", memory}}},
            {"traces", p.traces}});
}

// ---- scale -------------------------------------------------------------------------------------

void from_json(const json& j, ScaleResult& s) {
  const Reader r(j, "");
  s = {};
  s.status = read_status(r, j, "per_rank");
  if (!s.status.measured) return;
  s.world_size = r.req<int64_t>("world_size");
  s.strategy = r.req<std::string>("strategy");
  s.strategy_reason = r.req<std::string>("strategy_reason");
  s.backend = r.req<std::string>("backend");
  s.device = r.req<std::string>("device");
  const Reader g = r.obj("global");
  s.global_samples_per_second = g.req<double>("samples_per_second");
  s.global_tokens_per_second = g.nullable<double>("tokens_per_second");
  s.median_step_seconds = g.req<double>("median_step_seconds");
  s.comm_exposed_share_of_step = g.req<double>("comm_exposed_share_of_step");
  if (auto b = r.nullable_obj("baseline"))
    s.baseline_samples_per_second = b->req<double>("samples_per_second");
  s.scaling_efficiency = r.nullable<double>("scaling_efficiency");
  s.speedup = r.nullable<double>("speedup");
  s.replicas_in_sync = r.req<bool>("replicas_in_sync");
  for (const Reader& x : r.list("per_rank")) {
    ScaleRank k;
    k.rank = x.req<int64_t>("rank");
    k.seconds = x.req<double>("seconds");
    k.samples_per_second = x.req<double>("samples_per_second");
    k.tokens_per_second = x.opt<double>("tokens_per_second");
    k.compute_seconds = x.req<double>("compute_seconds");
    const Reader phase = x.obj("phase_seconds");
    k.data_wait_seconds = phase.req<double>("data_wait");
    k.forward_seconds = phase.req<double>("forward");
    k.backward_seconds = phase.req<double>("backward");
    k.comm_exposed_seconds = phase.req<double>("comm_exposed");
    k.optimizer_seconds = phase.req<double>("optimizer");
    k.comm_busy_seconds = x.obj("comm").req<double>("busy_seconds");
    s.per_rank.push_back(k);
  }
}

void to_json(json& j, const ScaleResult& s) {
  j = json::object();
  write_status(j, s.status);
  if (!s.status.measured) return;
  json ranks = json::array();
  for (const auto& k : s.per_rank) {
    ranks.push_back({{"rank", k.rank},
                     {"seconds", k.seconds},
                     {"samples_per_second", k.samples_per_second},
                     {"tokens_per_second", opt_json(k.tokens_per_second)},
                     {"compute_seconds", k.compute_seconds},
                     {"phase_seconds",
                      {{"data_wait", k.data_wait_seconds},
                       {"forward", k.forward_seconds},
                       {"backward", k.backward_seconds},
                       {"comm_exposed", k.comm_exposed_seconds},
                       {"optimizer", k.optimizer_seconds}}},
                     {"comm", {{"busy_seconds", k.comm_busy_seconds}}}});
  }
  j.update({{"world_size", s.world_size},
            {"strategy", s.strategy},
            {"strategy_reason", s.strategy_reason},
            {"backend", s.backend},
            {"device", s.device},
            {"global",
             {{"samples_per_second", s.global_samples_per_second},
              {"tokens_per_second", opt_json(s.global_tokens_per_second)},
              {"median_step_seconds", s.median_step_seconds},
              {"comm_exposed_share_of_step", s.comm_exposed_share_of_step}}},
            {"baseline", s.baseline_samples_per_second
                             ? json{{"samples_per_second", *s.baseline_samples_per_second}}
                             : json(nullptr)},
            {"scaling_efficiency", opt_json(s.scaling_efficiency)},
            {"speedup", opt_json(s.speedup)},
            {"replicas_in_sync", s.replicas_in_sync},
            {"per_rank", ranks}});
}

}  // namespace kiln
