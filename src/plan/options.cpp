// The plan's reads of the config (src/plan/options.h).
#include "plan/options.h"

#include "kiln/plan.h"

namespace kiln {

PlanInputs PlanInputs::from_config(const Config& config) {
  PlanInputs in;
  in.baseline_peak_flops_per_second = config.get_float("baseline.peak_flops_per_second");
  in.checkpoint_async = config.get_bool("checkpoint.async");
  in.checkpoint_every_steps = config.get_int("checkpoint.every_steps");
  in.checkpoint_keep_last_k = config.get_int("checkpoint.keep_last_k");
  in.checkpoint_save_final = config.get_bool("checkpoint.save_final");
  in.data_path = config.get_string("data.path");
  in.data_prefetch = config.get_int("data.prefetch");
  in.data_seq_len = config.get_int("data.seq_len");
  in.data_val_path = config.get_string("data.val_path");
  in.dist_fsdp_accumulate = config.get_string("dist.fsdp_accumulate");
  in.dist_dp_replicate = config.get_int("dist.dp_replicate");
  in.dist_fsdp_prefetch = config.get_bool("dist.fsdp_prefetch");
  in.dist_reshard_after_forward = config.get_bool("dist.reshard_after_forward");
  in.dist_strategy = config.get_string("dist.strategy");
  in.dist_tp = config.get_int("dist.tp");
  in.model_name = config.get_string("model.name");
  in.optim_momentum = config.get_float("optim.momentum");
  in.optim_name = config.get_string("optim.name");
  in.plan_activation_checkpointing = config.get_bool("plan.activation_checkpointing");
  in.plan_catalog = config.get_string("plan.catalog");
  in.plan_checkpoint_write_gb_per_second = config.get_float("plan.checkpoint_write_gb_per_second");
  in.plan_gpu_mtbf_hours = config.get_float("plan.gpu_mtbf_hours");
  in.plan_gpus = config.get_int("plan.gpus");
  in.plan_hardware = config.get_string("plan.hardware");
  in.plan_headroom = config.get_float("plan.headroom");
  in.plan_margin = config.get_float("plan.margin");
  in.plan_mfu = config.get_float("plan.mfu");
  in.plan_pilot = config.get_string("plan.pilot");
  in.plan_pilot_hours = config.get_float("plan.pilot_hours");
  in.plan_price_30d_per_gpu_hour = config.get_table("plan.price_30d_per_gpu_hour");
  in.plan_price_7d_per_gpu_hour = config.get_table("plan.price_7d_per_gpu_hour");
  in.plan_restart_minutes = config.get_float("plan.restart_minutes");
  in.plan_restore_drills = config.get_int("plan.restore_drills");
  in.plan_storage_tb = config.get_float("plan.storage_tb");
  in.plan_tokens = config.get_float("plan.tokens");
  in.train_activation_checkpointing = config.get_string("train.activation_checkpointing");
  in.train_batch_size = config.get_int("train.batch_size");
  in.train_eval_batches = config.get_int("train.eval_batches");
  in.train_eval_every = config.get_int("train.eval_every");
  in.train_grad_accum_steps = config.get_int("train.grad_accum_steps");
  in.train_precision =
      find_key("train.precision") != nullptr ? config.get_string("train.precision") : "fp32";
  in.train_steps = config.get_int("train.steps");
  return in;
}

// A config of another schema (tests of the catalog) may have no [train]: fp32 then.
std::string training_precision(const Config& config) {
  return find_key("train.precision") != nullptr ? config.get_string("train.precision") : "fp32";
}

}  // namespace kiln
