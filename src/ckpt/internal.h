// Helpers shared by the checkpoint sources (not public API).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/checkpoint.h"
#include "kiln/dist.h"

namespace kiln::ckpt {

inline constexpr const char* kIndexFile = "index.json";
inline constexpr const char* kLatestFile = "latest";
inline constexpr const char* kFormatName = "kiln-checkpoint";

/// "step-<N>" and "step-<N>.tmp".
std::string step_dir_name(int64_t step);
std::string tmp_dir_name(int64_t step);
/// "rank-<r>.safetensors".
std::string rank_file_name(int rank);

/// Collective: every rank passes its error ("" when fine). When any rank has one, every rank
/// throws UserError with the lowest failing rank's message (prefixed "rank r: " when world > 1).
void agree(Communicator& comm, const std::string& local_error);

/// Serialises an index object with its own checksum field "index_xxh3" (xxh3 of the rest).
std::string index_text_with_checksum(nlohmann::json index);

/// Product of a shape's dimensions.
uint64_t element_count(const std::vector<int64_t>& shape);

/// Reads the whole tensors of a checkpoint whose names start with `prefix`, reassembled from their
/// chunks, in name order. Verifies checksums first when `verify`. Single-process.
std::vector<std::pair<std::string, torch::Tensor>> read_whole_tensors(
    const std::filesystem::path& step_dir, const std::string& prefix, bool verify);

}  // namespace kiln::ckpt
