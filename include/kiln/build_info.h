// What this kiln binary was built from. Filled in at build time (cmake/KilnBuildInfo.cmake).
#pragma once

namespace kiln {

struct BuildInfo {
  const char* version;      // kiln's project version, e.g. "0.1.0"
  const char* git_commit;   // full commit hash of the source tree, or "unknown"
  bool git_dirty;           // true when tracked files differed from that commit at build time
  const char* compiler;     // e.g. "GNU 12.2.0"
  const char* build_type;   // CMAKE_BUILD_TYPE
  const char* build_flags;  // C++ flags of that build type, plus LibTorch's
  const char* torch_dir;    // where CMake found LibTorch
  const char* python;       // the Python whose torch LibTorch came from (KILN_PYTHON), or ""
  const char* python_dir;   // <source>/python: the kiln_py package (compiling, model twins)
};

/// The build this process runs. Thread-safe; never fails.
const BuildInfo& build_info();

}  // namespace kiln
