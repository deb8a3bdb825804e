// What DDP and FSDP share (not public API): making every rank start from rank 0's weights.
#pragma once

#include <string>

#include "kiln/comm.h"
#include "kiln/models.h"

namespace kiln::dist {

/// Broadcasts rank 0's parameters and buffers to every rank (one broadcast per dtype and
/// device), then all-gathers weights_hash(model) and returns it. Throws CommunicationError naming
/// the ranks whose weights differ afterwards. A world of one only hashes.
std::string replicate_rank0(Communicator& comm, Model& model);

}  // namespace kiln::dist
