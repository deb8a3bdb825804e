// Seeing a run: TensorBoard scalar event files written during training, and report.html, one
// self-contained page of charts and tables regenerated from a run directory's files
// (docs/report.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

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

// ---- report.html -------------------------------------------------------------------------------

struct ReportHtml {
  std::string html;                  // the whole page
  bool chart_library = false;        // Chart.js inlined (else the charts are plain SVG)
  std::string chart_library_source;  // the file it was read from, or why there is none
  std::vector<std::string> charts;   // the id of every chart, in page order
  // The run files that were absent ("plan.json") or unreadable ("pilot.json (unreadable)"), and
  // parts a section needed and did not find ("pilot.json without restore", "manifest.json pins").
  std::vector<std::string> missing;
};

/// The report of a run directory, from whatever of its files exist: manifest.json, config.toml,
/// metrics.jsonl and metrics-<rung>.jsonl, and each rung's file read through its typed result
/// (kiln/results.h). The first screen is the ladder's scorecard (one row per rung: status, the
/// numbers that matter, the decision and its config key, a link to its section) and the run's
/// identity; then the training curves and one section per rung, its key/value dump folded.
/// Missing files are listed in one line of the page (and in `missing`); a rung file the typed
/// reader refuses (a missing or renamed key, a newer schema) is listed as "<file> (unreadable)"
/// and its section and scorecard row carry the reader's one line (file, key, schema version, how
/// to regenerate), never an error; a metrics line that is not a step record is skipped. Charts
/// use Chart.js inlined from `chart_library` (the build's KILN_CHARTJS, Debian's libjs-chart.js,
/// when empty); when that file is absent the charts are plain SVG and the page says so. Each
/// chart's numbers sit beside it as a table. Nothing is fetched at view time. Throws UserError
/// only when `run_dir` is not a directory.
ReportHtml make_report_html(const std::filesystem::path& run_dir,
                            const std::filesystem::path& chart_library = {});

/// make_report_html, written atomically to <run_dir>/report.html; returns what it wrote. Throws
/// UserError (not a directory, cannot write).
ReportHtml write_report_html(const std::filesystem::path& run_dir,
                             const std::filesystem::path& chart_library = {});

/// Two runs side by side: the loss and throughput curves of both on shared axes, each rung's
/// numbers in run A and run B with their difference (B - A), and the config.toml keys whose
/// values differ. Throws UserError when either is not a directory.
ReportHtml make_comparison_html(const std::filesystem::path& run_a,
                                const std::filesystem::path& run_b,
                                const std::filesystem::path& chart_library = {});

/// make_comparison_html, written atomically to <out_dir>/report.html (out_dir created). Throws
/// UserError (not a directory, cannot write).
ReportHtml write_comparison_html(const std::filesystem::path& run_a,
                                 const std::filesystem::path& run_b,
                                 const std::filesystem::path& out_dir,
                                 const std::filesystem::path& chart_library = {});

/// The Chart.js file the build found (empty when it found none).
std::filesystem::path default_chart_library();

}  // namespace kiln
