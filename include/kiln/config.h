// Configuration: each component declares its section of the schema (keys with type, default,
// range or choices, doc; and the cross-key rules it needs) next to its code; a Config holds a
// fully resolved, validated value for every key of every section.
//
// Sources, later wins: schema defaults < TOML file < `--set section.key=value` overrides.
// Every failure is a kiln::UserError with one line naming file:line and key, and the fix.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace kiln {

enum class ValueType { kBool, kInt, kFloat, kString, kTable };
/// A table of per-name numbers, e.g. per-GPU prices `{ h100 = 2.5, a100 = 1.8 }`. Sorted by name.
using NumberTable = std::map<std::string, double, std::less<>>;
/// A key's value; the alternative's index equals static_cast<size_t>(ValueType).
using Value = std::variant<bool, int64_t, double, std::string, NumberTable>;

/// One key of the schema, e.g. section "optim", name "lr".
struct KeyDef {
  std::string section;
  std::string name;
  ValueType type;
  Value default_value;
  std::optional<double> min;  // inclusive; numbers, and each value of a table
  std::optional<double> max;  // inclusive; numbers, and each value of a table
  /// Strings: the allowed values (empty = any string). Tables: the allowed names (empty = any).
  std::vector<std::string> choices;
  std::string doc;  // one line
  std::string full_name() const { return section + "." + name; }
};

class Config;

/// A check on a combination of keys that are valid alone but not together.
struct ConfigRule {
  std::string description;  // one line, for docs and test names
  /// The problem, naming the keys and the fix (without the file name), or "" when satisfied.
  std::function<std::string(const Config&)> check;
  /// `section.key=value` assignments (--set syntax) that, applied to the defaults, make a config
  /// that violates this rule and no other one (tests run each through `kiln config validate` and
  /// `kiln train`).
  std::vector<std::string> example;
};

/// One [section] of the config: its keys in display order and its cross-key rules.
struct ConfigSection {
  std::string name;
  std::vector<KeyDef> keys;
  std::vector<ConfigRule> rules;
};
using ConfigSections = std::vector<ConfigSection>;

/// Every section kiln knows, in display order (run, model, data, train, optim, baseline, profile,
/// dist, checkpoint). Declared by core, defined by the top layer (src/rungs/schema.cpp), which
/// collects each component's section; core calls nothing above it. Immutable; thread-safe.
const ConfigSections& config_sections();
/// Every key of config_sections(), in display order. Immutable; thread-safe.
const std::vector<KeyDef>& schema();
/// The definition of "section.key" in config_sections(), or nullptr.
const KeyDef* find_key(std::string_view full_name);
/// The known key closest to `full_name` by edit distance, or "" when nothing is close.
std::string closest_key(std::string_view full_name);
/// Human name of a value type ("integer", "float", "table of name = float", ...).
std::string type_name(ValueType type);
/// Renders a value as TOML (a table as an inline table, names sorted).
std::string value_to_toml(const Value& value);
/// The Markdown table of every key of `sections` (`kiln config keys`, docs/config.md).
std::string keys_markdown(const ConfigSections& sections = config_sections());
/// The Markdown table of every cross-key rule of `sections`: section, rule, a violating example.
std::string rules_markdown(const ConfigSections& sections = config_sections());

class Config {
 public:
  /// Every key at its default. source_name() is "<defaults>".
  static Config defaults();
  /// Same, for another schema (tests; a schema checked like config_sections(): programming errors
  /// in it, such as a default out of its range, throw std::logic_error).
  static Config defaults(std::shared_ptr<const ConfigSections> sections);
  /// Parses and validates a TOML file, then applies overrides ("section.key=value").
  /// Throws UserError for a missing/unreadable file, a syntax error, an unknown section or key,
  /// a wrong type, a value out of range, a bad override, or an inconsistent combination.
  static Config load(const std::filesystem::path& file,
                     const std::vector<std::string>& overrides = {});
  /// Same as load() on TOML text; `source_name` is used in error messages.
  static Config parse(std::string_view toml_text, const std::string& source_name,
                      const std::vector<std::string>& overrides = {});
  /// Same, against another schema (tests).
  static Config parse(std::string_view toml_text, const std::string& source_name,
                      const std::vector<std::string>& overrides,
                      std::shared_ptr<const ConfigSections> sections);

  bool get_bool(std::string_view key) const;
  int64_t get_int(std::string_view key) const;
  double get_float(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  const NumberTable& get_table(std::string_view key) const;
  const Value& get(std::string_view key) const;

  /// A string key with choices read as a C++ enum: `mapping` pairs each choice with its
  /// enumerator. The mapping must name exactly the schema's choices: otherwise (a choice without
  /// an enumerator, or an enumerator naming no choice) it throws std::logic_error on every read,
  /// so the first read at start-up fails whatever the value.
  template <typename E>
  E get_enum(std::string_view key,
             std::initializer_list<std::pair<std::string_view, E>> mapping) const {
    std::vector<std::string_view> names;
    for (const auto& item : mapping) names.push_back(item.first);
    check_enum_mapping(key, names);
    const std::string& value = get_string(key);
    for (const auto& [name, enumerator] : mapping) {
      if (name == value) return enumerator;
    }
    throw std::logic_error("kiln: " + std::string(key) + " holds no mapped choice");
  }

  /// Sets a key from text, parsed by the key's type ("--set" semantics). A table key takes an
  /// inline table (`section.key={ a = 1.5 }`, replacing it) or one entry
  /// (`section.key.name=1.5`, adding or replacing that name). Throws UserError.
  void set_from_string(std::string_view assignment);
  /// Sets a key to a typed value, range-checked. Throws UserError.
  void set(std::string_view key, Value value);

  /// Runs every section's rules. Throws UserError "<source>: <problem>" for the first broken one.
  void validate() const;

  /// The resolved config as TOML, every key, with each key's doc as a comment when with_docs.
  std::string to_toml(bool with_docs = true) const;
  /// xxh64 of the canonical resolved TOML (no comments), 16 hex digits. Equal configs, equal hash.
  std::string hash() const;
  /// The file this config was loaded from; empty for defaults()/parse().
  const std::filesystem::path& source() const { return source_; }
  /// Name for error messages: the file path, or the source name given to parse().
  const std::string& source_name() const { return source_name_; }
  /// The schema this config follows.
  const ConfigSections& sections() const { return *sections_; }

 private:
  const KeyDef* find(std::string_view full_name) const;
  void check_enum_mapping(std::string_view key, const std::vector<std::string_view>& names) const;

  std::shared_ptr<const ConfigSections> sections_;
  std::map<std::string, Value, std::less<>> values_;
  std::filesystem::path source_;
  std::string source_name_ = "<defaults>";
};

/// The seed of data generation and shuffling: data.seed, or run.seed when data.seed is 0.
uint64_t data_seed(const Config& config);

}  // namespace kiln
