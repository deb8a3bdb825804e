// The field lists behind the typed rung results (private to src/report; results*.cpp). Each
// struct's keys are listed once, in a function template walked by two visitors: ReadIo reads every
// key strictly by name with its path (a missing or mistyped key is one line naming it), WriteIo
// writes the same keys. from_json and to_json are that one list walked both ways, so the key a
// rung writes and the key the report reads cannot differ.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kiln/results.h"

namespace kiln {
namespace result_json {

using nlohmann::json;

inline std::string type_of(const json& v) {
  return v.is_null() ? "null" : v.type_name();
}

[[noreturn]] inline void fail(const std::string& what, const std::string& problem) {
  throw ResultFormatError(what + " " + problem);
}

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};

// One value, strictly. A number read as a double may be null: JSON has no NaN and nlohmann writes
// a non-finite double as null, so null reads back as NaN. An optional is null or its value.
template <class T>
void read_value(const json& v, const std::string& what, T& out) {
  if constexpr (is_optional<T>::value) {
    out.reset();
    if (v.is_null()) return;
    typename T::value_type x{};
    read_value(v, what, x);
    out = std::move(x);
  } else if constexpr (is_vector<T>::value) {
    if (!v.is_array()) fail(what, "is " + type_of(v) + ", expected an array");
    out.clear();
    for (size_t k = 0; k < v.size(); ++k) {
      typename T::value_type x{};
      read_value(v[k], fmt::format("{}[{}]", what, k), x);
      out.push_back(std::move(x));
    }
  } else if constexpr (is_pair<T>::value) {  // a two-element array
    if (!v.is_array() || v.size() != 2) fail(what, "is " + type_of(v) + ", expected a pair");
    read_value(v[0], what + "[0]", out.first);
    read_value(v[1], what + "[1]", out.second);
  } else if constexpr (std::is_same_v<T, json>) {
    out = v;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) fail(what, "is " + type_of(v) + ", expected true or false");
    out = v.get<bool>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) fail(what, "is " + type_of(v) + ", expected a string");
    out = v.get<std::string>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) fail(what, "is " + type_of(v) + ", expected an integer");
    out = v.get<T>();
  } else {
    static_assert(std::is_floating_point_v<T>);
    if (v.is_null()) {
      out = std::numeric_limits<T>::quiet_NaN();
      return;
    }
    if (!v.is_number()) fail(what, "is " + type_of(v) + ", expected a number");
    out = v.get<T>();
  }
}

template <class T>
json write_value(const T& value) {
  if constexpr (is_optional<T>::value) {
    return value ? write_value(*value) : json(nullptr);
  } else if constexpr (is_vector<T>::value) {
    json out = json::array();
    for (const auto& x : value) out.push_back(write_value(x));
    return out;
  } else if constexpr (is_pair<T>::value) {
    return json::array({write_value(value.first), write_value(value.second)});
  } else {
    return json(value);
  }
}

/// The file's schema version ("schema_version", absent = 1); a newer one than this kiln reads is
/// refused.
inline int schema_version_of(const json& j) {
  if (!j.is_object() || !j.contains("schema_version")) return 1;
  int version = 0;
  read_value(j["schema_version"], "schema_version", version);
  if (version > kResultSchemaVersion) {
    fail("schema_version", fmt::format("is {}: written by a newer kiln (this one reads up to {})",
                                       version, kResultSchemaVersion));
  }
  return version;
}

// Reads a struct's field list from one JSON object.
class ReadIo {
 public:
  static constexpr bool kReading = true;
  ReadIo(const json& value, std::string path, int version)
      : value_(value), path_(std::move(path)), version_(version) {
    if (!value_.is_object())
      fail(path_.empty() ? "the file" : path_, "is " + type_of(value_) + ", expected an object");
  }
  int version() const { return version_; }
  bool contains(const char* key) const { return value_.contains(key); }
  bool has(const char* key) const { return contains(key) && !value_[key].is_null(); }

