// The [train] and [optim] sections of the config schema and their rules (checked by
// `kiln config validate` and before `kiln train` writes anything).
#include <string>

#include "core/schema_sections.h"

namespace kiln {

ConfigSection train_section() {
  return {
      "train",
      {
          int_key("train", "steps", 1000, 1, 1e12, "optimizer steps"),
          int_key("train", "stop_after_step", 0, 0, 1e12,
                  "end this process after this optimizer step, with the end's evaluation and "
                  "checkpoint (0 = train.steps); the schedule still spans train.steps: one slice "
                  "of a longer job, resumed with --resume"),
          int_key("train", "batch_size", 32, 1, 1e9, "samples per micro-batch per process"),
          int_key("train", "grad_accum_steps", 1, 1, 1e6, "micro-batches per optimizer step"),
          float_key("train", "clip_grad_norm", 1.0, 0.0, kUnbounded,
                    "clip the global gradient norm to this (0 = no clipping)"),
          int_key("train", "eval_every", 100, 0, 1e12,
                  "steps between evaluations (0 = only at the end)"),
          int_key("train", "eval_batches", 8, 1, 1e9, "validation batches per evaluation"),
          string_key("train", "nonfinite", "abort", {"abort", "skip"},
                     "on a non-finite loss or gradient: stop the run, or skip the step"),
          int_key("train", "max_skipped_steps", 10, 0, 1e9,
                  "with nonfinite = skip: stop after this many skipped steps"),
          int_key("train", "metrics_every", 1, 1, 1e12,
                  "steps between reading the loss and grad norm back from the device (a metrics "
                  "record and the non-finite checks); other steps never wait for the device"),
          string_key("train", "precision", "fp32", {"fp32", "bf16-mixed", "fp16-mixed"},
                     "mixed: fp32 parameters, gradients and optimizer state, forward and loss "
                     "under autocast to bf16 or fp16; fp16-mixed adds a dynamic loss scaler "
                     "(docs/training.md)"),
          string_key("train", "activation_checkpointing", "none", {"none", "block"},
                     "block: keep only each model unit's input (gpt: each transformer block) and "
                     "recompute its activations in backward"),
      },
      {{"train.stop_after_step <= train.steps",
        [](const Config& c) -> std::string {
          const int64_t stop = c.get_int("train.stop_after_step"), steps = c.get_int("train.steps");
          if (stop <= steps) return "";
          return "train.stop_after_step = " + std::to_string(stop) +
                 " is past train.steps = " + std::to_string(steps) +
                 "; set it to at most train.steps (0: stop at train.steps)";
        },
        {"train.steps=10", "train.stop_after_step=20"}}}};
}

ConfigSection optim_section() {
  return {
      "optim",
      {
          string_key("optim", "name", "adamw", {"adamw", "sgd"}, "optimizer"),
          float_key("optim", "lr", 1e-3, 0.0, kUnbounded, "peak learning rate"),
          float_key("optim", "weight_decay", 0.0, 0.0, kUnbounded,
                    "weight decay on parameters with >= 2 dims (adamw: decoupled; sgd: L2, as "
                    "torch.optim.SGD)"),
          float_key("optim", "beta1", 0.9, 0.0, 0.999999, "adamw: first-moment decay"),
          float_key("optim", "beta2", 0.999, 0.0, 0.999999999, "adamw: second-moment decay"),
          float_key("optim", "eps", 1e-8, 0.0, 1.0, "adamw: denominator epsilon"),
          float_key("optim", "momentum", 0.0, 0.0, 0.999999, "sgd: momentum"),
          bool_key("optim", "nesterov", false, "sgd: Nesterov momentum"),
          bool_key("optim", "fused", true,
                   "use ATen's fused optimizer kernels (_fused_adamw_ / _fused_sgd_)"),
          string_key("optim", "schedule", "constant", {"constant", "cosine"},
                     "learning-rate schedule after warmup"),
          int_key("optim", "warmup_steps", 0, 0, 1e12, "linear warmup steps from 0 to optim.lr"),
          float_key("optim", "min_lr_ratio", 0.1, 0.0, 1.0,
                    "cosine: final learning rate as a share of optim.lr"),
      },
      {
          {"optim.nesterov = true needs optim.name = \"sgd\"",
           [](const Config& c) -> std::string {
             if (!c.get_bool("optim.nesterov") || c.get_string("optim.name") == "sgd") return "";
             return "optim.nesterov = true needs optim.name = \"sgd\" (" +
                    c.get_string("optim.name") +
                    " has no Nesterov momentum); set optim.name = \"sgd\" with "
                    "optim.momentum > 0, or optim.nesterov = false";
           },
           {"optim.nesterov=true"}},
          {"optim.nesterov = true needs optim.momentum > 0",
           [](const Config& c) -> std::string {
             if (!c.get_bool("optim.nesterov") || c.get_string("optim.name") != "sgd" ||
                 c.get_float("optim.momentum") > 0)
               return "";
             return "optim.nesterov = true needs optim.momentum > 0; set it (e.g. 0.9)";
           },
           {"optim.name=sgd", "optim.nesterov=true"}},
      }};
}

}  // namespace kiln
