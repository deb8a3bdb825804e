#include "kiln/config.h"

#include <toml++/toml.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "core/config_checks.h"
#include "core/schema_sections.h"
#include "core/strings.h"
#include "kiln/error.h"

namespace kiln {
namespace {

// The schema every Config follows unless given another: config_sections(), not owned.
std::shared_ptr<const ConfigSections> default_sections() {
  static const std::shared_ptr<const ConfigSections> sections(
      std::shared_ptr<const ConfigSections>(), &config_sections());
  return sections;
}

std::string where(const std::string& source, const toml::source_region& region) {
  if (region.begin.line == 0) return source;
  return source + ":" + std::to_string(region.begin.line);
}

std::string choice_list(const std::vector<std::string>& choices) {
  std::string out;
  for (size_t k = 0; k < choices.size(); ++k) out += (k ? ", \"" : "\"") + choices[k] + "\"";
  return out;
}

bool in_range(const KeyDef& def, double number) {
  return std::isfinite(number) && !(def.min && number < *def.min) &&
         !(def.max && number > *def.max);
}

}  // namespace

namespace config_detail {

std::string range_text(const KeyDef& def) {
  auto bound = [](std::optional<double> v, const char* none) {
    if (!v) return std::string(none);
    return format_number(*v);
  };
  return "[" + bound(def.min, "-inf") + ", " + bound(def.max, "inf") + "]";
}

std::string expectation(const KeyDef& def) {
  if (def.type == ValueType::kTable) {
    std::string out = "a table of name = float";
    if (def.min || def.max) out += " with values in " + range_text(def);
    if (!def.choices.empty()) out += " and names among " + choice_list(def.choices);
    return out;
  }
  if (def.type == ValueType::kBool) return "a boolean (true or false)";
  std::string out = (def.type == ValueType::kInt ? "an " : "a ") + type_name(def.type);
  if (!def.choices.empty()) return "one of " + choice_list(def.choices);
  if (def.min || def.max) out += " in " + range_text(def);
  return out;
}

std::string check_value(const KeyDef& def, const Value& value) {
  switch (def.type) {
    case ValueType::kBool:
      return "";
    case ValueType::kString: {
      const auto& text = std::get<std::string>(value);
      if (!def.choices.empty() &&
          std::find(def.choices.begin(), def.choices.end(), text) == def.choices.end()) {
        return def.full_name() + " = \"" + text + "\" is not allowed; expected " + expectation(def);
      }
      return "";
    }
    case ValueType::kTable:
      for (const auto& [name, number] : std::get<NumberTable>(value)) {
        const std::string full = def.full_name() + "." + name;
        if (!def.choices.empty() &&
            std::find(def.choices.begin(), def.choices.end(), name) == def.choices.end()) {
          return full + ": unknown name \"" + name + "\"; expected one of " +
                 choice_list(def.choices);
        }
        if (!in_range(def, number)) {
          return full + " = " + value_to_toml(number) + " is out of range; expected a float in " +
                 range_text(def);
        }
      }
      return "";
    case ValueType::kInt:
    case ValueType::kFloat: {
      const double number = def.type == ValueType::kInt
                                ? static_cast<double>(std::get<int64_t>(value))
                                : std::get<double>(value);
      if (!in_range(def, number)) {
        return def.full_name() + " = " + value_to_toml(value) + " is out of range; expected " +
               expectation(def);
      }
      return "";
    }
  }
  return "";
}

}  // namespace config_detail

using config_detail::check_value;
using config_detail::expectation;
using config_detail::range_text;

namespace {

std::string node_kind(const toml::node& node) {
  std::ostringstream out;
  out << node.type();
  return out.str();
}

std::optional<double> number_of(const toml::node& node) {
  if (auto v = node.as_floating_point()) return v->get();
  if (auto v = node.as_integer()) return static_cast<double>(v->get());
  return std::nullopt;
}

// Converts a TOML node to the key's type. On a type mismatch returns nullopt and sets `problem`
// to "<key> has a <kind>; expected <what>" (the key of a table entry names the entry).
std::optional<Value> from_node(const KeyDef& def, const toml::node& node, std::string& problem,
                               toml::source_region& region) {
  region = node.source();
  problem = def.full_name() + " has a " + node_kind(node) + "; expected " + expectation(def);
  switch (def.type) {
    case ValueType::kBool:
      if (auto v = node.as_boolean()) return Value(v->get());
      break;
    case ValueType::kInt:
      if (auto v = node.as_integer()) return Value(static_cast<int64_t>(v->get()));
      break;
    case ValueType::kFloat:
      if (auto v = number_of(node)) return Value(*v);
      break;
    case ValueType::kString:
      if (auto v = node.as_string()) return Value(v->get());
      break;
    case ValueType::kTable: {
      const toml::table* table = node.as_table();
      if (!table) break;
      NumberTable out;
      for (auto&& [name, entry] : *table) {
        std::optional<double> number = number_of(entry);
        if (!number) {
          region = entry.source();
          problem = def.full_name() + "." + std::string(name.str()) + " has a " + node_kind(entry) +
                    "; expected a float";
          return std::nullopt;
        }
        out[std::string(name.str())] = *number;
      }
      return Value(std::move(out));
    }
  }
  return std::nullopt;
}

std::optional<Value> from_text(const KeyDef& def, std::string_view text) {
  switch (def.type) {
    case ValueType::kBool:
      if (text == "true") return Value(true);
      if (text == "false") return Value(false);
      return std::nullopt;
    case ValueType::kInt: {
      int64_t v = 0;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
      return Value(v);
    }
    case ValueType::kFloat: {
      double v = 0;  // decimal or scientific notation only (no hex); inf/nan fail the range check
      auto [end, ec] =
          std::from_chars(text.data(), text.data() + text.size(), v, std::chars_format::general);
      if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
      return Value(v);
    }
    case ValueType::kString: {
      if (text.size() >= 2 && (text.front() == '"' || text.front() == '\'') &&
          text.back() == text.front()) {
        text = text.substr(1, text.size() - 2);
      }
      return Value(std::string(text));
    }
    case ValueType::kTable: {  // an inline table, e.g. { h100 = 2.5, a100 = 1.8 }
      toml::table root;
      try {
        root = toml::parse("value = " + std::string(text));
      } catch (const toml::parse_error&) {
        return std::nullopt;
      }
      std::string problem;
      toml::source_region region;
      const toml::node* node = root.get("value");
      if (!node) return std::nullopt;
      return from_node(def, *node, problem, region);
    }
  }
  return std::nullopt;
}

bool is_bare_key(std::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
}

const KeyDef* find_in(const ConfigSections& sections, std::string_view full_name) {
  const size_t dot = full_name.find('.');
  if (dot == std::string_view::npos) return nullptr;
  const std::string_view section = full_name.substr(0, dot), name = full_name.substr(dot + 1);
  for (const auto& s : sections) {
    if (s.name != section) continue;
    for (const auto& def : s.keys) {
      if (def.name == name) return &def;
    }
  }
  return nullptr;
}

std::string closest_in(const ConfigSections& sections, std::string_view full_name) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& section : sections) {
    for (const auto& def : section.keys) {
      std::string candidate = def.full_name();
      size_t d = edit_distance(full_name, candidate);
      // Also compare the bare key name, so "train.lr" finds "optim.lr" when the section is wrong.
      size_t dot = full_name.find('.');
      if (dot != std::string_view::npos && full_name.substr(dot + 1) == def.name)
        d = std::min<size_t>(d, 1);
      if (d < best_distance) {
        best_distance = d;
        best = candidate;
      }
    }
  }
  size_t limit = std::max<size_t>(2, full_name.size() / 3);
  return best_distance <= limit ? best : "";
}

}  // namespace

