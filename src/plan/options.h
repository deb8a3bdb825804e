// The job as the plan reads it: every key of [plan] and the others (train, optim, data, dist,
// checkpoint, baseline) the planner, the forecast and the host and storage checks read, in one
// typed value (src/plan/options.cpp; the plan sits below those components and reads their keys
// here, by name, once).
#pragma once

#include <cstdint>
#include <string>

#include "kiln/config.h"

namespace kiln {

struct PlanInputs {
  double baseline_peak_flops_per_second = 0;       // baseline.peak_flops_per_second
  bool checkpoint_async = false;                   // checkpoint.async
  int64_t checkpoint_every_steps = 0;              // checkpoint.every_steps
  int64_t checkpoint_keep_last_k = 0;              // checkpoint.keep_last_k
  bool checkpoint_save_final = false;              // checkpoint.save_final
  std::string data_path;                           // data.path
  int64_t data_prefetch = 0;                       // data.prefetch
  int64_t data_seq_len = 0;                        // data.seq_len
  std::string data_val_path;                       // data.val_path
  int64_t dist_dp_replicate = 0;                   // dist.dp_replicate
  std::string dist_fsdp_accumulate;                // dist.fsdp_accumulate
  bool dist_fsdp_prefetch = false;                 // dist.fsdp_prefetch
  bool dist_reshard_after_forward = false;         // dist.reshard_after_forward
  std::string dist_strategy;                       // dist.strategy
  int64_t dist_tp = 1;                             // dist.tp
  std::string model_name;                          // model.name
  double optim_momentum = 0;                       // optim.momentum
  std::string optim_name;                          // optim.name
  bool plan_activation_checkpointing = false;      // plan.activation_checkpointing
  std::string plan_catalog;                        // plan.catalog
  double plan_checkpoint_write_gb_per_second = 0;  // plan.checkpoint_write_gb_per_second
  double plan_gpu_mtbf_hours = 0;                  // plan.gpu_mtbf_hours
  int64_t plan_gpus = 0;                           // plan.gpus
  std::string plan_hardware;                       // plan.hardware
  double plan_headroom = 0;                        // plan.headroom
  double plan_margin = 0;                          // plan.margin
  double plan_mfu = 0;                             // plan.mfu
  std::string plan_pilot;                          // plan.pilot
  double plan_pilot_hours = 0;                     // plan.pilot_hours
  NumberTable plan_price_30d_per_gpu_hour;         // plan.price_30d_per_gpu_hour
  NumberTable plan_price_7d_per_gpu_hour;          // plan.price_7d_per_gpu_hour
  double plan_restart_minutes = 0;                 // plan.restart_minutes
  int64_t plan_restore_drills = 0;                 // plan.restore_drills
  double plan_storage_tb = 0;                      // plan.storage_tb
  double plan_tokens = 0;                          // plan.tokens
  std::string train_activation_checkpointing;      // train.activation_checkpointing
  int64_t train_batch_size = 0;                    // train.batch_size
  int64_t train_eval_batches = 0;                  // train.eval_batches
  int64_t train_eval_every = 0;                    // train.eval_every
  int64_t train_grad_accum_steps = 0;              // train.grad_accum_steps
  std::string train_precision;                     // train.precision
  int64_t train_steps = 0;                         // train.steps
  static PlanInputs from_config(const Config& config);
};

}  // namespace kiln
