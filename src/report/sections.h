// report.html's sections (private to src/report): the ladder's scorecard and the run's identity
// (the first screen), the training curves, then one section per rung, each from its typed result.
#pragma once

#include <string>
#include <vector>

#include "report/page.h"
#include "report/run_data.h"

namespace kiln::report {

/// One rung's line on the scorecard.
struct ScoreRow {
  std::string rung;
  std::string status;           // "passed", "FAILED", "unreadable", "not run"
  std::string status_class;     // "passed", "failed", "unreadable", "absent"
  std::vector<Figure> figures;  // the numbers that matter
  std::string decision;         // what to do, in one line
  std::string key;              // the config key that carries the decision out ("" when none)
  std::string link;             // the section's id ("" when the rung has no section)
};

/// The seven rungs' rows, in ladder order, and the next step for the whole run.
std::vector<ScoreRow> score_rows(const RunData& run);
std::string next_step(const RunData& run, const std::vector<ScoreRow>& rows);
Data scorecard_data(const RunData& run);
Data identity_data(const RunData& run);

/// The first config key a sentence names ("optim.lr", `compile.backend = "inductor"`), or "".
std::string config_key_in(const std::string& text);

// Sections: each adds itself to `sections` when its file is present (an unreadable file gets
// its section with the one-line error).
struct SectionSink {
  bool chartjs = false;
  std::vector<std::string>* chart_ids = nullptr;
  std::vector<Section>* sections = nullptr;
  Section& add(const std::string& id, const std::string& heading) {
    sections->emplace_back(id, heading, chartjs, chart_ids);
    return sections->back();
  }
};

/// The section of a rung file: null when the file is absent; for an unreadable file or a rung
/// that stopped before measuring, a section saying so (null returned: nothing more to show).
template <class T>
Section* rung_section(const Loaded<T>& loaded, SectionSink& sink, const std::string& heading) {
  if (!loaded.present) return nullptr;
  Section& section = sink.add(T::kRung, heading);
  if (!loaded.value) {
    section.error(loaded.error);
    return nullptr;
  }
  section.intro(loaded.value->status.verdict);
  if (!loaded.value->status.measured) {
    section.paragraph("The rung stopped before measuring: its file holds only its verdict.");
    return nullptr;
  }
  return &section;
}

/// A metrics file's curves by step: train loss, validation loss and throughput (tokens/s when
/// `tokens`, else samples/s), each labelled `prefix` + its name.
struct MetricsCurves {
  Series loss, val, rate, lr, grad_norm;
};
MetricsCurves metrics_curves(const MetricsFile& metrics, bool tokens, const std::string& prefix);
/// Whether a record of `metrics` has tokens/s (a token model): the throughput curves' unit.
bool records_tokens(const MetricsFile& metrics);

void training_section(const RunData& run, SectionSink& sink);
void baseline_section(const RunData& run, SectionSink& sink);
void compile_section(const RunData& run, SectionSink& sink);
void profile_section(const RunData& run, SectionSink& sink);
void scale_section(const RunData& run, SectionSink& sink);
void checkpoint_section(const RunData& run, SectionSink& sink);
void pilot_section(const RunData& run, SectionSink& sink);
void plan_section(const RunData& run, SectionSink& sink);
/// A kiln train run against the plan's forecast: the first metrics file (metrics.jsonl first)
/// with plan records (MetricsRecord::plan), null when none has any.
const MetricsFile* plan_tracking_metrics(const RunData& run);
/// Its section ("plan-tracking"): throughput per device and ETTR against the forecast by step,
/// the final ETTR, wall time and checkpoint time against the forecast. None without plan records.
void plan_tracking_section(const RunData& run, SectionSink& sink);

// Formatting shared by the sections.
std::string bytes_text(double bytes);
std::string seconds_text(double seconds);
std::string percent_text(double fraction);
std::string yes_no(bool value);
std::string throughput_text(double per_second, bool tokens);

}  // namespace kiln::report
