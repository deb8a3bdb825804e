#include "profile/trace_io.h"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <vector>

#include "core/files.h"
#include "kiln/error.h"
#include "kiln/profile.h"

namespace kiln {
namespace profile_detail {

bool is_gzip(std::string_view bytes) {
  return bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x1f &&
         static_cast<unsigned char>(bytes[1]) == 0x8b;
}

namespace {

// Hands zlib the next chunk of `bytes` (at most chunk_bytes) once it has used up the last one.
void feed_next_chunk(z_stream& stream, std::string_view bytes, size_t& offset, size_t chunk_bytes) {
  if (stream.avail_in != 0 || offset >= bytes.size()) return;
  const size_t n = std::min(chunk_bytes, bytes.size() - offset);
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data() + offset));
  stream.avail_in = static_cast<uInt>(n);
  offset += n;
}

}  // namespace

std::string gzip_compress(std::string_view bytes, size_t chunk_bytes) {
  // zlib counts in uInt (32 bits): the input goes in chunks of at most chunk_bytes, the output
  // comes out through a fixed buffer, so traces over 4 GiB are compressed whole.
  chunk_bytes = std::clamp<size_t>(chunk_bytes, 1, kMaxZlibChunkBytes);
  z_stream stream{};
  // windowBits 15 + 16: a gzip header and trailer instead of zlib's.
  if (deflateInit2(&stream, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw TrainingError("zlib: deflateInit2 failed");
  }
  std::string out;
  std::vector<char> buffer(1 << 20);
  size_t offset = 0;
  int status = Z_OK;
  while (status != Z_STREAM_END) {
    feed_next_chunk(stream, bytes, offset, chunk_bytes);
    stream.next_out = reinterpret_cast<Bytef*>(buffer.data());
    stream.avail_out = static_cast<uInt>(buffer.size());
    status = deflate(&stream, offset == bytes.size() ? Z_FINISH : Z_NO_FLUSH);
    if (status != Z_OK && status != Z_STREAM_END && status != Z_BUF_ERROR) {
      deflateEnd(&stream);
      throw TrainingError(fmt::format("zlib: deflate failed (status {})", status));
    }
    out.append(buffer.data(), buffer.size() - stream.avail_out);
  }
  deflateEnd(&stream);
  return out;
}

std::string gzip_decompress(std::string_view bytes, const std::filesystem::path& source,
                            size_t chunk_bytes) {
  chunk_bytes = std::clamp<size_t>(chunk_bytes, 1, kMaxZlibChunkBytes);
  z_stream stream{};
  if (inflateInit2(&stream, 15 + 16) != Z_OK) throw TrainingError("zlib: inflateInit2 failed");
  std::string out;
  std::vector<char> buffer(1 << 20);
  size_t offset = 0;
  int status = Z_OK;
  while (status != Z_STREAM_END) {
    feed_next_chunk(stream, bytes, offset, chunk_bytes);
    stream.next_out = reinterpret_cast<Bytef*>(buffer.data());
    stream.avail_out = static_cast<uInt>(buffer.size());
    status = inflate(&stream, Z_NO_FLUSH);
    out.append(buffer.data(), buffer.size() - stream.avail_out);
    if (status == Z_STREAM_END) break;
    if (status != Z_OK && status != Z_BUF_ERROR) {  // Z_BUF_ERROR: no progress, handled below
      const std::string message = stream.msg ? stream.msg : "corrupt data";
      inflateEnd(&stream);
      throw UserError(fmt::format("{}: not a valid gzip file ({}); was it truncated?",
                                  source.string(), message));
    }
    // Every byte consumed, room left for output, and still no end of stream: truncated.
    if (stream.avail_in == 0 && offset == bytes.size() && stream.avail_out != 0) {
      inflateEnd(&stream);
      throw UserError(
          fmt::format("{}: gzip data ends early; the file is truncated", source.string()));
    }
  }
  inflateEnd(&stream);
  return out;
}

}  // namespace profile_detail

nlohmann::json read_trace(const std::filesystem::path& path) {
  std::string bytes = read_file(path);
  if (profile_detail::is_gzip(bytes)) bytes = profile_detail::gzip_decompress(bytes, path);
  nlohmann::json trace = nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (trace.is_discarded()) {
    throw UserError(fmt::format("{}: not valid JSON; expected a Chrome trace (.pt.trace.json[.gz])",
                                path.string()));
  }
  return trace;
}

}  // namespace kiln
