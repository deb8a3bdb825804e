// Trace file bytes: gzip compression and reading (.json or .json.gz). Not public API.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace kiln::profile_detail {

/// A gzip member (RFC 1952) holding `bytes`, as `gzip -6` would write it.
std::string gzip_compress(std::string_view bytes);
/// The decompressed content of a gzip member. Throws UserError naming `source` when corrupt.
std::string gzip_decompress(std::string_view bytes, const std::filesystem::path& source);
/// True when `bytes` start with the gzip magic number.
bool is_gzip(std::string_view bytes);

}  // namespace kiln::profile_detail
