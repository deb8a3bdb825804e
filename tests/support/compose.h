// Test helper: a Trainer built by hand gets the activation checkpointing its config asks for,
// as kiln/job.h compose_step installs it (the first piece of a composition).
#pragma once

#include "kiln/train.h"

namespace kiln::testing {

inline void install_configured_checkpointing(Trainer& trainer) {
  if (trainer.train_options().activation_checkpointing ==
      TrainOptions::ActivationCheckpointing::kBlock)
    install_activation_checkpointing(trainer);
}

}  // namespace kiln::testing
