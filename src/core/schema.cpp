// The config schema: every key kiln knows. This file declares the core sections ([run], [model],
// [data], [train], [optim], [baseline]); each rung declares its own section in its own folder
// (core/schema_sections.h). A key declared here is parsed, validated, shown by
// `kiln config show` and listed in docs/config.md.
#include "core/schema_sections.h"
#include "kiln/config.h"

namespace kiln {

KeyDef bool_key(std::string section, std::string name, bool def, std::string doc) {
  return {std::move(section), std::move(name), ValueType::kBool, def, {}, {}, {}, std::move(doc)};
}
KeyDef int_key(std::string section, std::string name, int64_t def, double lo, double hi,
               std::string doc) {
  return {std::move(section), std::move(name), ValueType::kInt, def, lo, hi, {}, std::move(doc)};
}
KeyDef float_key(std::string section, std::string name, double def, double lo, double hi,
                 std::string doc) {
  return {std::move(section), std::move(name), ValueType::kFloat, def, lo, hi, {}, std::move(doc)};
}
KeyDef string_key(std::string section, std::string name, std::string def,
                  std::vector<std::string> choices, std::string doc) {
  return {std::move(section), std::move(name), ValueType::kString, std::move(def), {}, {},
          std::move(choices), std::move(doc)};
}

namespace {

std::vector<KeyDef> core_keys() {
  return {
      // [run] ---------------------------------------------------------------------------------
      string_key("run", "name", "", {},
                 "run name; outputs go to <run.dir>/<run.name> (default: config file stem)"),
      string_key("run", "dir", "runs", {}, "parent directory of run directories"),
      int_key("run", "seed", 1337, 0, 9.2e18, "seed for model initialisation and every other RNG"),
      bool_key("run", "deterministic", true,
               "deterministic algorithms; on CPU equal configs give bitwise-equal losses"),
      int_key("run", "threads", 0, 0, 1024, "intra-op CPU threads (0 = LibTorch's default)"),
      string_key("run", "device", "auto", {"auto", "cpu", "cuda"},
                 "device to train on; auto = cuda when available"),
      int_key("run", "log_every", 10, 1, 1e9,
              "steps between log lines when stderr is not a terminal"),
      string_key("run", "progress", "auto", {"auto", "bar", "log", "off"},
                 "progress display: bar on a terminal, log lines otherwise"),
      // [model] -------------------------------------------------------------------------------
      string_key("model", "name", "mlp", {"mlp", "gpt"}, "model architecture"),
      int_key("model", "input_dim", 100, 1, 1e7, "mlp: input features"),
      int_key("model", "hidden_dim", 256, 1, 1e7, "mlp: hidden units"),
      int_key("model", "num_classes", 10, 2, 1e7, "mlp: output classes"),
      string_key("model", "preset", "tiny", {"tiny", "small", "gpt2-124m"},
                 "gpt: size preset (tiny ~1M, small ~10M, gpt2-124m)"),
      int_key("model", "n_layer", 0, 0, 1000, "gpt: transformer blocks (0 = preset)"),
      int_key("model", "n_head", 0, 0, 1000, "gpt: attention heads (0 = preset)"),
      int_key("model", "n_embd", 0, 0, 1e6, "gpt: embedding width (0 = preset)"),
      int_key("model", "block_size", 0, 0, 1e7, "gpt: maximum sequence length (0 = preset)"),
      int_key("model", "vocab_size", 0, 0, 1e7,
              "gpt: vocabulary size (0 = preset; byte text needs >= 256)"),
      float_key("model", "init_std", 0.02, 0.0, 10.0,
                "gpt: std of the normal init (residual projections scaled by 1/sqrt(2*n_layer))"),
      // [data] --------------------------------------------------------------------------------
      string_key("data", "name", "synthetic", {"synthetic", "text", "tokens"},
                 "dataset: synthetic teacher task, text file bytes, or token .bin files"),
      string_key(
          "data", "path", "", {},
          "text: a file or directory (default: Debian's fortunes corpus); tokens: the train .bin"),
      string_key("data", "val_path", "", {},
                 "tokens: validation .bin (default: split data.path by data.val_fraction)"),
      string_key("data", "format", "auto", {"auto", "nanogpt", "llmc"},
                 "tokens: file format (auto = llm.c when its magic is present)"),
      float_key("data", "val_fraction", 0.1, 0.0, 0.9,
                "share of the data held out for validation (the tail of the file)"),
      int_key("data", "seq_len", 64, 1, 1e7, "text/tokens: tokens per sample"),
      int_key("data", "num_samples", 8192, 1, 1e9, "synthetic: training samples"),
      int_key("data", "val_samples", 1024, 1, 1e9, "synthetic: validation samples"),
      int_key("data", "teacher_hidden", 4, 1, 1e6,
              "synthetic: hidden units of the random teacher network"),
      int_key("data", "seed", 0, 0, 9.2e18,
              "seed for data generation and shuffling (0 = run.seed)"),
      bool_key("data", "shuffle", true,
               "reshuffle the training samples every epoch (by data seed and epoch)"),
      int_key("data", "num_workers", 2, 0, 256,
              "background loader threads (0 = load in the training thread)"),
      int_key("data", "prefetch", 4, 1, 1024,
              "batches the loader may prepare ahead of the training step"),
      // [train] -------------------------------------------------------------------------------
      int_key("train", "steps", 1000, 1, 1e12, "optimizer steps"),
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
      // [optim] -------------------------------------------------------------------------------
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
      // [baseline] ----------------------------------------------------------------------------
      int_key("baseline", "warmup_steps", 5, 0, 1e9,
              "steps run before timing starts (excluded from the figures)"),
      int_key("baseline", "steps", 30, 2, 1e9, "measured steps"),
      float_key("baseline", "min_loss_drop", 0.02, 0.0, 1.0,
                "gate: the loss must fall by at least this share from the first to the last steps"),
      float_key("baseline", "peak_flops_per_second", 0.0, 0.0, kUnbounded,
                "device peak rate for MFU (0 = unknown: MFU not reported)"),
  };
}

std::vector<KeyDef> build_schema() {
  std::vector<KeyDef> keys = core_keys();
  for (auto* section : {&profile_keys, &dist_keys, &checkpoint_keys}) {
    for (auto& key : (*section)()) keys.push_back(std::move(key));
  }
  return keys;
}

}  // namespace

const std::vector<KeyDef>& schema() {
  static const std::vector<KeyDef> keys = build_schema();
  return keys;
}

}  // namespace kiln
