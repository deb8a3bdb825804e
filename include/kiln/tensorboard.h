// TensorBoard scalar event files written during training, beside metrics.jsonl: the writer and
// the TrainerHook that feeds it (docs/report.md, "TensorBoard").
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "kiln/train.h"

namespace kiln {

class Run;

// ---- TensorBoard -------------------------------------------------------------------------------

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `size` bytes, continuing from `crc`
/// (0 to start). crc32c("123456789") == 0xE3069283. Pure; any thread.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
/// TFRecord's masked CRC: rotate crc32c right by 15 bits and add 0xa282ead8. Pure.
uint32_t masked_crc32c(const void* data, size_t size);

/// Writes TensorBoard scalars to <dir>/events.out.tfevents.<unix seconds>.<host> (".<n>" added
/// when that name exists): TFRecord framing (uint64 length, masked CRC-32C of the length, the
/// record, masked CRC-32C of the record; little-endian) around tensorflow.Event protobufs
/// encoded by hand (wall_time, step, file_version "brain.Event:2" first, then one Summary.Value
/// {tag, simple_value} per scalar). Each record is one write(2) with O_APPEND, so a reader sees
/// whole records and a kill loses at most the last one. One thread at a time.
class TensorBoardWriter {
 public:
  /// Creates the directory and the file with its version record. Throws UserError naming the
  /// path when either cannot be written.
  explicit TensorBoardWriter(const std::filesystem::path& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// Appends one scalar event at wall time now. The value is stored as float32 (simple_value).
  /// A failed write is logged once and later ones are dropped: training goes on.
  void add_scalar(const std::string& tag, int64_t step, double value);
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::filesystem::path path_;
  int fd_ = -1;
  bool failed_ = false;
};

/// The TensorBoard sink as a TrainerHook, beside MetricsHook: a writer in the run directory
/// (only when run.writer(), i.e. rank 0; elsewhere the hook does nothing). On each synced step:
/// train/loss, train/lr, train/grad_norm, train/step_seconds, train/tokens_per_second (or
/// train/samples_per_second), train/data_wait_share, memory/peak_resident_bytes (the process's
/// VmHWM); on each evaluation: val/loss (and val/accuracy). Steps are the Trainer's step numbers.
/// Throws UserError when the event file cannot be created.
std::shared_ptr<TrainerHook> make_tensorboard_hook(Run& run);

}  // namespace kiln