std::string type_name(ValueType type) {
  switch (type) {
    case ValueType::kBool:
      return "boolean";
    case ValueType::kInt:
      return "integer";
    case ValueType::kFloat:
      return "float";
    case ValueType::kString:
      return "string";
    case ValueType::kTable:
      return "table of name = float";
  }
  return "?";
}

std::string value_to_toml(const Value& value) {
  if (auto* v = std::get_if<bool>(&value)) return *v ? "true" : "false";
  if (auto* v = std::get_if<int64_t>(&value)) return std::to_string(*v);
  if (auto* v = std::get_if<double>(&value)) {
    if (std::isinf(*v)) return *v > 0 ? "inf" : "-inf";
    if (std::isnan(*v)) return "nan";
    std::string text = format_number(*v);
    if (text.find_first_of(".eE") == std::string::npos) text += ".0";
    return text;
  }
  if (auto* v = std::get_if<NumberTable>(&value)) {
    if (v->empty()) return "{}";
    std::string out = "{ ";
    for (const auto& [name, number] : *v) {
      if (out.size() > 2) out += ", ";
      out += (is_bare_key(name) ? name : toml_quote(name)) + " = " + value_to_toml(number);
    }
    return out + " }";
  }
  return toml_quote(std::get<std::string>(value));
}

const KeyDef* find_key(std::string_view full_name) {
  return find_in(config_sections(), full_name);
}

std::string closest_key(std::string_view full_name) {
  return closest_in(config_sections(), full_name);
}

Config Config::defaults() {
  schema();  // checks config_sections() once
  return defaults(default_sections());
}

