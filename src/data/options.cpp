// The [data] keys the built-in datasets read: the only place in src/data/ outside the schema
// that reads a Config by key.
#include "kiln/config.h"
#include "kiln/data.h"

namespace kiln {

DataSource DataSource::from_config(const Config& config) {
  return {.name = config.get_string("data.name"),
          .path = config.get_string("data.path"),
          .val_path = config.get_string("data.val_path"),
          .format = config.get_string("data.format"),
          .seq_len = config.get_int("data.seq_len"),
          .val_fraction = config.get_float("data.val_fraction"),
          .num_samples = config.get_int("data.num_samples"),
          .val_samples = config.get_int("data.val_samples"),
          .teacher_hidden = config.get_int("data.teacher_hidden"),
          .input_dim = config.get_int("model.input_dim"),
          .num_classes = config.get_int("model.num_classes"),
          .seed = data_seed(config)};
}

}  // namespace kiln
