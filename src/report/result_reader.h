// The strict JSON reader behind the typed rung results (private to src/report; results*.cpp):
// every key read by name with its path, so a missing or mistyped key is one line naming it.
#pragma once

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kiln/results.h"

namespace kiln {
namespace result_json {

using nlohmann::json;

inline std::string type_of(const json& v) {
  return v.is_null() ? "null" : v.type_name();
}

// A JSON object read by key, strictly: req() throws on a missing or mistyped key, opt() treats
// absent and null alike and still throws on a wrong type. `path` is the object's key path.
class Reader {
 public:
  Reader(const json& value, std::string path) : value_(value), path_(std::move(path)) {
    if (!value_.is_object())
      fail(path_.empty() ? "the file" : path_, "is " + type_of(value_) + ", expected an object");
  }
  bool has(const char* key) const { return value_.contains(key) && !value_[key].is_null(); }

  template <class T>
  T req(const char* key) const {
    if (!value_.contains(key)) fail(name(key), "is missing");
    return as<T>(value_[key], name(key));
  }
  template <class T>
  std::optional<T> opt(const char* key) const {
    if (!has(key)) return std::nullopt;
    return as<T>(value_[key], name(key));
  }
  /// A key every file of this version has, null when there is nothing to say (an MFU without a
  /// peak): absent is a format error, null is nullopt.
  template <class T>
  std::optional<T> nullable(const char* key) const {
    if (!value_.contains(key)) fail(name(key), "is missing");
    return opt<T>(key);
  }
  Reader obj(const char* key) const {
    if (!value_.contains(key)) fail(name(key), "is missing");
    return Reader(value_[key], name(key));
  }
  std::optional<Reader> nullable_obj(const char* key) const {
    if (!value_.contains(key)) fail(name(key), "is missing");
    if (!has(key)) return std::nullopt;
    return Reader(value_[key], name(key));
  }
  std::vector<Reader> list(const char* key) const {
    if (!value_.contains(key)) fail(name(key), "is missing");
    const json& array = value_[key];
    if (!array.is_array()) fail(name(key), "is " + type_of(array) + ", expected an array");
    std::vector<Reader> out;
    for (size_t k = 0; k < array.size(); ++k) {
      out.emplace_back(array[k], fmt::format("{}[{}]", name(key), k));
    }
    return out;
  }
  std::vector<std::string> strings(const char* key) const {
    if (!value_.contains(key)) fail(name(key), "is missing");
    const json& array = value_[key];
    if (!array.is_array()) fail(name(key), "is " + type_of(array) + ", expected an array");
    std::vector<std::string> out;
    for (size_t k = 0; k < array.size(); ++k) {
      out.push_back(as<std::string>(array[k], fmt::format("{}[{}]", name(key), k)));
    }
    return out;
  }

  [[noreturn]] static void fail(const std::string& what, const std::string& problem) {
    throw ResultFormatError(what + " " + problem);
  }

 private:
  std::string name(const char* key) const { return path_.empty() ? key : path_ + "." + key; }
  template <class T>
  static T as(const json& v, const std::string& what) {
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) fail(what, "is " + type_of(v) + ", expected true or false");
      return v.get<bool>();
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) fail(what, "is " + type_of(v) + ", expected a string");
      return v.get<std::string>();
    } else if constexpr (std::is_integral_v<T>) {
      if (!v.is_number_integer()) fail(what, "is " + type_of(v) + ", expected an integer");
      return v.get<T>();
    } else {
      if (!v.is_number()) fail(what, "is " + type_of(v) + ", expected a number");
      return v.get<T>();
    }
  }
  const json& value_;
  std::string path_;
};

inline json opt_json(const std::optional<double>& v) {
  return v ? json(*v) : json(nullptr);
}
inline json opt_json(const std::optional<std::string>& v) {
  return v ? json(*v) : json(nullptr);
}

// The status every rung file starts with. A file whose `anchor` key is absent and which did not
// pass is a rung that stopped before measuring.
inline RungStatus read_status(const Reader& r, const json& j, const char* anchor,
                              bool verdict_inside = false) {
  RungStatus s;
  s.schema_version = r.opt<int>("schema_version").value_or(1);
  if (s.schema_version > kResultSchemaVersion) {
    Reader::fail("schema_version", fmt::format("is {}: written by a newer kiln (this one reads up "
                                               "to {})",
                                               s.schema_version, kResultSchemaVersion));
  }
  s.passed = r.req<bool>("passed");
  s.measured = s.passed || j.contains(anchor);
  if (!s.measured) {
    s.verdict = r.has("verdict") ? r.req<std::string>("verdict") : r.req<std::string>("reason");
  } else if (!verdict_inside) {
    s.verdict = r.req<std::string>("verdict");
  }
  return s;
}

inline void write_status(json& j, const RungStatus& s) {
  j["schema_version"] = kResultSchemaVersion;
  j["passed"] = s.passed;
  j["verdict"] = s.verdict;
}

}  // namespace result_json

}  // namespace kiln