Config Config::defaults(std::shared_ptr<const ConfigSections> sections) {
  if (sections.get() != &config_sections()) {
    if (auto problems = schema_problems(*sections); !problems.empty()) {
      throw std::logic_error("kiln: the config schema is broken: " + problems.front());
    }
  }
  Config config;
  config.sections_ = std::move(sections);
  for (const auto& section : *config.sections_) {
    for (const auto& def : section.keys) config.values_[def.full_name()] = def.default_value;
  }
  return config;
}

Config Config::load(const std::filesystem::path& file, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) {
    throw UserError("config file " + file.string() + " does not exist; check the path");
  }
  if (std::filesystem::is_directory(file, ec)) {
    throw UserError("config file " + file.string() + " is a directory; pass a .toml file");
  }
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw UserError("config file " + file.string() + " cannot be read; check its permissions");
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw UserError("config file " + file.string() + " cannot be read (I/O error)");
  Config config = parse(buffer.str(), file.string(), overrides);
  config.source_ = file;
  return config;
}

Config Config::parse(std::string_view toml_text, const std::string& source_name,
                     const std::vector<std::string>& overrides) {
  schema();  // checks config_sections() once
  return parse(toml_text, source_name, overrides, default_sections());
}

Config Config::parse(std::string_view toml_text, const std::string& source_name,
                     const std::vector<std::string>& overrides,
                     std::shared_ptr<const ConfigSections> sections) {
  Config config = defaults(std::move(sections));
  const ConfigSections& schema_sections = *config.sections_;
  config.source_name_ = source_name;
  toml::table root;
  try {
    root = toml::parse(toml_text, source_name);
  } catch (const toml::parse_error& e) {
    throw UserError(where(source_name, e.source()) +
                    ": TOML syntax error: " + std::string(e.description()));
  }
  for (auto&& [section_key, section_node] : root) {
    std::string section(section_key.str());
    const toml::table* table = section_node.as_table();
    bool known_section =
        std::any_of(schema_sections.begin(), schema_sections.end(),
                    [&](const ConfigSection& s) { return s.name == section && !s.keys.empty(); });
    if (!table) {
      std::string hint = closest_in(schema_sections, section);
      throw UserError(where(source_name, section_key.source()) + ": top-level key '" + section +
                      "' must be inside a section such as [train]" +
                      (hint.empty() ? "" : " (did you mean " + hint + "?)"));
    }
    if (!known_section) {
      std::string best;
      size_t best_distance = std::string::npos;
      for (const auto& s : schema_sections) {
        size_t d = edit_distance(section, s.name);
        if (d < best_distance) best_distance = d, best = s.name;
      }
      throw UserError(where(source_name, section_key.source()) + ": unknown section [" + section +
                      "]" + (best_distance <= 2 ? " (did you mean [" + best + "]?)" : ""));
    }
    for (auto&& [key, node] : *table) {
      std::string full = section + "." + std::string(key.str());
      const KeyDef* def = find_in(schema_sections, full);
      if (!def) {
        std::string hint = closest_in(schema_sections, full);
        throw UserError(where(source_name, key.source()) + ": unknown key " + full +
                        (hint.empty() ? "" : " (did you mean " + hint + "?)"));
      }
      std::string problem;
      toml::source_region region;
      std::optional<Value> value = from_node(*def, node, problem, region);
      if (!value) throw UserError(where(source_name, region) + ": " + problem);
      if (problem = check_value(*def, *value); !problem.empty()) {
        throw UserError(where(source_name, node.source()) + ": " + problem);
      }
      config.values_[full] = *value;
    }
  }
  for (const auto& assignment : overrides) config.set_from_string(assignment);
  config.validate();
  return config;
}

const KeyDef* Config::find(std::string_view full_name) const {
  return find_in(*sections_, full_name);
}

