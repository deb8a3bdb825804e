// The [compile] section of the config schema and its rules (checked by `kiln config validate` and
// before `kiln train` or `kiln compile` writes anything).
#include <torch/cuda.h>

#include <string>

#include "core/schema_sections.h"
#include "kiln/compile.h"

namespace kiln {

namespace {

// The combinations of compile.backend with the rest of the step (train.precision,
// train.activation_checkpointing, dist.strategy, run.device, optim.fused) that kiln refuses, as
// rules: `kiln config validate` refuses exactly what `kiln train` and `kiln ladder` would. What
// the config cannot decide (dist.strategy = "auto" resolving to fsdp by the model's memory) is
// refused when the run's directories are locked, before anything is written
// (src/rungs/session.cpp).

bool inductor_backend(const Config& c) {
  const std::string& b = c.get_string("compile.backend");
  return b == "inductor" || b == "inductor+cudagraphs";
}

bool captured_backend(const Config& c) {
  const std::string& b = c.get_string("compile.backend");
  return b == "cudagraphs" || b == "inductor+cudagraphs";
}

std::string backend_is(const Config& c) {
  return "compile.backend = \"" + c.get_string("compile.backend") + "\"";
}

std::vector<ConfigRule> compile_rules() {
  return {
      {"compile.probe_seq_lens must be integers separated by commas",
       [](const Config& c) -> std::string {
         try {
           parse_probe_seq_lens(c.get_string("compile.probe_seq_lens"));
         } catch (const std::exception& e) {
           return e.what();
         }
         return "";
       },
       {"compile.probe_seq_lens=8,x"}},
      {"a whole-step AOTInductor graph (compile.granularity = \"step\") cannot recompute a "
       "block's activations: train.activation_checkpointing = \"block\" needs "
       "compile.granularity = \"unit\" (or \"auto\")",
       [](const Config& c) -> std::string {
         if (!inductor_backend(c) || compiles_per_unit(c) ||
             c.get_string("train.activation_checkpointing") == "none")
           return "";
         return "train.activation_checkpointing = \"block\" with " + backend_is(c) +
                " and compile.granularity = \"" + c.get_string("compile.granularity") +
                "\": the whole step is one graph, which cannot recompute a block's activations; "
                "set compile.granularity = \"unit\" (per-unit compilation, with compile.backend "
                "= \"inductor\"), train.activation_checkpointing = \"none\" or "
                "compile.backend = \"eager\"";
       },
       {"compile.backend=inductor", "compile.granularity=step",
        "train.activation_checkpointing=block"}},
      {"FSDP (dist.strategy = \"fsdp\") with a compiled or captured step needs per-unit "
       "compilation: compile.backend = \"inductor\" with compile.granularity = \"unit\" "
       "or \"auto\"",
       [](const Config& c) -> std::string {
         if (c.get_string("compile.backend") == "eager" || c.get_string("dist.strategy") != "fsdp")
           return "";
         if (c.get_string("compile.backend") == "inductor" && compiles_per_unit(c)) return "";
         return "dist.strategy = \"fsdp\" with " + backend_is(c) + " and compile.granularity = \"" +
                c.get_string("compile.granularity") + "\": " + fsdp_with_compile_problem() +
                "; set compile.backend = \"inductor\" with compile.granularity = \"unit\", "
                "dist.strategy = \"ddp\" or compile.backend = \"eager\"";
       },
       {"compile.backend=inductor", "compile.granularity=step", "dist.strategy=fsdp"}},
      {"per-unit compilation (compile.granularity = \"unit\") is AOTInductor's: "
       "compile.backend = \"inductor\" (CUDA graphs capture the whole step)",
       [](const Config& c) -> std::string {
         if (c.get_string("compile.granularity") != "unit" || !captured_backend(c)) return "";
         return "compile.granularity = \"unit\" with " + backend_is(c) +
                ": a CUDA graph captures the whole step, not one unit at a time; set "
                "compile.backend = \"inductor\" or compile.granularity = \"step\"";
       },
       {"compile.backend=cudagraphs", "run.device=cuda", "compile.granularity=unit"}},
      {"per-unit compilation specialises every shape: compile.dynamic = \"auto\" or "
       "\"static\" with compile.granularity = \"unit\"",
       [](const Config& c) -> std::string {
         if (!inductor_backend(c) || !compiles_per_unit(c) ||
             c.get_string("compile.dynamic") != "dynamic")
           return "";
         return "compile.dynamic = \"dynamic\" with per-unit compilation (compile.granularity "
                "= \"" +
                c.get_string("compile.granularity") +
                "\"): unit packages are built for each input shape, without symbolic dimensions; "
                "set compile.dynamic = \"auto\" or \"static\", or compile.granularity = "
                "\"step\" (without activation checkpointing and FSDP)";
       },
       {"compile.backend=inductor", "compile.granularity=unit", "compile.dynamic=dynamic"}},
      {"CUDA graphs (compile.backend = \"cudagraphs\", \"inductor+cudagraphs\") need a CUDA "
       "device: run.device = \"cuda\", or \"auto\" where CUDA is available",
       [](const Config& c) -> std::string {
         if (!captured_backend(c)) return "";
         const std::string& device = c.get_string("run.device");
         if (device == "cuda" || (device == "auto" && torch::cuda::is_available())) return "";
         return backend_is(c) + " captures GPU work and needs a CUDA device (run.device = " +
                "\"cuda\"), but run.device = \"" + device + "\"" +
                (device == "auto" ? " finds none" : "") +
                "; on the CPU use compile.backend = \"inductor\" or \"eager\"";
       },
       {"compile.backend=cudagraphs", "run.device=cpu"}},
      {"CUDA graphs need optim.fused = true (the captured optimizer reads its learning rate on "
       "the device)",
       [](const Config& c) -> std::string {
         if (!captured_backend(c) || c.get_bool("optim.fused")) return "";
         return backend_is(c) +
                " captures the optimizer with a learning rate read on the device, which needs "
                "the fused optimizer; set optim.fused = true";
       },
       {"compile.backend=cudagraphs", "run.device=cuda", "optim.fused=false"}},
      {"CUDA graphs capture the fp32 step only: train.precision = \"fp32\" (mixed precision "
       "under a capture is not verified yet)",
       [](const Config& c) -> std::string {
         if (!captured_backend(c) || c.get_string("train.precision") == "fp32") return "";
         return "train.precision = \"" + c.get_string("train.precision") + "\" with " +
                backend_is(c) +
                ": the captured step is not verified under mixed precision yet (autocast's "
                "weight casts and the fp16 loss scaler inside a CUDA graph); set train.precision "
                "= \"fp32\", or compile.backend = \"inductor\" (mixed precision inside the "
                "AOTInductor graph) or \"eager\"";
       },
       {"compile.backend=cudagraphs", "run.device=cuda", "train.precision=bf16-mixed"}},
      {"CUDA graphs capture the step without activation checkpointing: "
       "train.activation_checkpointing = \"none\" with compile.backend = \"cudagraphs\"",
       [](const Config& c) -> std::string {
         if (c.get_string("compile.backend") != "cudagraphs" ||
             c.get_string("train.activation_checkpointing") == "none")
           return "";
         return "train.activation_checkpointing = \"block\" with " + backend_is(c) +
                ": the recomputation saves and restores the RNG state, which a CUDA graph "
                "capture cannot read (not verified yet); set train.activation_checkpointing = "
                "\"none\" or compile.backend = \"eager\"";
       },
       {"compile.backend=cudagraphs", "run.device=cuda", "train.activation_checkpointing=block"}},
  };
}

}  // namespace

std::string fsdp_with_compile_problem() {
  return "FSDP gathers each unit's parameters around its forward and frees them after, which a "
         "whole-step compiled or captured graph bypasses (per-unit compilation, "
         "compile.granularity "
         "= \"unit\", keeps them)";
}

ConfigSection compile_section() {
  return {
      "compile",
      {
          string_key("compile", "backend", "eager",
                     {"eager", "inductor", "cudagraphs", "inductor+cudagraphs"},
                     "the training step: eager autograd, forward+backward compiled by AOTInductor, "
                     "the whole step captured in a CUDA graph (CUDA only), or both"),
          string_key("compile", "granularity", "auto", {"auto", "step", "unit"},
                     "what one AOTInductor graph covers: the whole step, or each model unit "
                     "(transformer block) as a forward and a backward package inside the unit "
                     "wrappers (the root too: compile.root); auto = unit with activation "
                     "checkpointing or dist.strategy = fsdp, else step"),
          bool_key("compile", "root", true,
                   "per-unit compilation: the root's pieces around the units (gpt, llama: the "
                   "embeddings; final norm, head and loss) compiled as forward and backward "
                   "packages too, evaluation their forwards "
                   "(false: they run eager; models without a split root run them eager)"),
          string_key("compile", "dynamic", "auto", {"auto", "dynamic", "static"},
                     "shapes as torch.compile's dynamic=None|True|False: specialise first and "
                     "make a changed dimension dynamic at the first recompile; symbolic batch "
                     "and sequence dimensions from the start; a graph per shape"),
          bool_key("compile", "fullgraph", true,
                   "graph breaks stop the run with their list (false: the step runs eager and "
                   "the report says so)"),
          int_key("compile", "recompile_limit", 8, 1, 1000,
                  "graphs built for new shapes before further new shapes run eager"),
          int_key("compile", "jobs", 0, 0, 64,
                  "compiler processes that build packages at once (0 = one per core; 1 = one "
                  "at a time): a shape's train and eval graphs, and per unit the root's pieces "
                  "and the units' pairs, build side by side"),
          string_key("compile", "probe_seq_lens", "", {},
                     "the compile rung's shape probe: comma-separated sequence lengths ('' = "
                     "data.seq_len/2 and data.seq_len/4; 'none' = no probe)"),
          float_key("compile", "tolerance", 0.0, 0.0, 1.0,
                    "gate: max relative difference of compiled and eager losses and parameters "
                    "(0 = the precision's default: fp32 1e-4, bf16-mixed 2e-2, fp16-mixed 5e-3; "
                    "docs/compile.md)"),
          float_key("compile", "min_speedup", 1.05, 0.0, kUnbounded,
                    "the rung says 'keep the compiled step' at this steady-state speedup or more"),
          int_key("compile", "warmup_steps", 3, 0, 1e6,
                  "the rung's untimed steps on each side before timing"),
          int_key("compile", "steps", 10, 2, 1e6,
                  "the rung's timed steps on each side (interleaved eager/compiled)"),
          string_key("compile", "cache_dir", "", {},
                     "packages built by kiln ('' = $XDG_CACHE_HOME/kiln/compile or "
                     "~/.cache/kiln/compile)"),
          string_key("compile", "python", "", {},
                     "the Python whose torch compiles ('' = $KILN_PYTHON, else the one kiln was "
                     "built with); its torch must match kiln's LibTorch"),
      },
      compile_rules()};
}

}  // namespace kiln
