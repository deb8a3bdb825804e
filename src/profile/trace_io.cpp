#include "profile/trace_io.h"

#include <fmt/format.h>
#include <zlib.h>

#include "core/files.h"
#include "kiln/error.h"
#include "kiln/profile.h"

namespace kiln {
namespace profile_detail {

bool is_gzip(std::string_view bytes) {
  return bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x1f &&
         static_cast<unsigned char>(bytes[1]) == 0x8b;
}

std::string gzip_compress(std::string_view bytes) {
  z_stream stream{};
  // windowBits 15 + 16: a gzip header and trailer instead of zlib's.
  if (deflateInit2(&stream, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw TrainingError("zlib: deflateInit2 failed");
  }
  std::string out(deflateBound(&stream, static_cast<uLong>(bytes.size())), '\0');
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  stream.avail_in = static_cast<uInt>(bytes.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  const int status = deflate(&stream, Z_FINISH);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  if (status != Z_STREAM_END) throw TrainingError("zlib: deflate did not finish");
  return out;
}

std::string gzip_decompress(std::string_view bytes, const std::filesystem::path& source) {
  z_stream stream{};
  if (inflateInit2(&stream, 15 + 16) != Z_OK) throw TrainingError("zlib: inflateInit2 failed");
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  stream.avail_in = static_cast<uInt>(bytes.size());
  std::string out;
  char buffer[1 << 16];
  int status = Z_OK;
  while (status != Z_STREAM_END) {
    stream.next_out = reinterpret_cast<Bytef*>(buffer);
    stream.avail_out = sizeof(buffer);
    status = inflate(&stream, Z_NO_FLUSH);
    if (status != Z_OK && status != Z_STREAM_END) {
      inflateEnd(&stream);
      throw UserError(fmt::format("{}: not a valid gzip file ({}); was it truncated?",
                                  source.string(), stream.msg ? stream.msg : "corrupt data"));
    }
    out.append(buffer, sizeof(buffer) - stream.avail_out);
    if (status == Z_OK && stream.avail_in == 0 && stream.avail_out != 0) {
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
