// The [compile] section of the config schema and its rules (checked by `kiln config validate` and
// before `kiln train` or `kiln compile` writes anything).
#include <string>

#include "core/schema_sections.h"
#include "kiln/compile.h"

namespace kiln {

ConfigSection compile_section() {
  return {
      "compile",
      {
          string_key("compile", "backend", "eager",
                     {"eager", "inductor", "cudagraphs", "inductor+cudagraphs"},
                     "the training step: eager autograd, forward+backward compiled by AOTInductor, "
                     "the whole step captured in a CUDA graph (CUDA only), or both"),
          string_key("compile", "dynamic", "auto", {"auto", "dynamic", "static"},
                     "shapes as torch.compile's dynamic=None|True|False: specialise first and "
                     "make a changed dimension dynamic at the first recompile; symbolic batch "
                     "and sequence dimensions from the start; a graph per shape"),
          bool_key("compile", "fullgraph", true,
                   "graph breaks stop the run with their list (false: the step runs eager and "
                   "the report says so)"),
          int_key("compile", "recompile_limit", 8, 1, 1000,
                  "graphs built for new shapes before further new shapes run eager"),
          string_key("compile", "probe_seq_lens", "", {},
                     "the compile rung's shape probe: comma-separated sequence lengths ('' = "
                     "data.seq_len/2 and data.seq_len/4; 'none' = no probe)"),
          float_key("compile", "tolerance", 1e-4, 0.0, 1.0,
                    "gate: max relative difference of compiled and eager losses and parameters"),
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
      {
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
      }};
}

}  // namespace kiln
