#include "kiln/config.h"

#include <toml++/toml.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/schema_sections.h"
#include "core/strings.h"
#include "kiln/error.h"

namespace kiln {
namespace {

std::string where(const std::string& source, const toml::source_region& region) {
  if (region.begin.line == 0) return source;
  return source + ":" + std::to_string(region.begin.line);
}

std::string expectation(const KeyDef& def) {
  std::string out = (def.type == ValueType::kInt ? "an " : "a ") + type_name(def.type);
  if (!def.choices.empty()) {
    out = "one of";
    for (size_t k = 0; k < def.choices.size(); ++k) {
      out += (k ? ", \"" : " \"") + def.choices[k] + "\"";
    }
    return out;
  }
  if (def.min || def.max) {
    auto bound = [](std::optional<double> v, const char* none) {
      if (!v) return std::string(none);
      return format_number(*v);
    };
    out += " in [" + bound(def.min, "-inf") + ", " + bound(def.max, "inf") + "]";
  }
  return out;
}

// Checks a value against its key's range / choices. Returns an error text or "".
std::string check_value(const KeyDef& def, const Value& value) {
  if (def.type == ValueType::kString) {
    const auto& text = std::get<std::string>(value);
    if (!def.choices.empty() &&
        std::find(def.choices.begin(), def.choices.end(), text) == def.choices.end()) {
      return def.full_name() + " = \"" + text + "\" is not allowed; expected " + expectation(def);
    }
    return "";
  }
  double number = 0;
  if (def.type == ValueType::kInt) number = static_cast<double>(std::get<int64_t>(value));
  if (def.type == ValueType::kFloat) number = std::get<double>(value);
  if (def.type == ValueType::kBool) return "";
  if (!std::isfinite(number) || (def.min && number < *def.min) || (def.max && number > *def.max)) {
    return def.full_name() + " = " + value_to_toml(value) + " is out of range; expected " +
           expectation(def);
  }
  return "";
}

// Converts a TOML node to the key's type, or returns nullopt on a type mismatch.
std::optional<Value> from_node(const KeyDef& def, const toml::node& node) {
  switch (def.type) {
    case ValueType::kBool:
      if (auto v = node.as_boolean()) return Value(v->get());
      break;
    case ValueType::kInt:
      if (auto v = node.as_integer()) return Value(static_cast<int64_t>(v->get()));
      break;
    case ValueType::kFloat:
      if (auto v = node.as_floating_point()) return Value(v->get());
      if (auto v = node.as_integer()) return Value(static_cast<double>(v->get()));
      break;
    case ValueType::kString:
      if (auto v = node.as_string()) return Value(v->get());
      break;
  }
  return std::nullopt;
}

std::string node_kind(const toml::node& node) {
  std::ostringstream out;
  out << node.type();
  return out.str();
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
  }
  return std::nullopt;
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
  return toml_quote(std::get<std::string>(value));
}

const KeyDef* find_key(std::string_view full_name) {
  for (const auto& def : schema()) {
    if (def.section.size() + 1 + def.name.size() == full_name.size() &&
        full_name.starts_with(def.section) && full_name[def.section.size()] == '.' &&
        full_name.substr(def.section.size() + 1) == def.name) {
      return &def;
    }
  }
  return nullptr;
}

std::string closest_key(std::string_view full_name) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& def : schema()) {
    std::string candidate = def.full_name();
    size_t d = edit_distance(full_name, candidate);
    // Also compare the bare key name, so "optim.learning_rate" finds nothing but "train.lr" would
    // find "optim.lr" when the section is wrong.
    size_t dot = full_name.find('.');
    if (dot != std::string_view::npos && full_name.substr(dot + 1) == def.name)
      d = std::min<size_t>(d, 1);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  size_t limit = std::max<size_t>(2, full_name.size() / 3);
  return best_distance <= limit ? best : "";
}

