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
  if (shape.architecture == "gpt") {
    const GptConfig gpt = resolve_gpt_config(config);
    shape.n_layer = gpt.n_layer;
    shape.n_head = gpt.n_head;
    shape.n_embd = gpt.n_embd;
    shape.block_size = gpt.block_size;
    shape.vocab_size = gpt.vocab_size;
    return shape;
  }
  // Any other model (llama, a user's): the counts from its registered math, the widths for the
  // memory model (llama's walk reads them; src/plan/memory_llama.cpp).
  const ModelMath math = model_math(config);  // UserError without ModelSpec::math
  shape.math_parameters = math.parameters;
  shape.math_largest_unit_parameters = math.largest_unit_parameters;
  shape.math_flop_parameters = math.flop_parameters;
  shape.math_attention_layers = math.n_layer;
  shape.math_attention_width = math.attention_width;
  shape.math_activation_elements = math.activation_elements_per_sample;
  shape.math_unit_activation_elements = math.unit_activation_elements_per_sample;
  shape.math_unit_input_elements = math.unit_input_elements_per_sample;
  shape.math_units = math.units;
  shape.n_layer = math.n_layer;
  shape.n_head = math.n_head;
  shape.n_kv_head = math.n_kv_head;
  shape.n_embd = math.n_embd;
  shape.intermediate_size = math.intermediate_size;
  shape.vocab_size = math.vocab_size;
  if (shape.architecture == "llama") {
    const LlamaConfig llama = resolve_llama_config(config);
    shape.block_size = llama.block_size;
    shape.tie_embeddings = llama.tie_embeddings;
  }
  return shape;
}

int64_t analytic_parameter_count(const ModelShape& s) {
  if (s.architecture == "mlp") {
    return s.input_dim * s.hidden_dim + s.hidden_dim + s.hidden_dim * s.num_classes + s.num_classes;
  }
  if (s.architecture != "gpt") return s.math_parameters;
  const int64_t c = s.n_embd;
  return s.vocab_size * c + s.block_size * c + s.n_layer * block_parameters(c) + 2 * c;
}

int64_t largest_unit_parameter_count(const ModelShape& s) {
  if (s.architecture == "mlp") return analytic_parameter_count(s);
  if (s.architecture != "gpt") return s.math_largest_unit_parameters;
  const int64_t c = s.n_embd;
  return std::max(block_parameters(c), s.vocab_size * c + s.block_size * c + 2 * c);
}

double train_flops_per_token(const ModelShape& s, int64_t seq_len, bool activation_checkpointing) {
  const double passes = activation_checkpointing ? 4.0 / 3.0 : 1.0;  // one more forward
  if (s.architecture == "mlp") {
    return passes * 6.0 * static_cast<double>(analytic_parameter_count(s));
  }
  if (s.architecture != "gpt") {  // ModelMath::train_flops_per_token
    return passes *
           (6.0 * static_cast<double>(s.math_flop_parameters) +
            12.0 * static_cast<double>(s.math_attention_layers) *
                static_cast<double>(s.math_attention_width) * static_cast<double>(seq_len));
  }
  const double n = static_cast<double>(analytic_parameter_count(s) - s.block_size * s.n_embd);
  const double attention = 12.0 * static_cast<double>(s.n_layer) * static_cast<double>(s.n_embd) *
                           static_cast<double>(seq_len);
  return passes * (6.0 * n + attention);
}

JobShape job_shape(const Config& config) {
  JobShape job;
  job.micro_batch = config.get_int("train.batch_size");
  job.seq_len = model_takes_tokens(config) ? config.get_int("data.seq_len") : 1;
  job.grad_accum_steps = config.get_int("train.grad_accum_steps");
  job.world_size = config.get_int("plan.gpus");
  job.optimizer = config.get_string("optim.name");
  job.momentum = config.get_float("optim.momentum") > 0;
  job.precision = training_precision(config);
  job.activation_checkpointing = config.get_bool("plan.activation_checkpointing") ||
                                 config.get_string("train.activation_checkpointing") == "block";
  job.fsdp_prefetch = config.get_bool("dist.fsdp_prefetch");
  job.fsdp_reshard_after_forward = config.get_bool("dist.reshard_after_forward");
  job.fsdp_accumulate_sharded = config.get_string("dist.fsdp_accumulate") == "sharded";
  return job;
}

double state_bytes_per_parameter(const JobShape& job) {
  const double optimizer = job.optimizer == "adamw" ? 8.0 : (job.momentum ? 4.0 : 0.0);
  return 4.0 + 4.0 + optimizer;  // fp32 parameters and gradients in every precision
}

}  // namespace kiln