  /// A key every file has (an optional<T> one may be null: nothing to say).
  template <class T>
  void operator()(const char* key, T& value) const {
    read_value(at(key), name(key), value);
  }
  /// A key written only when there is something to say: absent or null is nullopt.
  template <class T>
  void opt(const char* key, std::optional<T>& value) const {
    value.reset();
    if (contains(key)) seen_.emplace_back(key);
    if (has(key)) read_value(value_[key], name(key), value);
  }
  /// A key added in schema version `since`: an older file may lack it (the default stays).
  template <class T>
  void since(int since, const char* key, T& value) const {
    if (version_ < since && !contains(key)) return;
    (*this)(key, value);
  }
  /// A key added to a file without a schema version of its own (the plan's: every key its
  /// readers did not read before the planner wrote through its struct): absent, the default
  /// stays; present, read strictly; always written.
  template <class T>
  void added(const char* key, T& value) const {
    if (contains(key)) (*this)(key, value);
  }
  template <class F>
  void added_object(const char* key, F&& fields) const {
    if (contains(key)) object(key, std::forward<F>(fields));
  }
  /// A key that may be absent or null, read as `fallback` then; always written.
  template <class T>
  void or_default(const char* key, T& value, const T& fallback) const {
    std::optional<T> read;
    opt(key, read);
    value = read.value_or(fallback);
  }
  template <class F>
  void object(const char* key, F&& fields) const {
    ReadIo sub(at(key), name(key), version_);
    fields(sub);
  }
  /// An object added in schema version `since`: an older file may lack it.
  template <class F>
  void since_object(int since, const char* key, F&& fields) const {
    if (version_ < since && !contains(key)) return;
    object(key, std::forward<F>(fields));
  }
  /// An object written only when there is something to say: absent or null is nullopt.
  template <class X, class F>
  void opt_object(const char* key, std::optional<X>& value, F&& fields) const {
    value.reset();
    if (contains(key)) seen_.emplace_back(key);
    if (!has(key)) return;
    ReadIo sub(value_[key], name(key), version_);
    X x{};
    fields(sub, x);
    value = std::move(x);
  }
  /// An object, or null when there is nothing to say.
  template <class X, class F>
  void nullable_object(const char* key, std::optional<X>& value, F&& fields) const {
    value.reset();
    if (at(key).is_null()) return;
    ReadIo sub(value_[key], name(key), version_);
    X x{};
    fields(sub, x);
    value = std::move(x);
  }
  /// The object's keys the field list did not read (another component's layout, kept whole):
  /// call it last. Written back by WriteIo::rest beside the typed keys.
  void rest(json& more) const {
    more = json::object();
    for (auto it = value_.begin(); it != value_.end(); ++it) {
      if (it.key() == "schema_version") continue;
      if (std::find(seen_.begin(), seen_.end(), it.key()) == seen_.end()) more[it.key()] = *it;
    }
  }
  template <class X, class F>
  void list(const char* key, std::vector<X>& items, F&& fields) const {
    const json& array = at(key);
    if (!array.is_array()) fail(name(key), "is " + type_of(array) + ", expected an array");
    items.clear();
    for (size_t k = 0; k < array.size(); ++k) {
      ReadIo sub(array[k], fmt::format("{}[{}]", name(key), k), version_);
      X x{};
      fields(sub, x);
      items.push_back(std::move(x));
    }
  }

 private:
  const json& at(const char* key) const {
    if (!value_.contains(key)) fail(name(key), "is missing");
    seen_.emplace_back(key);
    return value_[key];
  }
  std::string name(const char* key) const { return path_.empty() ? key : path_ + "." + key; }
  const json& value_;
  std::string path_;
  int version_;
  mutable std::vector<std::string> seen_;  // the keys read (rest() keeps the others)
};

// Writes a struct's field list into one JSON object: the same calls as ReadIo.
class WriteIo {
 public:
  static constexpr bool kReading = false;
  explicit WriteIo(json& out) : out_(out) { out_ = json::object(); }
  int version() const { return kResultSchemaVersion; }
  bool has(const char*) const { return true; }  // what is written is there

