// The model and its memory, analytically: parameter count, FLOPs, the memory model
// (docs/plan.md, "Parameters and FLOPs" and "Memory").
#include <fmt/format.h>

#include <algorithm>

#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/models.h"
#include "kiln/plan.h"
#include "plan/options.h"

namespace kiln {

// Every model through its ModelSpec::math (kiln/models.h): gpt's, llama's and the mlp's registered
// math as any model of one's own; the plan never asks a model's name.
ModelShape model_shape(const Config& config) {
  const PlanInputs inputs = PlanInputs::from_config(config);
  const ModelMath math = model_math(config);  // UserError without ModelSpec::math
  ModelShape shape;
  shape.architecture = inputs.model_name;  // for messages and plan.json only
  shape.tokens = model_takes_tokens(config);
  shape.layout = math.step_layout;
  shape.math_parameters = math.parameters;
  shape.math_largest_unit_parameters = math.largest_unit_parameters;
  shape.math_flop_parameters = math.flop_parameters;
  shape.math_attention_layers = math.n_layer;
  shape.math_attention_width = math.attention_width;
  shape.math_activation_elements = math.activation_elements_per_sample;
  shape.math_unit_activation_elements = math.unit_activation_elements_per_sample;
  shape.math_unit_input_elements = math.unit_input_elements_per_sample;
  shape.math_units = math.units;
  shape.math_tensor_parallel_parameters = math.tensor_parallel_parameters;
  shape.math_tensor_parallel_block_parameters = math.tensor_parallel_block_parameters;
  const ModelSpec& spec = model_spec(config);
  if (spec.tensor_parallel_problem && math.tensor_parallel_parameters > 0) {
    for (int64_t t = 2; t <= std::max<int64_t>(math.n_kv_head, 2); ++t) {
      if (spec.tensor_parallel_problem(config, t).empty())
        shape.tensor_parallel_degrees.push_back(t);
    }
  }
  shape.n_layer = math.n_layer;
  shape.n_head = math.n_head;
  shape.n_kv_head = math.n_kv_head;
  shape.n_embd = math.n_embd;
  shape.intermediate_size = math.intermediate_size;
  shape.vocab_size = math.vocab_size;
  shape.block_size = math.block_size;
  shape.tie_embeddings = math.tie_embeddings;
  shape.input_dim = math.input_dim;
  shape.hidden_dim = math.hidden_dim;
  shape.num_classes = math.num_classes;
  return shape;
}

int64_t analytic_parameter_count(const ModelShape& s) {
  return s.math_parameters;
}

int64_t largest_unit_parameter_count(const ModelShape& s) {
  return s.math_largest_unit_parameters;
}

double train_flops_per_token(const ModelShape& s, int64_t seq_len, bool activation_checkpointing) {
  const double passes = activation_checkpointing ? 4.0 / 3.0 : 1.0;  // one more forward
  // ModelMath::train_flops_per_token: 6N + 12 L w T (no attention term without layers).
  return passes * (6.0 * static_cast<double>(s.math_flop_parameters) +
                   12.0 * static_cast<double>(s.math_attention_layers) *
                       static_cast<double>(s.math_attention_width) * static_cast<double>(seq_len));
}

JobShape job_shape(const Config& config) {
  const PlanInputs inputs = PlanInputs::from_config(config);
  JobShape job;
  job.micro_batch = inputs.train_batch_size;
  job.seq_len = model_takes_tokens(config) ? inputs.data_seq_len : 1;
  job.grad_accum_steps = inputs.train_grad_accum_steps;
  job.world_size = inputs.plan_gpus;
  job.optimizer = inputs.optim_name;
  job.momentum = inputs.optim_momentum > 0;
  job.precision = inputs.train_precision;
  job.activation_checkpointing =
      inputs.plan_activation_checkpointing || inputs.train_activation_checkpointing == "block";
  job.fsdp_prefetch = inputs.dist_fsdp_prefetch;
  job.fsdp_reshard_after_forward = inputs.dist_reshard_after_forward;
  job.fsdp_accumulate_sharded = inputs.dist_fsdp_accumulate == "sharded";
  return job;
}

double state_bytes_per_parameter(const JobShape& job) {
  const double optimizer = job.optimizer == "adamw" ? 8.0 : (job.momentum ? 4.0 : 0.0);
  return 4.0 + 4.0 + optimizer;  // fp32 parameters and gradients in every precision
}

}  // namespace kiln
