// Trace file bytes: gzip compression and reading (.json or .json.gz). Not public API.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>

namespace kiln::profile_detail {

/// zlib's counters are 32-bit: input is fed in chunks of at most this many bytes.
inline constexpr size_t kMaxZlibChunkBytes = size_t{1} << 30;

/// A gzip member (RFC 1952) holding `bytes`, as `gzip -6` would write it. Any size: the input is
/// fed to zlib in chunks of at most `chunk_bytes` (clamped to [1, kMaxZlibChunkBytes]; tests pass
/// small chunks to exercise the chunking).
std::string gzip_compress(std::string_view bytes, size_t chunk_bytes = kMaxZlibChunkBytes);
/// The decompressed content of a gzip member, read in chunks like gzip_compress. Throws
/// UserError naming `source` when corrupt or truncated.
std::string gzip_decompress(std::string_view bytes, const std::filesystem::path& source,
                            size_t chunk_bytes = kMaxZlibChunkBytes);
/// True when `bytes` start with the gzip magic number.
bool is_gzip(std::string_view bytes);

}  // namespace kiln::profile_detail
