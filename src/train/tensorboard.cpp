// TensorBoard event files (kiln/tensorboard.h): TFRecord framing with masked CRC-32C around
// tensorflow.Event protobufs, encoded by hand (the few fields a scalar needs), and the hook that
// feeds them from the step loop.
//
// Wire format (protobuf): a field's key is (number << 3) | wire type; wire type 0 is a varint,
// 1 a little-endian 64-bit value, 2 a length-delimited byte string, 5 a 32-bit value.
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
// (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto.)
#include "kiln/tensorboard.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>

#include "core/files.h"
#include "core/process.h"
#include "kiln/error.h"
#include "kiln/log.h"
#include "kiln/run.h"

namespace kiln {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;
constexpr uint32_t kMaskDelta = 0xa282ead8u;

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? kCastagnoliReflected ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  return table;
}

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

template <class T>
void put_little_endian(std::string& out, T value) {
  static_assert(std::endian::native == std::endian::little, "kiln writes little-endian hosts");
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_key(std::string& out, uint32_t field, uint32_t wire_type) {
  put_varint(out, (field << 3) | wire_type);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// An Event with wall_time and step; `rest` holds its further fields, already encoded.
std::string event(int64_t step, const std::string& rest) {
  std::string out;
  put_key(out, 1, 1);
  put_little_endian(out, unix_seconds());
  put_key(out, 2, 0);
  put_varint(out, static_cast<uint64_t>(step));
  return out + rest;
}

std::string scalar_summary(const std::string& tag, double value) {
  std::string v;
  put_bytes(v, 1, tag);
  put_key(v, 2, 5);
  put_little_endian(v, static_cast<float>(value));
  std::string summary;
  put_bytes(summary, 1, v);
  std::string field;
  put_bytes(field, 5, summary);
  return field;
}

// The process's peak resident set (VmHWM) in bytes; -1 when /proc does not say.
double peak_resident_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return 1024.0 * std::stod(line.substr(6));  // "... kB"
  }
  return -1;
}

class TensorBoardHook final : public TrainerHook {
 public:
  explicit TensorBoardHook(Run& run) {
    if (run.writer()) writer_ = std::make_unique<TensorBoardWriter>(run.dir());
  }
  void on_step_end(Trainer&, const StepStats& s) override {
    if (!writer_ || !s.synced) return;
    writer_->add_scalar("train/loss", s.step, s.loss);
    writer_->add_scalar("train/lr", s.step, s.lr);
    writer_->add_scalar("train/grad_norm", s.step, s.grad_norm);
    writer_->add_scalar("train/step_seconds", s.step, s.step_seconds);
    if (s.tokens > 0) {
      writer_->add_scalar("train/tokens_per_second", s.step,
                          static_cast<double>(s.tokens) / s.step_seconds);
    } else {
      writer_->add_scalar("train/samples_per_second", s.step,
                          static_cast<double>(s.samples) / s.step_seconds);
    }
    writer_->add_scalar("train/data_wait_share", s.step, s.data_wait_seconds / s.step_seconds);
    if (const double peak = peak_resident_bytes(); peak >= 0) {
      writer_->add_scalar("memory/peak_resident_bytes", s.step, peak);
    }
  }
  void on_eval(Trainer& trainer, const EvalStats& eval) override {
    if (!writer_) return;
    writer_->add_scalar("val/loss", trainer.step(), eval.loss);
    if (eval.accuracy >= 0) writer_->add_scalar("val/accuracy", trainer.step(), eval.accuracy);
  }

 private:
  std::unique_ptr<TensorBoardWriter> writer_;
};

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto& table = crc_table();
  const auto* bytes = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t k = 0; k < size; ++k) crc = table[(crc ^ bytes[k]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string base =
      fmt::format("events.out.tfevents.{}.{}", static_cast<int64_t>(unix_seconds()), hostname());
  path_ = dir / base;
  for (int n = 1; std::filesystem::exists(path_, ec); ++n) {
    path_ = dir / fmt::format("{}.{}", base, n);
  }
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw UserError(
        fmt::format("cannot create the TensorBoard event file {}: {}; check run.dir's "
                    "permissions",
                    path_.string(), errno_text()));
  }
  std::string version;
  put_bytes(version, 3, "brain.Event:2");
  write_record(event(0, version));
  if (failed_) {
    throw UserError(fmt::format("cannot write the TensorBoard event file {}", path_.string()));
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, int64_t step, double value) {
  write_record(event(step, scalar_summary(tag, value)));
}

void TensorBoardWriter::write_record(const std::string& data) {
  if (failed_) return;
  std::string record;
  const uint64_t length = data.size();
  put_little_endian(record, length);
  put_little_endian(record, masked_crc32c(record.data(), sizeof(length)));
  record += data;
  put_little_endian(record, masked_crc32c(data.data(), data.size()));
  ssize_t n = -1;
  do {
    n = ::write(fd_, record.data(), record.size());  // the whole record at once (O_APPEND)
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(record.size())) {
    failed_ = true;
    log::warn(fmt::format("cannot append to {}: {}; training goes on without TensorBoard scalars",
                          path_.string(),
                          n < 0 ? errno_text() : std::string("short write (device full?)")));
  }
}

std::shared_ptr<TrainerHook> make_tensorboard_hook(Run& run) {
  return std::make_shared<TensorBoardHook>(run);
}

}  // namespace kiln