  template <class T>
  void operator()(const char* key, const T& value) const {
    out_[key] = write_value(value);
  }
  template <class T>
  void opt(const char* key, const std::optional<T>& value) const {
    if (value) out_[key] = write_value(*value);
  }
  template <class T>
  void since(int, const char* key, const T& value) const {
    (*this)(key, value);
  }
  template <class T>
  void or_default(const char* key, const T& value, const T&) const {
    (*this)(key, value);
  }
  template <class T>
  void added(const char* key, const T& value) const {
    (*this)(key, value);
  }
  template <class F>
  void added_object(const char* key, F&& fields) const {
    object(key, std::forward<F>(fields));
  }
  template <class F>
  void object(const char* key, F&& fields) const {
    json sub;
    WriteIo io(sub);
    fields(io);
    out_[key] = std::move(sub);
  }
  template <class F>
  void since_object(int, const char* key, F&& fields) const {
    object(key, std::forward<F>(fields));
  }
  template <class X, class F>
  void opt_object(const char* key, const std::optional<X>& value, F&& fields) const {
    if (!value) return;
    json sub;
    WriteIo io(sub);
    fields(io, const_cast<X&>(*value));  // WriteIo only reads it
    out_[key] = std::move(sub);
  }
  template <class X, class F>
  void nullable_object(const char* key, const std::optional<X>& value, F&& fields) const {
    if (!value) {
      out_[key] = nullptr;
      return;
    }
    json sub;
    WriteIo io(sub);
    fields(io, const_cast<X&>(*value));  // WriteIo only reads it
    out_[key] = std::move(sub);
  }
  /// The keys ReadIo::rest kept, beside the typed ones (a typed key wins).
  void rest(const json& more) const {
    if (!more.is_object()) return;
    for (auto it = more.begin(); it != more.end(); ++it) {
      if (!out_.contains(it.key())) out_[it.key()] = *it;
    }
  }
  template <class X, class F>
  void list(const char* key, const std::vector<X>& items, F&& fields) const {
    json array = json::array();
    for (const X& x : items) {
      json sub;
      WriteIo io(sub);
      fields(io, const_cast<X&>(x));  // WriteIo only reads it
      array.push_back(std::move(sub));
    }
    out_[key] = std::move(array);
  }

 private:
  json& out_;
};

/// from_json and to_json of a struct whose field list is `walk(Io&, T&)`.
template <class T, class Walk>
void read_fields(const json& j, T& value, Walk&& walk) {
  const int version = schema_version_of(j);
  const ReadIo io(j, "", version);
  T fresh;  // read whole into a new value (every field at its default first), then moved in
  walk(io, fresh);
  value = std::move(fresh);
}
template <class T, class Walk>
void write_fields(json& j, const T& value, Walk&& walk) {
  const WriteIo io(j);
  walk(io, const_cast<T&>(value));  // WriteIo only reads it
}

// from_json and to_json of T from its field list `fields(const Io&, T&)` (a function template).
#define KILN_RESULT_FIELDS(T, fields)                                    \
  void from_json(const json& j, T& value) {                              \
    read_fields(j, value, [](const auto& io, T& v) { fields(io, v); });  \
  }                                                                      \
  void to_json(json& j, const T& value) {                                \
    write_fields(j, value, [](const auto& io, T& v) { fields(io, v); }); \
  }

/// "matmul_peak" (kiln/plan.h to_json(MatmulPeak)): baseline.json and pilot.json.
template <class Io>
void matmul_peak_fields(const Io& io, MatmulPeakRecord& m) {
  io("flops_per_second", m.flops_per_second);
  io("m", m.m);
  io("n", m.n);
  io("k", m.k);
  io("dtype", m.dtype);
  io("median_seconds", m.median_seconds);
  io("repeats", m.repeats);
}

/// The status every rung file starts with. Returns whether the rung measured anything (the rest
/// of the field list follows): on reading, a file that passed or holds `anchor`. A rung that
/// stopped before measuring writes its reason as "verdict" (files before version 2: "reason").
/// With `verdict_inside`, a measured file keeps its verdict elsewhere (the profile's).
template <class Io>
bool status_fields(const Io& io, RungStatus& s, const char* anchor, bool verdict_inside = false) {
  if constexpr (Io::kReading) {
    s.schema_version = io.version();
    io("passed", s.passed);
    s.measured = s.passed || io.contains(anchor);
    if (!s.measured) {
      io(io.contains("verdict") ? "verdict" : "reason", s.verdict);
    } else if (!verdict_inside) {
      io("verdict", s.verdict);
    }
  } else {
    io("schema_version", kResultSchemaVersion);
    io("passed", s.passed);
    if (!s.measured || !verdict_inside) io("verdict", s.verdict);
  }
  return s.measured;
}

}  // namespace result_json

}  // namespace kiln
