// One history per run directory (not public API): what a fresh run does with another run's
// records in its directory (RunOptions::existing_records).
#pragma once

#include <filesystem>
#include <string>

#include "kiln/run.h"

namespace kiln {

/// For a run that does not append to `dir`'s records: with kRefuse, throws UserError when `dir`
/// holds another run's records (a non-empty `metrics_file` or train.log, a TensorBoard event file),
/// naming them and the fixes (--resume auto, --overwrite, run.name); with kMoveAside, moves every
/// file at the top of `dir` (records, config.toml, manifest.json, rung results, reports; never the
/// lock file or a directory such as checkpoints/) into a new <dir>/previous-<UTC time>/ and
/// returns that path (empty when there was nothing to move); kReplace does nothing. Writes nothing
/// else. The caller holds the directory's lock.
std::filesystem::path prepare_run_records(const std::filesystem::path& dir,
                                          const std::string& metrics_file,
                                          RunOptions::Existing existing);

}  // namespace kiln
