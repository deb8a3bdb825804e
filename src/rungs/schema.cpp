// The rungs' own config sections ([baseline]) and config_sections(): every component's section in
// display order. This is the top layer, so it may name every component; core only declares
// config_sections() (kiln/config.h).
#include "core/schema_sections.h"
#include "kiln/config.h"

namespace kiln {

ConfigSection baseline_section() {
  return {"baseline",
          {
              int_key("baseline", "warmup_steps", 5, 0, 1e9,
                      "steps run before timing starts (excluded from the figures)"),
              int_key("baseline", "steps", 30, 2, 1e9, "measured steps"),
              float_key("baseline", "min_loss_drop", 0.02, 0.0, 1.0,
                        "gate: the loss must fall by at least this share from the first to the "
                        "last steps"),
              float_key("baseline", "peak_flops_per_second", 0.0, 0.0, kUnbounded,
                        "device peak rate for MFU (0 = unknown: MFU not reported)"),
          },
          {}};
}

const ConfigSections& config_sections() {
  static const ConfigSections sections = {
      run_section(),   model_section(),      data_section(),    train_section(),
      optim_section(), baseline_section(),   compile_section(), profile_section(),
      dist_section(),  checkpoint_section(), pilot_section(),   plan_section(),
  };
  return sections;
}

}  // namespace kiln
