// Reading a run directory for the report (src/report/run_data.h): rung files only through their
// typed results.
#include "report/run_data.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace kiln::report {

namespace fs = std::filesystem;

namespace {

template <class T>
void load(const fs::path& dir, const std::string& file, Loaded<T>& out,
          std::vector<std::string>& missing) {
  std::error_code ec;
  out.present = fs::is_regular_file(dir / file, ec);
  if (!out.present) {
    missing.push_back(file);
    return;
  }
  try {
    out.value = read_result<T>(dir / file);
  } catch (const ResultFormatError& e) {
    out.error = e.what();
    missing.push_back(file + " (unreadable)");
  }
}

MetricsFile read_metrics(const fs::path& path) {
  MetricsFile out{path.filename().string(), {}};
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!record.is_object() || !record.contains("step")) continue;  // a torn or foreign line
    try {
      out.records.push_back(record.get<MetricsRecord>());
    } catch (const ResultFormatError&) {
      // a line whose step or values are not numbers: skipped like a torn one
    }
  }
  return out;
}

void flatten_toml(const toml::table& table, const std::string& prefix,
                  std::vector<std::pair<std::string, std::string>>& out) {
  for (const auto& [key, node] : table) {
    const std::string name =
        prefix.empty() ? std::string(key.str()) : prefix + "." + std::string(key.str());
    if (const auto* inner = node.as_table()) {
      flatten_toml(*inner, name, out);
    } else if (const auto* number = node.as_floating_point()) {
      out.emplace_back(name, fmt::format("{}", number->get()));  // shortest round trip: 0.0005
    } else if (const auto* string = node.as_string()) {
      out.emplace_back(name, string->get());
    } else {
      std::ostringstream text;
      node.visit([&](const auto& value) { text << value; });
      out.emplace_back(name, text.str());
    }
  }
}

}  // namespace

const MetricsFile* RunData::main_metrics() const {
  for (const char* name : {"metrics.jsonl", "metrics-baseline.jsonl"}) {
    for (const auto& m : metrics) {
      if (m.name == name && !m.records.empty()) return &m;
    }
  }
  for (const auto& m : metrics) {
    if (!m.records.empty()) return &m;
  }
  return nullptr;
}

RunData load_run(const fs::path& dir) {
  RunData run;
  run.dir = dir;
  run.name = fs::absolute(dir).lexically_normal().filename().string();
  if (run.name.empty()) run.name = fs::absolute(dir).lexically_normal().parent_path().filename();
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("metrics") && name.ends_with(".jsonl")) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  for (const auto& name : names) run.metrics.push_back(read_metrics(dir / name));
  if (run.metrics.empty()) run.missing.push_back("metrics.jsonl");
  load(dir, "manifest.json", run.identity, run.missing);
  load(dir, "baseline.json", run.baseline, run.missing);
  load(dir, "compile.json", run.compile, run.missing);
  load(dir, "profile.json", run.profile, run.missing);
  load(dir, "scale.json", run.scale, run.missing);
  load(dir, "checkpoint.json", run.checkpoint, run.missing);
  load(dir, "pilot.json", run.pilot, run.missing);
  load(dir, "plan.json", run.plan, run.missing);
  if (fs::is_regular_file(dir / "config.toml", ec)) {
    try {
      flatten_toml(toml::parse_file((dir / "config.toml").string()), "", run.config);
    } catch (const std::exception&) {
      run.missing.push_back("config.toml (unreadable)");
    }
  }
  return run;
}

}  // namespace kiln::report
