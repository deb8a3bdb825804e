// The schema checking itself (schema_problems) and documenting itself (keys_markdown,
// rules_markdown: docs/config.md's tables).
#include <set>

#include "core/config_checks.h"
#include "kiln/config.h"

namespace kiln {

using config_detail::check_value;
using config_detail::expectation;
using config_detail::range_text;

std::vector<std::string> schema_problems(const ConfigSections& sections) {
  std::vector<std::string> out;
  std::set<std::string> section_names, key_names;
  for (const auto& section : sections) {
    if (!section_names.insert(section.name).second) {
      out.push_back("section [" + section.name + "] is declared twice");
    }
    for (const auto& def : section.keys) {
      const std::string name = def.full_name();
      if (def.section != section.name) {
        out.push_back(name + " is declared in section [" + section.name + "]");
      }
      if (!key_names.insert(name).second) out.push_back(name + " is declared twice");
      if (def.doc.empty()) out.push_back(name + " has no doc");
      if (def.default_value.index() != static_cast<size_t>(def.type)) {
        out.push_back(name + ": the default is not " + expectation(def));
      } else if (std::string problem = check_value(def, def.default_value); !problem.empty()) {
        out.push_back("default " + problem);
      }
      if (def.type != ValueType::kString && def.type != ValueType::kTable && !def.choices.empty()) {
        out.push_back(name + " has choices but is not a string");
      }
      if (def.min && def.max && *def.min > *def.max) out.push_back(name + " has an empty range");
    }
    for (const auto& rule : section.rules) {
      if (rule.description.empty() || !rule.check || rule.example.empty()) {
        out.push_back("a rule of [" + section.name +
                      "] lacks a description, a check or an example: " + rule.description);
      }
    }
  }
  return out;
}

std::string keys_markdown(const ConfigSections& sections) {
  std::string out = "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
  for (const auto& section : sections) {
    for (const auto& def : section.keys) {
      std::string allowed;
      for (const auto& choice : def.choices) allowed += (allowed.empty() ? "" : ", ") + choice;
      if (def.min || def.max) {
        allowed =
            (def.type == ValueType::kTable && !allowed.empty() ? "names " + allowed + "; values "
                                                               : std::string()) +
            range_text(def);
      }
      out += "| `" + def.full_name() + "` | " + type_name(def.type) + " | `" +
             value_to_toml(def.default_value) + "` | " + allowed + " | " + def.doc + " |\n";
    }
  }
  return out;
}

std::string rules_markdown(const ConfigSections& sections) {
  std::string out = "| section | rule | violated by |\n|---|---|---|\n";
  for (const auto& section : sections) {
    for (const auto& rule : section.rules) {
      std::string example;
      for (const auto& a : rule.example) example += (example.empty() ? "`" : " `") + a + "`";
      out += "| [" + section.name + "] | " + rule.description + " | " + example + " |\n";
    }
  }
  return out;
}

}  // namespace kiln