void Config::set_from_string(std::string_view assignment) {
  size_t eq = assignment.find('=');
  if (eq == std::string_view::npos) {
    throw UserError("--set " + std::string(assignment) +
                    ": expected section.key=value, e.g. --set optim.lr=3e-4");
  }
  std::string key(trim(assignment.substr(0, eq)));
  std::string_view text = trim(assignment.substr(eq + 1));
  const KeyDef* def = find(key);
  // One entry of a table key: section.key.name=value.
  const size_t second_dot = key.find('.', key.find('.') + 1);
  if (!def && second_dot != std::string::npos) {
    const KeyDef* table_def = find(std::string_view(key).substr(0, second_dot));
    if (table_def && table_def->type == ValueType::kTable) {
      const std::string name = key.substr(second_dot + 1);
      KeyDef entry_def = *table_def;
      entry_def.type = ValueType::kFloat;
      std::optional<Value> number = from_text(entry_def, text);
      if (!number) {
        throw UserError("--set " + std::string(assignment) + ": '" + std::string(text) +
                        "' is not a float");
      }
      NumberTable table = std::get<NumberTable>(values_.at(table_def->full_name()));
      table[name] = std::get<double>(*number);
      if (std::string problem = check_value(*table_def, table); !problem.empty()) {
        throw UserError("--set " + std::string(assignment) + ": " + problem);
      }
      values_[table_def->full_name()] = std::move(table);
      return;
    }
  }
  if (!def) {
    std::string hint = closest_in(*sections_, key);
    throw UserError("--set " + std::string(assignment) + ": unknown key " + key +
                    (hint.empty() ? "" : " (did you mean " + hint + "?)"));
  }
  std::optional<Value> value = from_text(*def, text);
  if (!value) {
    throw UserError("--set " + std::string(assignment) + ": '" + std::string(text) + "' is not " +
                    expectation(*def));
  }
  if (std::string problem = check_value(*def, *value); !problem.empty()) {
    throw UserError("--set " + std::string(assignment) + ": " + problem);
  }
  values_[key] = *value;
}

void Config::set(std::string_view key, Value value) {
  const KeyDef* def = find(key);
  if (!def) throw UserError("unknown config key " + std::string(key));
  if (def->type == ValueType::kFloat && std::holds_alternative<int64_t>(value)) {
    value = static_cast<double>(std::get<int64_t>(value));
  }
  if (value.index() != def->default_value.index()) {
    throw UserError(std::string(key) + ": expected " + expectation(*def));
  }
  if (std::string problem = check_value(*def, value); !problem.empty()) throw UserError(problem);
  values_[std::string(key)] = std::move(value);
}

const Value& Config::get(std::string_view key) const {
  auto it = values_.find(key);
  if (it == values_.end()) {
    // A programming error (the key is not in the schema), not a user error.
    throw std::logic_error("kiln: config key " + std::string(key) + " is not in the schema");
  }
  return it->second;
}

bool Config::get_bool(std::string_view key) const {
  return std::get<bool>(get(key));
}
int64_t Config::get_int(std::string_view key) const {
  return std::get<int64_t>(get(key));
}
double Config::get_float(std::string_view key) const {
  return std::get<double>(get(key));
}
const std::string& Config::get_string(std::string_view key) const {
  return std::get<std::string>(get(key));
}
const NumberTable& Config::get_table(std::string_view key) const {
  return std::get<NumberTable>(get(key));
}

void Config::check_enum_mapping(std::string_view key,
                                const std::vector<std::string_view>& names) const {
  const KeyDef* def = find(key);
  if (!def || def->type != ValueType::kString || def->choices.empty()) {
    throw std::logic_error("kiln: get_enum(" + std::string(key) +
                           "): not a string key with choices in the schema");
  }
  std::string mismatch;
  for (const auto& choice : def->choices) {
    if (std::count(names.begin(), names.end(), choice) != 1) {
      mismatch += " choice \"" + choice + "\" has " +
                  (std::count(names.begin(), names.end(), choice) ? "several enumerators;"
                                                                  : "no enumerator;");
    }
  }
  for (const auto& name : names) {
    if (std::find(def->choices.begin(), def->choices.end(), name) == def->choices.end()) {
      mismatch += " enumerator \"" + std::string(name) + "\" names no choice;";
    }
  }
  if (!mismatch.empty()) {
    throw std::logic_error("kiln: get_enum(" + std::string(key) +
                           "): the mapping disagrees with the schema's choices (" +
                           choice_list(def->choices) + "):" + mismatch);
  }
}

void Config::validate() const {
  for (const auto& section : *sections_) {
    for (const auto& rule : section.rules) {
      if (std::string problem = rule.check(*this); !problem.empty()) {
        throw UserError(source_name_ + ": " + problem);
      }
    }
  }
}

std::string Config::to_toml(bool with_docs) const {
  std::string out;
  for (const auto& section : *sections_) {
    if (section.keys.empty()) continue;
    out += (out.empty() ? "[" : "\n[") + section.name + "]\n";
    for (const auto& def : section.keys) {
      std::string line = def.name + " = " + value_to_toml(get(def.full_name()));
      if (with_docs) {  // the default beside a value that differs from it (`kiln config show`)
        line.resize(std::max<size_t>(line.size() + 1, 36), ' ');
        const bool is_default = get(def.full_name()) == def.default_value;
        line += "# " + def.doc +
                (is_default ? "" : " (default " + value_to_toml(def.default_value) + ")");
      }
      out += line + "\n";
    }
  }
  return out;
}

std::string Config::hash() const {
  std::string canonical = to_toml(false);
  return hex64(XXH64(canonical.data(), canonical.size(), 0));
}

}  // namespace kiln
