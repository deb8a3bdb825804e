# Third-party libraries, all from Debian packages (scripts/setup installs them).
find_package(tomlplusplus REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY NAMES xxhash REQUIRED)
find_package(ZLIB REQUIRED)  # gzip of profiler traces
find_path(NETTLE_INCLUDE_DIR nettle/sha2.h REQUIRED)  # SHA-256 of model.init_from's weight files
find_library(NETTLE_LIBRARY NAMES nettle REQUIRED)
find_path(KAINJOW_MUSTACHE_INCLUDE_DIR kainjow/mustache.hpp REQUIRED)  # report.html's templates

# fmt: LibTorch ships its own fmt headers in its include directory, which shadow the system ones
# on the include path. We therefore use fmt header-only (FMT_HEADER_ONLY), so whichever headers
# the compiler finds are self-contained and nothing links against a mismatched libfmt.
add_library(kiln_deps INTERFACE)
target_link_libraries(kiln_deps INTERFACE tomlplusplus::tomlplusplus CLI11::CLI11
  ${XXHASH_LIBRARY} ZLIB::ZLIB ${NETTLE_LIBRARY})
target_include_directories(kiln_deps SYSTEM INTERFACE ${XXHASH_INCLUDE_DIR})