Config Config::defaults() {
  Config config;
  for (const auto& def : schema()) config.values_[def.full_name()] = def.default_value;
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
  Config config = defaults();
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
    bool known_section = std::any_of(schema().begin(), schema().end(),
                                     [&](const KeyDef& d) { return d.section == section; });
    if (!table) {
      std::string hint = closest_key(section);
      throw UserError(where(source_name, section_key.source()) + ": top-level key '" + section +
                      "' must be inside a section such as [train]" +
                      (hint.empty() ? "" : " (did you mean " + hint + "?)"));
    }
    if (!known_section) {
      std::string best;
      size_t best_distance = std::string::npos;
      for (const auto& def : schema()) {
        size_t d = edit_distance(section, def.section);
        if (d < best_distance) best_distance = d, best = def.section;
      }
      throw UserError(where(source_name, section_key.source()) + ": unknown section [" + section +
                      "]" + (best_distance <= 2 ? " (did you mean [" + best + "]?)" : ""));
    }
    for (auto&& [key, node] : *table) {
      std::string full = section + "." + std::string(key.str());
      const KeyDef* def = find_key(full);
      if (!def) {
        std::string hint = closest_key(full);
        throw UserError(where(source_name, key.source()) + ": unknown key " + full +
                        (hint.empty() ? "" : " (did you mean " + hint + "?)"));
      }
      std::optional<Value> value = from_node(*def, node);
      if (!value) {
        throw UserError(where(source_name, node.source()) + ": " + full + " has a " +
                        node_kind(node) + "; expected " + expectation(*def));
      }
      if (std::string problem = check_value(*def, *value); !problem.empty()) {
        throw UserError(where(source_name, node.source()) + ": " + problem);
      }
      config.values_[full] = *value;
    }
  }
  for (const auto& assignment : overrides) config.set_from_string(assignment);
  config.validate();
  return config;
}

void Config::set_from_string(std::string_view assignment) {
  size_t eq = assignment.find('=');
  if (eq == std::string_view::npos) {
    throw UserError("--set " + std::string(assignment) +
                    ": expected section.key=value, e.g. --set optim.lr=3e-4");
  }
  std::string key(trim(assignment.substr(0, eq)));
  std::string_view text = trim(assignment.substr(eq + 1));
  const KeyDef* def = find_key(key);
  if (!def) {
    std::string hint = closest_key(key);
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
  const KeyDef* def = find_key(key);
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

void Config::validate() const {
  const std::string& model = get_string("model.name");
  const std::string& data = get_string("data.name");
  if (model == "mlp" && data != "synthetic") {
    throw UserError(source_name_ + ": model.name = \"mlp\" trains on data.name = \"synthetic\"; " +
                    "set data.name = \"synthetic\" or model.name = \"gpt\"");
  }
  if (model == "gpt" && data == "synthetic") {
    throw UserError(source_name_ + ": model.name = \"gpt\" needs token data; set data.name = " +
                    "\"text\" or \"tokens\"");
  }
  if (data != "synthetic" && get_float("data.val_fraction") == 0 &&
      (data == "text" || get_string("data.val_path").empty())) {
    throw UserError(source_name_ + ": data.val_fraction = 0 leaves no validation data; set it in " +
                    "(0, 0.9]" + (data == "tokens" ? " or give data.val_path" : ""));
  }
  if (data == "tokens" && get_string("data.path").empty()) {
    throw UserError(source_name_ +
                    ": data.name = \"tokens\" needs data.path = \"<train .bin file>\"");
  }
  if (get_bool("optim.nesterov") && get_string("optim.name") == "sgd" &&
      get_float("optim.momentum") <= 0) {
    throw UserError(source_name_ +
                    ": optim.nesterov = true needs optim.momentum > 0; set it (e.g. 0.9)");
  }
  try {
    check_model_keys(*this);
  } catch (const UserError& e) {
    throw UserError(source_name_ + ": " + e.what());
  }
}

std::string Config::to_toml(bool with_docs) const {
  std::string out;
  std::string section;
  for (const auto& def : schema()) {
    if (def.section != section) {
      section = def.section;
      out += (out.empty() ? "[" : "\n[") + section + "]\n";
    }
    std::string line = def.name + " = " + value_to_toml(get(def.full_name()));
    if (with_docs) {
      line.resize(std::max<size_t>(line.size() + 1, 36), ' ');
      line += "# " + def.doc;
    }
    out += line + "\n";
  }
  return out;
}

std::string Config::hash() const {
  std::string canonical = to_toml(false);
  return hex64(XXH64(canonical.data(), canonical.size(), 0));
}

uint64_t data_seed(const Config& config) {
  const int64_t seed = config.get_int("data.seed");
  return static_cast<uint64_t>(seed == 0 ? config.get_int("run.seed") : seed);
}

}  // namespace kiln
