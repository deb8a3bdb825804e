#include "kiln/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "core/files.h"
#include "kiln/error.h"

namespace kiln {
namespace {

// Headers beyond this are rejected outright (the reference implementation uses 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DtypeName {
  torch::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {torch::kFloat64, "F64"},   {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"},
    {torch::kBFloat16, "BF16"}, {torch::kInt64, "I64"},   {torch::kInt32, "I32"},
    {torch::kInt16, "I16"},     {torch::kInt8, "I8"},     {torch::kUInt8, "U8"},
    {torch::kBool, "BOOL"},     {torch::kUInt16, "U16"},  {torch::kUInt32, "U32"},
    {torch::kUInt64, "U64"},
};

void read_exact(int fd, void* out, size_t bytes, uint64_t offset, const std::string& source) {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw UserError(source + ": unexpected end of file or read error: " + errno_text());
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

}  // namespace

std::string safetensors_dtype(torch::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  throw UserError(std::string("dtype ") + c10::toString(dtype) +
                  " cannot be stored in safetensors");
}

torch::ScalarType safetensors_dtype_from_name(std::string_view name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  throw UserError("unknown safetensors dtype \"" + std::string(name) + "\"");
}

SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                           const std::string& source) {
  if (prefix.size() < 8 || file_size < 8) {
    throw UserError(source + ": not a safetensors file (shorter than its 8-byte header length)");
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, prefix.data(), 8);  // little-endian hosts only (x86-64, aarch64)
  if (header_len > kMaxHeaderBytes || header_len > file_size - 8) {
    throw UserError(source + ": header length " + std::to_string(header_len) +
                    " exceeds the file (" + std::to_string(file_size) +
                    " bytes); truncated or corrupt");
  }
  if (prefix.size() < 8 + header_len) {
    throw UserError(source + ": header incomplete");
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(prefix.substr(8, header_len));
  } catch (const nlohmann::json::exception& e) {
    throw UserError(source + ": header is not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!header.is_object()) throw UserError(source + ": header is not a JSON object");
  SafetensorsHeader out;
  out.data_start = 8 + header_len;
  const uint64_t data_size = file_size - out.data_start;
  for (auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw UserError(source + ": __metadata__ is not an object");
      for (auto& [k, v] : value.items()) {
        if (!v.is_string()) throw UserError(source + ": __metadata__." + k + " is not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = source + ": tensor '" + name + "'";
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets")) {
      throw UserError(where + " needs dtype, shape and data_offsets");
    }
    SafetensorsEntry entry;
    entry.name = name;
    const auto& dtype = value["dtype"];
    if (!dtype.is_string()) throw UserError(where + ": dtype is not a string");
    auto match = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeName& d) {
      return dtype.get<std::string>() == d.name;
    });
    if (match == std::end(kDtypes)) {
      throw UserError(where + ": unknown dtype " + dtype.dump());
    }
    entry.dtype = match->dtype;
    const auto& shape = value["shape"];
    if (!shape.is_array()) throw UserError(where + ": shape is not an array");
    uint64_t numel = 1;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned())
        throw UserError(where + ": shape has a non-integer or negative dimension");
      uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > (uint64_t{1} << 62) / dim)
        throw UserError(where + ": shape too large");
      numel *= dim;
      entry.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      throw UserError(where + ": data_offsets must be two non-negative integers");
    }
    entry.begin = offsets[0].get<uint64_t>();
    entry.end = offsets[1].get<uint64_t>();
    if (entry.begin > entry.end || entry.end > data_size) {
      throw UserError(where + ": data_offsets [" + std::to_string(entry.begin) + ", " +
                      std::to_string(entry.end) + "] fall outside the data (" +
                      std::to_string(data_size) + " bytes)");
    }
    uint64_t expected = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(entry.dtype)),
                               &expected)) {
      throw UserError(where + ": shape too large (its byte size overflows 64 bits)");
    }
    if (entry.end - entry.begin != expected) {
      throw UserError(where + ": shape and dtype need " + std::to_string(expected) +
                      " bytes but data_offsets span " + std::to_string(entry.end - entry.begin));
    }
    out.tensors.push_back(std::move(entry));
  }
  std::sort(out.tensors.begin(), out.tensors.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t cursor = 0;
  for (const auto& entry : out.tensors) {
    if (entry.begin < cursor)
      throw UserError(source + ": tensor '" + entry.name + "' overlaps another");
    if (entry.begin > cursor)
      throw UserError(source + ": gap in the data before tensor '" + entry.name + "'");
    cursor = entry.end;
  }
  if (cursor != data_size) {
    throw UserError(source + ": " + std::to_string(data_size - cursor) +
                    " bytes after the last tensor are not described by the header");
  }
  return out;
}

SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw UserError("cannot open " + path.string() + ": " + errno_text());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    throw UserError("cannot stat " + path.string() + ": " + errno_text());
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  std::string prefix(8, '\0');
  if (size < 8) return parse_safetensors_header({}, size, path.string());
  read_exact(fd.get(), prefix.data(), 8, 0, path.string());
  uint64_t header_len = 0;
  std::memcpy(&header_len, prefix.data(), 8);
  if (header_len <= kMaxHeaderBytes && header_len <= size - 8) {
    prefix.resize(8 + header_len);
    read_exact(fd.get(), prefix.data() + 8, header_len, 8, path.string());
  }
  return parse_safetensors_header(prefix, size, path.string());
}

SafetensorsWriteResult write_safetensors(
    const std::filesystem::path& path,
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> cpu;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (!names.insert(name).second)
      throw UserError("duplicate tensor name '" + name + "' for " + path.string());
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    header[name] = {{"dtype", safetensors_dtype(t.scalar_type())},
                    {"shape", shape},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
    cpu.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');  // align the data region to 8 bytes
  uint64_t header_len = text.size();
  std::string prefix(8, '\0');
  std::memcpy(prefix.data(), &header_len, 8);
  prefix += text;

  AtomicFile file(path);
  SafetensorsWriteResult result;
  result.data_start = prefix.size();
  file.write(prefix);
  uint64_t cursor = result.data_start;
  for (const auto& t : cpu) {
    result.tensor_byte_ranges.emplace_back(cursor, cursor + t.nbytes());
    cursor += t.nbytes();
    if (t.nbytes() > 0) file.write(t.data_ptr(), t.nbytes());
  }
  file.commit();
  result.size_bytes = prefix.size() + offset;
  result.xxh3 = file.xxh3();
  return result;
}

std::vector<std::pair<std::string, torch::Tensor>> read_safetensors(
    const std::filesystem::path& path) {
  SafetensorsReader reader(path);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& entry : reader.header().tensors) {
    auto t = torch::empty(entry.shape, torch::TensorOptions().dtype(entry.dtype));
    reader.read(entry, 0, entry.end - entry.begin, t.data_ptr());
    out.emplace_back(entry.name, std::move(t));
  }
  return out;
}

SafetensorsReader::SafetensorsReader(const std::filesystem::path& path) : path_(path) {
  // The header is read through its own descriptor; then the file is opened for the data and its
  // size checked again, so a file replaced in between is caught.
  header_ = read_safetensors_header(path);
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) throw UserError("cannot open " + path.string() + ": " + errno_text());
  fd_ = std::make_unique<FileDescriptor>(std::move(fd));  // closed however the constructor ends
  struct stat st {};
  if (::fstat(fd_->get(), &st) != 0) {
    throw UserError("cannot stat " + path.string() + ": " + errno_text());
  }
  size_bytes_ = static_cast<uint64_t>(st.st_size);
  const uint64_t described =
      header_.data_start + (header_.tensors.empty() ? 0 : header_.tensors.back().end);
  if (size_bytes_ != described) {
    throw UserError(path.string() + ": file is " + std::to_string(size_bytes_) +
                    " bytes but its header describes " + std::to_string(described) +
                    "; it changed while being opened");
  }
}

SafetensorsReader::~SafetensorsReader() = default;

const SafetensorsEntry* SafetensorsReader::find(std::string_view name) const {
  for (const auto& entry : header_.tensors) {
    if (entry.name == name) return &entry;
  }
  return nullptr;
}

void SafetensorsReader::read(const SafetensorsEntry& entry, uint64_t offset, uint64_t bytes,
                             void* out) const {
  const uint64_t size = entry.end - entry.begin;
  if (offset > size || bytes > size - offset) {
    throw UserError(path_.string() + ": read of " + std::to_string(bytes) + " bytes at offset " +
                    std::to_string(offset) + " falls outside tensor '" + entry.name + "' (" +
                    std::to_string(size) + " bytes)");
  }
  read_exact(fd_->get(), out, bytes, header_.data_start + entry.begin + offset, path_.string());
}

void SafetensorsReader::read_raw(uint64_t offset, uint64_t bytes, void* out) const {
  if (offset > size_bytes_ || bytes > size_bytes_ - offset) {
    throw UserError(path_.string() + ": read of " + std::to_string(bytes) + " bytes at offset " +
                    std::to_string(offset) + " is past the end of the file (" +
                    std::to_string(size_bytes_) + " bytes)");
  }
  read_exact(fd_->get(), out, bytes, offset, path_.string());
}

}  // namespace kiln
