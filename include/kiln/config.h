// Configuration: one schema declares every key (type, default, range or choices, doc); a Config
// holds a fully resolved, validated value for every key in the schema.
//
// Sources, later wins: schema defaults < TOML file < `--set section.key=value` overrides.
// Every failure is a kiln::UserError with one line naming file:line and key, and the fix.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kiln {

enum class ValueType { kBool, kInt, kFloat, kString };
using Value = std::variant<bool, int64_t, double, std::string>;

/// One key of the schema, e.g. section "optim", name "lr".
struct KeyDef {
  std::string section;
  std::string name;
  ValueType type;
  Value default_value;
  std::optional<double> min;         // inclusive, numbers only
  std::optional<double> max;         // inclusive, numbers only
  std::vector<std::string> choices;  // strings only; empty = any string
  std::string doc;                   // one line
  std::string full_name() const { return section + "." + name; }
};

/// Every key kiln knows, in display order. Immutable; thread-safe.
const std::vector<KeyDef>& schema();
/// The definition of "section.key", or nullptr.
const KeyDef* find_key(std::string_view full_name);
/// The known key closest to `full_name` by edit distance, or "" when nothing is close.
std::string closest_key(std::string_view full_name);
/// Human name of a value type ("integer", "float", ...).
std::string type_name(ValueType type);
/// Renders a value as TOML.
std::string value_to_toml(const Value& value);

class Config {
 public:
  /// Every key at its default. source() is empty.
  static Config defaults();
  /// Parses and validates a TOML file, then applies overrides ("section.key=value").
  /// Throws UserError for a missing/unreadable file, a syntax error, an unknown section or key,
  /// a wrong type, a value out of range, a bad override, or an inconsistent combination.
  static Config load(const std::filesystem::path& file,
                     const std::vector<std::string>& overrides = {});
  /// Same as load() on TOML text; `source_name` is used in error messages.
  static Config parse(std::string_view toml_text, const std::string& source_name,
                      const std::vector<std::string>& overrides = {});

  bool get_bool(std::string_view key) const;
  int64_t get_int(std::string_view key) const;
  double get_float(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  const Value& get(std::string_view key) const;

  /// Sets a key from text, parsed by the key's type ("--set" semantics). Throws UserError.
  void set_from_string(std::string_view assignment);
  /// Sets a key to a typed value, range-checked. Throws UserError.
  void set(std::string_view key, Value value);

  /// Checks combinations of keys that are valid alone but not together. Throws UserError.
  void validate() const;

  /// The resolved config as TOML, every key, with each key's doc as a comment when with_docs.
  std::string to_toml(bool with_docs = true) const;
  /// xxh64 of the canonical resolved TOML (no comments), 16 hex digits. Equal configs, equal hash.
  std::string hash() const;
  /// The file this config was loaded from; empty for defaults()/parse().
  const std::filesystem::path& source() const { return source_; }
  /// Name for error messages: the file path, or the source name given to parse().
  const std::string& source_name() const { return source_name_; }

 private:
  std::map<std::string, Value, std::less<>> values_;
  std::filesystem::path source_;
  std::string source_name_ = "<defaults>";
};

/// The seed of data generation and shuffling: data.seed, or run.seed when data.seed is 0.
uint64_t data_seed(const Config& config);

}  // namespace kiln
