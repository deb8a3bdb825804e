// Small text helpers shared inside the library (not part of the public API).
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

/// An exception's message as one line for users: LibTorch errors without their C++ backtrace,
/// line breaks folded into "; ".
std::string one_line_error(const std::exception& error);
/// Levenshtein distance.
size_t edit_distance(std::string_view a, std::string_view b);
/// Strips ASCII whitespace at both ends.
std::string_view trim(std::string_view text);
/// Shortest decimal text that round-trips a double ("0.001", "3e-04" style not used).
std::string format_number(double value);
/// A TOML basic string literal: `"`, `\` and the control characters U+0000-U+001F and U+007F
/// escaped (short escapes where TOML has them, else \uXXXX); other bytes copied as they are.
std::string toml_quote(std::string_view text);
/// 16 lowercase hex digits.
std::string hex64(uint64_t value);
/// "1.50 GiB", "12.0 MiB", "512 B".
std::string format_bytes(double bytes);
/// "1h02m", "3m05s", "12.3s", and "1.6ms" under 0.1 s.
std::string format_duration(double seconds);

/// "[4, 3]": a shape for messages and listings.
std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace kiln
