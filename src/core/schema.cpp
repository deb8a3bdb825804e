// The config schema's building blocks, core's own section [run], and the flat key list.
// Every other section is declared next to its component's code (core/schema_sections.h); the top
// layer collects them in config_sections() (src/rungs/schema.cpp). A key declared in a section is
// parsed, validated, shown by `kiln config show` and listed in docs/config.md.
#include <algorithm>
#include <stdexcept>

#include "core/schema_sections.h"
#include "kiln/config.h"

namespace kiln {

KeyDef bool_key(std::string section, std::string name, bool def, std::string doc) {
  return {std::move(section), std::move(name), ValueType::kBool, def, {}, {}, {}, std::move(doc)};
}
KeyDef int_key(std::string section, std::string name, int64_t def, double lo, double hi,
               std::string doc) {
  return {std::move(section), std::move(name), ValueType::kInt, def, lo, hi, {}, std::move(doc)};
}
KeyDef float_key(std::string section, std::string name, double def, double lo, double hi,
                 std::string doc) {
  return {std::move(section), std::move(name), ValueType::kFloat, def, lo, hi, {}, std::move(doc)};
}
KeyDef string_key(std::string section, std::string name, std::string def,
                  std::vector<std::string> choices, std::string doc) {
  return {std::move(section), std::move(name), ValueType::kString, std::move(def), {}, {},
          std::move(choices), std::move(doc)};
}
KeyDef table_key(std::string section, std::string name, double lo, double hi,
                 std::vector<std::string> names, std::string doc) {
  return {std::move(section), std::move(name), ValueType::kTable, NumberTable{}, lo, hi,
          std::move(names),   std::move(doc)};
}

ConfigSection run_section() {
  return {
      "run",
      {
          string_key("run", "name", "", {},
                     "run name; outputs go to <run.dir>/<run.name> (default: config file stem)"),
          string_key("run", "dir", "runs", {}, "parent directory of run directories"),
          int_key("run", "seed", 1337, 0, 9.2e18,
                  "seed for model initialisation and every other RNG"),
          bool_key("run", "deterministic", true,
                   "deterministic algorithms; on CPU equal configs give bitwise-equal losses"),
          bool_key("run", "fill_uninitialized_memory", false,
                   "with run.deterministic, fill every new tensor's memory (NaN) as PyTorch's "
                   "deterministic mode does by default: a read of uninitialized memory shows, at "
                   "the cost of a fill_ per allocation; kiln's bitwise determinism needs no fill"),
          bool_key("run", "keep_freed_memory", true,
                   "glibc: freed CPU memory stays in the process for the next step's tensors "
                   "(no mmap per large tensor, no trim), sparing each step the page faults of "
                   "mapping its large buffers afresh (gpt2-124m: ~4 s of system time in 12 "
                   "steps); false returns it to the OS as glibc's defaults do"),
          int_key("run", "threads", 0, 0, 1024, "intra-op CPU threads (0 = LibTorch's default)"),
          string_key("run", "device", "auto", {"auto", "cpu", "cuda"},
                     "device to train on; auto = cuda when available"),
          int_key("run", "log_every", 10, 1, 1e9,
                  "steps between log lines when stderr is not a terminal"),
          string_key("run", "progress", "auto", {"auto", "bar", "log", "off"},
                     "progress display: bar on a terminal, log lines otherwise"),
      },
      {}};
}

const std::vector<KeyDef>& schema() {
  static const std::vector<KeyDef> keys = [] {
    const ConfigSections& sections = config_sections();
    if (auto problems = schema_problems(sections); !problems.empty()) {
      throw std::logic_error("kiln: the config schema is broken: " + problems.front());
    }
    std::vector<KeyDef> out;
    for (const auto& section : sections)
      out.insert(out.end(), section.keys.begin(), section.keys.end());
    return out;
  }();
  return keys;
}

void add_registered_keys(ConfigSection& section, const std::vector<KeyDef>& keys,
                         const std::vector<ConfigRule>& rules) {
  for (const KeyDef& key : keys) {
    const bool declared = std::any_of(section.keys.begin(), section.keys.end(),
                                      [&](const KeyDef& k) { return k.name == key.name; });
    if (!declared) section.keys.push_back(key);
  }
  for (const ConfigRule& rule : rules) section.rules.push_back(rule);
}

}  // namespace kiln
