// The [compile] section parsed once into CompileOptions.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "core/strings.h"
#include "kiln/build_info.h"
#include "kiln/compile.h"
#include "kiln/config.h"
#include "kiln/error.h"
#include "kiln/models.h"

namespace kiln {

namespace {

std::filesystem::path default_cache_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    return std::filesystem::path(xdg) / "kiln" / "compile";
  }
  if (const char* home = std::getenv("HOME"); home && *home) {
    return std::filesystem::path(home) / ".cache" / "kiln" / "compile";
  }
  return std::filesystem::temp_directory_path() / "kiln-compile-cache";
}

}  // namespace

std::optional<std::vector<int64_t>> parse_probe_seq_lens(const std::string& text) {
  const std::string_view all = trim(text);
  if (all.empty()) return std::nullopt;
  std::vector<int64_t> out;
  if (all == "none") return out;
  size_t begin = 0;
  while (begin <= all.size()) {
    size_t end = all.find(',', begin);
    if (end == std::string_view::npos) end = all.size();
    const std::string item(trim(all.substr(begin, end - begin)));
    char* stop = nullptr;
    const long long value = item.empty() ? 0 : std::strtoll(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || value < 1) {
      throw UserError(fmt::format(
          "compile.probe_seq_lens = \"{}\": \"{}\" is not a positive integer; write lengths "
          "separated by commas (\"8,4\"), \"\" for data.seq_len/2 and /4, or \"none\"",
          text, item));
    }
    out.push_back(value);
    begin = end + 1;
  }
  return out;
}

double default_compile_tolerance(TrainOptions::Precision precision) {
  switch (precision) {
    case TrainOptions::Precision::kFp32:
      return 1e-4;
    case TrainOptions::Precision::kBf16Mixed:
      return 2e-2;
    case TrainOptions::Precision::kFp16Mixed:
      return 5e-3;
  }
  return 1e-4;
}

const char* backend_name(CompileOptions::Backend backend) {
  switch (backend) {
    case CompileOptions::Backend::kEager:
      return "eager";
    case CompileOptions::Backend::kInductor:
      return "inductor";
    case CompileOptions::Backend::kCudaGraphs:
      return "cudagraphs";
    case CompileOptions::Backend::kInductorCudaGraphs:
      return "inductor+cudagraphs";
  }
  return "?";
}

const char* dynamic_name(CompileOptions::Dynamic dynamic) {
  switch (dynamic) {
    case CompileOptions::Dynamic::kAuto:
      return "auto";
    case CompileOptions::Dynamic::kDynamic:
      return "dynamic";
    case CompileOptions::Dynamic::kStatic:
      return "static";
  }
  return "?";
}

const char* granularity_name(CompileOptions::Granularity granularity) {
  return granularity == CompileOptions::Granularity::kUnit ? "unit" : "step";
}

CompileOptions CompileOptions::from_config(const Config& config) {
  using B = Backend;
  using D = Dynamic;
  CompileOptions o;
  o.backend =
      config.get_enum<B>("compile.backend", {{"eager", B::kEager},
                                             {"inductor", B::kInductor},
                                             {"cudagraphs", B::kCudaGraphs},
                                             {"inductor+cudagraphs", B::kInductorCudaGraphs}});
  o.dynamic = config.get_enum<D>(
      "compile.dynamic", {{"auto", D::kAuto}, {"dynamic", D::kDynamic}, {"static", D::kStatic}});
  o.granularity = compiles_per_unit(config) ? CompileOptions::Granularity::kUnit
                                            : CompileOptions::Granularity::kStep;
  o.fullgraph = config.get_bool("compile.fullgraph");
  o.recompile_limit = static_cast<int>(config.get_int("compile.recompile_limit"));
  const int64_t jobs = config.get_int("compile.jobs");
  o.jobs = jobs > 0 ? static_cast<int>(jobs)
                    : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const auto probe = parse_probe_seq_lens(config.get_string("compile.probe_seq_lens"));
  if (probe) {
    o.probe_seq_lens = *probe;
  } else {
    const int64_t seq_len = model_takes_tokens(config) ? config.get_int("data.seq_len") : 0;
    for (int64_t divisor : {2, 4}) {
      if (seq_len / divisor >= 2) o.probe_seq_lens.push_back(seq_len / divisor);
    }
  }
  const double tolerance = config.get_float("compile.tolerance");
  o.tolerance_configured = tolerance > 0;
  o.root = config.get_bool("compile.root");
  o.tolerance = tolerance > 0
                    ? tolerance
                    : default_compile_tolerance(TrainOptions::from_config(config).precision);
  o.min_speedup = config.get_float("compile.min_speedup");
  o.warmup_steps = config.get_int("compile.warmup_steps");
  o.steps = config.get_int("compile.steps");
  const std::string& cache = config.get_string("compile.cache_dir");
  o.cache_dir =
      std::filesystem::absolute(cache.empty() ? default_cache_dir() : std::filesystem::path(cache));
  o.python = config.get_string("compile.python");
  if (o.python.empty()) {
    if (const char* env = std::getenv("KILN_PYTHON"); env && *env) o.python = env;
  }
  if (o.python.empty()) o.python = *build_info().python ? build_info().python : "python3";
  return o;
}

}  // namespace kiln
