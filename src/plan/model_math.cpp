// The model and its memory, analytically: parameter count, FLOPs, the memory model
// (docs/plan.md, "Parameters and FLOPs" and "Memory").
#include <fmt/format.h>

#include <algorithm>

#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/plan.h"

namespace kiln {
namespace {

double element_bytes(const std::string& precision) {
  return precision == "fp32" || precision == "tf32" ? 4.0 : 2.0;
}

int64_t block_parameters(int64_t c) {
  // ln_1 2C, c_attn 3C^2 + 3C, attn.c_proj C^2 + C, ln_2 2C, c_fc 4C^2 + 4C, mlp.c_proj 4C^2 + C
  return 12 * c * c + 13 * c;
}

}  // namespace

ModelShape model_shape(const Config& config) {
  ModelShape shape;
  shape.architecture = config.get_string("model.name");
  if (shape.architecture == "mlp") {
    shape.input_dim = config.get_int("model.input_dim");
    shape.hidden_dim = config.get_int("model.hidden_dim");
    shape.num_classes = config.get_int("model.num_classes");
    return shape;
  }
  const GptConfig gpt = resolve_gpt_config(config);
  shape.n_layer = gpt.n_layer;
  shape.n_head = gpt.n_head;
  shape.n_embd = gpt.n_embd;
  shape.block_size = gpt.block_size;
  shape.vocab_size = gpt.vocab_size;
  return shape;
}

int64_t analytic_parameter_count(const ModelShape& s) {
  if (s.architecture == "mlp") {
    return s.input_dim * s.hidden_dim + s.hidden_dim + s.hidden_dim * s.num_classes + s.num_classes;
  }
  const int64_t c = s.n_embd;
  return s.vocab_size * c + s.block_size * c + s.n_layer * block_parameters(c) + 2 * c;
}

int64_t largest_unit_parameter_count(const ModelShape& s) {
  if (s.architecture == "mlp") return analytic_parameter_count(s);
  const int64_t c = s.n_embd;
  return std::max(block_parameters(c), s.vocab_size * c + s.block_size * c + 2 * c);
}

double train_flops_per_token(const ModelShape& s, int64_t seq_len, bool activation_checkpointing) {
  const double passes = activation_checkpointing ? 4.0 / 3.0 : 1.0;  // one more forward
  if (s.architecture == "mlp") {
    return passes * 6.0 * static_cast<double>(analytic_parameter_count(s));
  }
  const double n = static_cast<double>(analytic_parameter_count(s) - s.block_size * s.n_embd);
  const double attention = 12.0 * static_cast<double>(s.n_layer) * static_cast<double>(s.n_embd) *
                           static_cast<double>(seq_len);
  return passes * (6.0 * n + attention);
}

JobShape job_shape(const Config& config) {
  JobShape job;
  job.micro_batch = config.get_int("train.batch_size");
  job.seq_len = config.get_string("model.name") == "gpt" ? config.get_int("data.seq_len") : 1;
  job.grad_accum_steps = config.get_int("train.grad_accum_steps");
  job.world_size = config.get_int("plan.gpus");
  job.optimizer = config.get_string("optim.name");
  job.momentum = config.get_float("optim.momentum") > 0;
  if (find_key("train.precision") != nullptr) job.precision = config.get_string("train.precision");
  job.activation_checkpointing = config.get_bool("plan.activation_checkpointing");
  return job;
}

double state_bytes_per_parameter(const JobShape& job) {
  const double optimizer = job.optimizer == "adamw" ? 8.0 : (job.momentum ? 4.0 : 0.0);
  return 4.0 + 4.0 + optimizer;  // fp32 parameters and gradients in every precision
}

MemoryEstimate estimate_memory(const ModelShape& s, const JobShape& job) {
  MemoryEstimate m;
  const double n = static_cast<double>(analytic_parameter_count(s));
  m.parameters = 4.0 * n;
  m.gradients = 4.0 * n;
  m.optimizer = (state_bytes_per_parameter(job) - 8.0) * n;
  const double e = element_bytes(job.precision);
  const double b = static_cast<double>(job.micro_batch);
  if (s.architecture == "mlp") {
    // fc1 saves its input [b, D], relu its output [b, H], fc2 its input [b, H]; cross-entropy's
    // log-softmax output [b, K] and the two gradients of it in backward.
    m.activations =
        b * (static_cast<double>(s.input_dim) + 2.0 * static_cast<double>(s.hidden_dim)) * e;
    m.logits = 3.0 * b * static_cast<double>(s.num_classes) * 4.0;
    return m;
  }
  const double t = static_cast<double>(job.seq_len), h = static_cast<double>(s.n_embd),
               a = static_cast<double>(s.n_head), layers = static_cast<double>(s.n_layer);
  const double sbh = t * b * h, sb = t * b;
  // Per block (Korthikanti et al. 2022, sbh(34 + 5as/h) bytes in 16-bit, adapted to kiln's block:
  // no dropout masks, SDPA keeps no [s, s] matrix but its output and an fp32 log-sum-exp [b, a,
  // s], and the attention output is held twice (SDPA's output and the contiguous input of c_proj):
  // 17 sbh elements = 34 sbh bytes in 16-bit) plus the two LayerNorms' mean and rstd.
  const double per_block = job.activation_checkpointing
                               ? sbh * e  // only the block's input; one block recomputed at a time
                               : 17.0 * sbh * e + 4.0 * a * sb + 2.0 * 2.0 * sb * 4.0;
  const double recomputed = job.activation_checkpointing ? 17.0 * sbh * e + 4.0 * a * sb : 0.0;
  // The final LayerNorm's input and output, and the batch (inputs and targets, int64).
  m.activations = layers * per_block + recomputed + 2.0 * sbh * e + 2.0 * sb * 4.0 + 2.0 * sb * 8.0;
  // Cross-entropy in fp32: log-softmax's output [b, s, V] lives until backward, where the
  // gradient of it and of the logits join it.
  m.logits = 3.0 * sb * static_cast<double>(s.vocab_size) * 4.0;
  return m;
}

nlohmann::json to_json(const MemoryEstimate& m) {
  return {{"parameters_bytes", m.parameters}, {"gradients_bytes", m.gradients},
          {"optimizer_bytes", m.optimizer},   {"activations_bytes", m.activations},
          {"logits_bytes", m.logits},         {"total_bytes", m.total()}};
}

StrategyInput strategy_input(const ModelShape& shape, const JobShape& job,
                             double device_memory_bytes, double headroom_fraction) {
  const MemoryEstimate m = estimate_memory(shape, job);
  StrategyInput in;
  in.ddp_model_state_bytes = m.parameters + m.gradients + m.optimizer;
  in.largest_unit_parameter_bytes = 4.0 * static_cast<double>(largest_unit_parameter_count(shape));
  in.activation_bytes = m.activations + m.logits;
  in.device_memory_bytes = device_memory_bytes;
  in.headroom_fraction = headroom_fraction;
  in.gpu_count = job.world_size;
  return in;
}

}  // namespace kiln
