// Typed rung results (kiln/results.h), continued: checkpoint, pilot, plan, the manifest, metrics
// records, and reading a file (read_result).
#include <fmt/format.h>

#include <cmath>

#include "core/files.h"
#include "core/strings.h"
#include "kiln/results.h"
#include "report/result_reader.h"

namespace kiln {
using namespace result_json;
using nlohmann::json;

// ---- checkpoint --------------------------------------------------------------------------------

void from_json(const json& j, CheckpointResult& c) {
  const Reader r(j, "");
  c = {};
  c.status = read_status(r, j, "drill_steps");
  if (!c.status.measured) return;
  c.drill_steps = r.req<int64_t>("drill_steps");
  c.total_steps = r.req<int64_t>("total_steps");
  c.reference_seconds = r.opt<double>("reference_seconds");
  c.save_seconds = r.opt<double>("save_seconds");
  c.resume_seconds = r.opt<double>("resume_seconds");
  c.checkpoint_bytes = r.opt<double>("checkpoint_bytes");
  c.killed = r.opt<bool>("killed");
  c.losses_compared = r.opt<int64_t>("losses_compared");
  c.losses_bitwise_equal = r.opt<bool>("losses_bitwise_equal");
  c.parameters_bitwise_equal = r.opt<bool>("parameters_bitwise_equal");
  c.optimizer_state_bitwise_equal = r.opt<bool>("optimizer_state_bitwise_equal");
  c.seconds = r.opt<double>("seconds");
}

void to_json(json& j, const CheckpointResult& c) {
  j = json::object();
  write_status(j, c.status);
  if (!c.status.measured) return;
  j["drill_steps"] = c.drill_steps;
  j["total_steps"] = c.total_steps;
  auto put = [&](const char* key, const auto& value) {
    if (value) j[key] = *value;
  };
  put("reference_seconds", c.reference_seconds);
  put("save_seconds", c.save_seconds);
  put("resume_seconds", c.resume_seconds);
  put("checkpoint_bytes", c.checkpoint_bytes);
  put("killed", c.killed);
  put("losses_compared", c.losses_compared);
  put("losses_bitwise_equal", c.losses_bitwise_equal);
  put("parameters_bitwise_equal", c.parameters_bitwise_equal);
  put("optimizer_state_bitwise_equal", c.optimizer_state_bitwise_equal);
  put("seconds", c.seconds);
}

// ---- pilot -------------------------------------------------------------------------------------

void from_json(const json& j, PilotResult& p) {
  const Reader r(j, "");
  p = {};
  p.status = read_status(r, j, "memory");
  if (!p.status.measured) return;
  p.job_hash = r.req<std::string>("job_hash");
  p.config_hash = r.req<std::string>("config_hash");
  p.device = r.req<std::string>("device");
  p.device_name = r.req<std::string>("device_name");
  p.world_size = r.req<int64_t>("world_size");
  p.steps = r.req<int64_t>("steps");
  const Reader shape = r.obj("shape");
  p.micro_batch = shape.req<int64_t>("micro_batch");
  p.seq_len = shape.req<int64_t>("seq_len");
  p.grad_accum_steps = shape.req<int64_t>("grad_accum_steps");
  p.precision = shape.req<std::string>("precision");
  p.step_seconds = r.req<double>("step_seconds");
  p.loss = r.req<double>("loss");
  p.eval_seconds = r.req<double>("eval_seconds");
  p.val_loss = r.req<double>("val_loss");
  p.wall_seconds = r.req<double>("wall_seconds");
  p.mfu = r.nullable<double>("mfu");
  const Reader ckpt = r.obj("checkpoint");
  p.checkpoint_bytes = ckpt.req<double>("bytes");
  p.save_seconds = ckpt.req<double>("save_seconds");
  p.write_bytes_per_second = ckpt.req<double>("write_bytes_per_second");
  const Reader memory = r.obj("memory");
  p.memory_method = memory.req<std::string>("method");
  const Reader est = memory.obj("estimate");
  p.estimated = {est.req<double>("parameters_bytes"), est.req<double>("gradients_bytes"),
                 est.req<double>("optimizer_bytes"),
                 est.req<double>("activations_bytes") + est.req<double>("logits_bytes"),
                 memory.req<double>("estimate_step_peak_bytes")};
  const Reader meas = memory.obj("measured");
  p.measured = {meas.req<double>("parameters_bytes"), meas.req<double>("gradients_bytes"),
                meas.req<double>("optimizer_bytes"),
                meas.req<double>("activations_and_logits_bytes"), meas.req<double>("peak_bytes")};
  p.measured_over_estimate = memory.req<double>("measured_over_estimate");
  p.within_allowed_error = memory.req<bool>("within_allowed_error");
  const Reader restore = r.obj("restore");
  p.restore_passed = restore.req<bool>("passed");
  p.restore_seconds = restore.req<double>("seconds");
  p.restore_step = restore.req<int64_t>("step");
  p.restore_exit_status = restore.req<int64_t>("exit_status");
  p.loss_bitwise_equal = restore.req<bool>("loss_bitwise_equal");
  p.differing_tensors = restore.strings("differing_tensors");
}

void to_json(json& j, const PilotResult& p) {
  j = json::object();
  write_status(j, p.status);
  if (!p.status.measured) return;
  // The estimate's activations and logits are one figure here: written as activations.
  j.update({{"job_hash", p.job_hash},
            {"config_hash", p.config_hash},
            {"device", p.device},
            {"device_name", p.device_name},
            {"world_size", p.world_size},
            {"steps", p.steps},
            {"shape",
             {{"micro_batch", p.micro_batch},
              {"seq_len", p.seq_len},
              {"grad_accum_steps", p.grad_accum_steps},
              {"precision", p.precision}}},
            {"step_seconds", p.step_seconds},
            {"loss", p.loss},
            {"eval_seconds", p.eval_seconds},
            {"val_loss", p.val_loss},
            {"wall_seconds", p.wall_seconds},
            {"mfu", opt_json(p.mfu)},
            {"checkpoint",
             {{"bytes", p.checkpoint_bytes},
              {"save_seconds", p.save_seconds},
              {"write_bytes_per_second", p.write_bytes_per_second}}},
            {"memory",
             {{"method", p.memory_method},
              {"estimate",
               {{"parameters_bytes", p.estimated.parameters},
                {"gradients_bytes", p.estimated.gradients},
                {"optimizer_bytes", p.estimated.optimizer},
                {"activations_bytes", p.estimated.activations_and_logits},
                {"logits_bytes", 0.0}}},
              {"estimate_step_peak_bytes", p.estimated.step_peak},
              {"measured",
               {{"parameters_bytes", p.measured.parameters},
                {"gradients_bytes", p.measured.gradients},
                {"optimizer_bytes", p.measured.optimizer},
                {"activations_and_logits_bytes", p.measured.activations_and_logits},
                {"peak_bytes", p.measured.step_peak}}},
              {"measured_over_estimate", p.measured_over_estimate},
              {"within_allowed_error", p.within_allowed_error}}},
            {"restore",
             {{"passed", p.restore_passed},
              {"seconds", p.restore_seconds},
              {"step", p.restore_step},
              {"exit_status", p.restore_exit_status},
              {"loss_bitwise_equal", p.loss_bitwise_equal},
              {"differing_tensors", p.differing_tensors}}}});
}

// ---- plan --------------------------------------------------------------------------------------

std::string PlanRow::strategy_text() const {
  return strategy == "fsdp" ? fmt::format("fsdp x{}", fsdp_degree) : strategy;
}

double PlanRow::bytes_per_device() const {
  return strategy == "ddp" ? ddp_bytes_per_device : fsdp_bytes_per_device;
}

int PlanResult::recommended_row() const {
  if (!recommended_hardware) return -1;
  for (size_t k = 0; k < rows.size(); ++k) {
    if (rows[k].hardware == *recommended_hardware) return static_cast<int>(k);
  }
  return -1;
}

namespace {
PlanReservation read_reservation(const Reader& r) {
  return {r.req<bool>("fits"), r.nullable<double>("cost")};
}
json reservation_json(const PlanReservation& r) {
  return {{"fits", r.fits}, {"cost", opt_json(r.cost)}};
}
}  // namespace

void from_json(const json& j, PlanResult& p) {
  const Reader r(j, "");
  p = {};
  // plan.json had no passed/verdict before the ladder ran the plan: "advice" that passed.
  p.status.schema_version = r.opt<int>("schema_version").value_or(1);
  if (p.status.schema_version > kResultSchemaVersion) {
    Reader::fail("schema_version", fmt::format("is {}: written by a newer kiln (this one reads up "
                                               "to {})",
                                               p.status.schema_version, kResultSchemaVersion));
  }
  p.recommendation_text = r.req<std::string>("recommendation_text");
  p.status.passed = r.opt<bool>("passed").value_or(true);
  p.status.verdict = r.opt<std::string>("verdict").value_or(p.recommendation_text);
  p.config = r.req<std::string>("config");
  p.pilot = r.nullable<std::string>("pilot");
  const Reader model = r.obj("model");
  p.architecture = model.req<std::string>("architecture");
  p.parameters = model.req<double>("parameters");
  p.flops_per_token = model.req<double>("flops_per_token");
  const Reader job = r.obj("job");
  p.micro_batch = job.req<int64_t>("micro_batch");
  p.seq_len = job.req<int64_t>("seq_len");
  p.grad_accum_steps = job.req<int64_t>("grad_accum_steps");
  p.gpus = job.req<int64_t>("gpus");
  p.precision = job.req<std::string>("precision");
  p.optimizer = job.req<std::string>("optimizer");
  p.tokens = job.req<double>("tokens");
  p.tokens_per_step = job.req<double>("tokens_per_step");
  p.steps = job.req<double>("steps");
  p.checkpoint_bytes = r.obj("checkpoint").req<double>("bytes");
  p.assumptions = r.strings("assumptions");
  for (const Reader& x : r.list("rows")) {
    PlanRow row;
    row.hardware = x.req<std::string>("hardware");
    row.display_name = x.req<std::string>("display_name");
    row.gpus = x.req<int64_t>("gpus");
    row.fits_memory = x.req<bool>("fits_memory");
    const Reader s = x.obj("strategy");
    row.strategy = s.req<std::string>("strategy");
    row.fsdp_degree = s.req<int64_t>("fsdp_degree");
    row.ddp_bytes_per_device = s.req<double>("ddp_bytes_per_device");
    row.fsdp_bytes_per_device = s.req<double>("fsdp_bytes_per_device");
    row.usable_bytes = s.req<double>("usable_bytes");
    row.strategy_reason = s.req<std::string>("reason");
    row.mfu = x.req<double>("mfu");
    row.mfu_source = x.req<std::string>("mfu_source");
    row.step_seconds = x.req<double>("step_seconds");
    row.compute_seconds_per_step = x.req<double>("compute_seconds_per_step");
    row.communication_seconds_per_step = x.req<double>("communication_seconds_per_step");
    row.wall_days = x.nullable<double>("wall_days");
    row.ettr = x.req<double>("ettr");
    row.checkpoint_interval_seconds = x.req<double>("checkpoint_interval_seconds");
    row.expected_failures = x.nullable<double>("expected_failures");
    row.reservation_7d = read_reservation(x.obj("reservation_7d"));
    row.reservation_30d = read_reservation(x.obj("reservation_30d"));
    p.rows.push_back(row);
  }
  if (auto rec = r.nullable_obj("recommendation")) {
    p.recommended_hardware = rec->req<std::string>("hardware");
    p.recommended_days = rec->req<int64_t>("reservation_days");
  }
}

void to_json(json& j, const PlanResult& p) {
  j = json::object();
  write_status(j, p.status);
  json rows = json::array();
  for (const auto& row : p.rows) {
    rows.push_back({{"hardware", row.hardware},
                    {"display_name", row.display_name},
                    {"gpus", row.gpus},
                    {"fits_memory", row.fits_memory},
                    {"strategy",
                     {{"strategy", row.strategy},
                      {"fsdp_degree", row.fsdp_degree},
                      {"ddp_bytes_per_device", row.ddp_bytes_per_device},
                      {"fsdp_bytes_per_device", row.fsdp_bytes_per_device},
                      {"usable_bytes", row.usable_bytes},
                      {"reason", row.strategy_reason}}},
                    {"mfu", row.mfu},
                    {"mfu_source", row.mfu_source},
                    {"step_seconds", row.step_seconds},
                    {"compute_seconds_per_step", row.compute_seconds_per_step},
                    {"communication_seconds_per_step", row.communication_seconds_per_step},
                    {"wall_days", opt_json(row.wall_days)},
                    {"ettr", row.ettr},
                    {"checkpoint_interval_seconds", row.checkpoint_interval_seconds},
                    {"expected_failures", opt_json(row.expected_failures)},
                    {"reservation_7d", reservation_json(row.reservation_7d)},
                    {"reservation_30d", reservation_json(row.reservation_30d)}});
  }
  j.update(
      {{"config", p.config},
       {"pilot", opt_json(p.pilot)},
       {"model",
        {{"architecture", p.architecture},
         {"parameters", p.parameters},
         {"flops_per_token", p.flops_per_token}}},
       {"job",
        {{"micro_batch", p.micro_batch},
         {"seq_len", p.seq_len},
         {"grad_accum_steps", p.grad_accum_steps},
         {"gpus", p.gpus},
         {"precision", p.precision},
         {"optimizer", p.optimizer},
         {"tokens", p.tokens},
         {"tokens_per_step", p.tokens_per_step},
         {"steps", p.steps}}},
       {"checkpoint", {{"bytes", p.checkpoint_bytes}}},
       {"assumptions", p.assumptions},
       {"rows", rows},
       {"recommendation", p.recommended_hardware ? json{{"hardware", *p.recommended_hardware},
                                                        {"reservation_days", p.recommended_days}}
                                                 : json(nullptr)},
       {"recommendation_text", p.recommendation_text}});
}

// ---- manifest.json: what the report shows of it -------------------------------------------------

void from_json(const json& j, RunIdentity& m) {
  const Reader r(j, "");
  m = {};
  const Reader kiln = r.obj("kiln");
  m.kiln_version = kiln.req<std::string>("version");
  m.git_commit = kiln.req<std::string>("git_commit");
  m.git_dirty = kiln.opt<bool>("git_dirty").value_or(false);
  m.libtorch_version = r.obj("libtorch").req<std::string>("version");
  const Reader config = r.obj("config");
  m.config_file = config.opt<std::string>("file").value_or("");
  m.config_hash = config.req<std::string>("hash_xxh64");
  if (r.has("data")) {
    const auto data = std::optional<Reader>(r.obj("data"));
    m.data_kind = data->opt<std::string>("kind").value_or("");
    m.data_content_hash = data->opt<std::string>("content_xxh3").value_or("");
    m.data_revision = data->opt<std::string>("revision");
  }
  const Reader model = r.obj("model");
  m.model_architecture = model.req<std::string>("architecture");
  m.model_parameters = model.req<double>("parameter_count");
  m.device = r.req<std::string>("device");
  m.world_size = r.opt<int64_t>("world_size").value_or(1);
  m.command_line = r.opt<std::string>("command_line").value_or("");
  m.start_time_utc = r.opt<std::string>("start_time_utc").value_or("");
}

void to_json(json& j, const RunIdentity& m) {
  json data = {{"kind", m.data_kind}, {"revision", opt_json(m.data_revision)}};
  if (!m.data_content_hash.empty()) data["content_xxh3"] = m.data_content_hash;
  j = {{"kiln",
        {{"version", m.kiln_version}, {"git_commit", m.git_commit}, {"git_dirty", m.git_dirty}}},
       {"libtorch", {{"version", m.libtorch_version}}},
       {"config", {{"file", m.config_file}, {"hash_xxh64", m.config_hash}}},
       {"data", data},
       {"model", {{"architecture", m.model_architecture}, {"parameter_count", m.model_parameters}}},
       {"device", m.device},
       {"world_size", m.world_size},
       {"command_line", m.command_line},
       {"start_time_utc", m.start_time_utc}};
}

// ---- metrics.jsonl records ----------------------------------------------------------------------

void from_json(const json& j, MetricsRecord& m) {
  const Reader r(j, "");
  m = {};
  m.step = r.req<int64_t>("step");
  m.loss = r.opt<double>("loss");
  m.lr = r.opt<double>("lr");
  m.step_seconds = r.opt<double>("step_seconds");
  m.data_wait_seconds = r.opt<double>("data_wait_seconds");
  m.samples_per_second = r.opt<double>("samples_per_second");
  m.tokens_per_second = r.opt<double>("tokens_per_second");
  m.val_loss = r.opt<double>("val_loss");
}

void to_json(json& j, const MetricsRecord& m) {
  j = {{"step", m.step}};
  auto put = [&](const char* key, const std::optional<double>& v) {
    if (v) j[key] = *v;
  };
  put("loss", m.loss);
  put("lr", m.lr);
  put("step_seconds", m.step_seconds);
  put("data_wait_seconds", m.data_wait_seconds);
  put("samples_per_second", m.samples_per_second);
  put("tokens_per_second", m.tokens_per_second);
  put("val_loss", m.val_loss);
}

// ---- reading a file ----------------------------------------------------------------------------

namespace {
template <class T>
std::string regenerate_hint() {
  if constexpr (std::is_same_v<T, RunIdentity>) {
    return "every kiln command writes it at the start of a run";
  } else if constexpr (std::is_same_v<T, MetricsRecord>) {
    return "kiln train writes it";
  } else {
    return fmt::format("rerun `kiln {}` (or `kiln ladder`) with this kiln to regenerate it",
                       std::string(T::kRung) == "checkpoint" ? "ladder" : T::kRung);
  }
}
}  // namespace

template <class T>
T read_result(const std::filesystem::path& file) {
  json value;
  try {
    value = json::parse(read_file(file));
  } catch (const std::exception& e) {
    throw ResultFormatError(fmt::format("{}: not a JSON object ({}); {}", file.string(),
                                        one_line_error(e), regenerate_hint<T>()));
  }
  int version = 1;
  if (value.is_object() && value.contains("schema_version") &&
      value["schema_version"].is_number_integer()) {
    version = value["schema_version"].get<int>();
  }
  try {
    return value.get<T>();
  } catch (const ResultFormatError& e) {
    throw ResultFormatError(fmt::format(
        "{}: {} (schema version {}{}); {}", file.string(), e.what(), version,
        version == 1 && !value.contains("schema_version") ? ", the unversioned format" : "",
        regenerate_hint<T>()));
  }
}

template BaselineResult read_result<BaselineResult>(const std::filesystem::path&);
template CompileResult read_result<CompileResult>(const std::filesystem::path&);
template ProfileResult read_result<ProfileResult>(const std::filesystem::path&);
template ScaleResult read_result<ScaleResult>(const std::filesystem::path&);
template CheckpointResult read_result<CheckpointResult>(const std::filesystem::path&);
template PilotResult read_result<PilotResult>(const std::filesystem::path&);
template PlanResult read_result<PlanResult>(const std::filesystem::path&);
template RunIdentity read_result<RunIdentity>(const std::filesystem::path&);

}  // namespace kiln
