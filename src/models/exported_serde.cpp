// torch/_export/serde/schema.py's enums and size expressions, read into c10's
// (models/exported_graph_parts.h).
#include <cctype>

#include "models/exported_graph_parts.h"

namespace kiln::graph_parts {

// torch/_export/serde/schema.py's enums, to c10's.
std::optional<c10::ScalarType> serde_scalar_type(int64_t v) {
  using S = c10::ScalarType;
  switch (v) {
    case 1:
      return S::Byte;
    case 2:
      return S::Char;
    case 3:
      return S::Short;
    case 4:
      return S::Int;
    case 5:
      return S::Long;
    case 6:
      return S::Half;
    case 7:
      return S::Float;
    case 8:
      return S::Double;
    case 9:
      return S::ComplexHalf;
    case 10:
      return S::ComplexFloat;
    case 11:
      return S::ComplexDouble;
    case 12:
      return S::Bool;
    case 13:
      return S::BFloat16;
    case 28:
      return S::UInt16;
    case 29:
      return S::Float8_e4m3fn;
    case 30:
      return S::Float8_e5m2;
    case 31:
      return S::Float8_e4m3fnuz;
    case 32:
      return S::Float8_e5m2fnuz;
    case 34:
      return S::UInt32;
    case 35:
      return S::UInt64;
    default:
      return std::nullopt;
  }
}

std::optional<c10::Layout> serde_layout(int64_t v) {
  switch (v) {
    case 1:
      return c10::Layout::Sparse;
    case 2:
      return c10::Layout::SparseCsr;
    case 3:
      return c10::Layout::SparseCsc;
    case 4:
      return c10::Layout::SparseBsr;
    case 5:
      return c10::Layout::SparseBsc;
    case 6:
      return c10::Layout::Mkldnn;
    case 7:
      return c10::Layout::Strided;
    default:
      return std::nullopt;
  }
}

std::optional<c10::MemoryFormat> serde_memory_format(int64_t v) {
  switch (v) {
    case 1:
      return c10::MemoryFormat::Contiguous;
    case 2:
      return c10::MemoryFormat::ChannelsLast;
    case 3:
      return c10::MemoryFormat::ChannelsLast3d;
    case 4:
      return c10::MemoryFormat::Preserve;
    default:
      return std::nullopt;
  }
}

// The symbol a size expression is, or "" for an expression of symbols: "s95" or
// "Symbol('s95', positive=True, integer=True)".
std::string bare_symbol(const std::string& expr) {
  std::string s = expr;
  if (s.rfind("Symbol('", 0) == 0) {
    const size_t end = s.find('\'', 8);
    return end == std::string::npos ? "" : s.substr(8, end - 8);
  }
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return "";
  }
  return s;
}

}  // namespace kiln::graph_parts
