#include "core/strings.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <vector>

namespace kiln {

std::string one_line_error(const std::exception& error) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  std::string text = torch_error ? torch_error->what_without_backtrace() : error.what();
  std::string out;
  for (char c : std::string(trim(text))) {
    if (c == '\n') {
      if (!out.empty() && out.back() != ' ') out += "; ";
    } else if (c != '\r') {
      out += c;
    }
  }
  return out;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string_view trim(std::string_view text) {
  const char* space = " \t\r\n";
  size_t begin = text.find_first_not_of(space);
  if (begin == std::string_view::npos) return {};
  size_t end = text.find_last_not_of(space);
  return text.substr(begin, end - begin + 1);
}

std::string format_number(double value) {
  char buffer[64];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  if (ec != std::errc()) return std::to_string(value);
  return std::string(buffer, end);
}

std::string toml_quote(std::string_view text) {
  // TOML basic strings may hold any Unicode except '"', '\\' and the control characters U+0000 to
  // U+001F and U+007F, which must be escaped (tab may stay, but is escaped too for clarity).
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default: {
        const auto byte = static_cast<unsigned char>(c);
        if (byte < 0x20 || byte == 0x7f) {
          out += fmt::format("\\u{:04X}", static_cast<unsigned>(byte));
        } else {
          out += c;
        }
      }
    }
  }
  return out + "\"";
}

std::string hex64(uint64_t value) {
  char buffer[17];
  std::snprintf(buffer, sizeof(buffer), "%016llx", static_cast<unsigned long long>(value));
  return buffer;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (std::fabs(bytes) >= 1024.0 && unit < 4) bytes /= 1024.0, ++unit;
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), unit == 0 ? "%.0f %s" : "%.2f %s", bytes, units[unit]);
  return buffer;
}

std::string format_duration(double seconds) {
  char buffer[32];
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  if (seconds > 0 && seconds < 0.1) {  // a planned step on many GPUs: milliseconds, not "0.0s"
    std::snprintf(buffer, sizeof(buffer), "%.2gms", 1e3 * seconds);
  } else if (seconds < 60) {
    std::snprintf(buffer, sizeof(buffer), "%.1fs", seconds);
  } else if (seconds < 3600) {
    int s = static_cast<int>(seconds);
    std::snprintf(buffer, sizeof(buffer), "%dm%02ds", s / 60, s % 60);
  } else {
    int s = static_cast<int>(seconds);
    std::snprintf(buffer, sizeof(buffer), "%dh%02dm", s / 3600, (s % 3600) / 60);
  }
  return buffer;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t k = 0; k < shape.size(); ++k) out += (k ? ", " : "") + std::to_string(shape[k]);
  return out + "]";
}

}  // namespace kiln
