# Locate LibTorch. Order:
#   1. Torch_DIR or CMAKE_PREFIX_PATH given by the user (their own LibTorch);
#   2. the torch package of KILN_PYTHON (default: <source>/.venv/bin/python, then python3),
#      through torch.utils.cmake_prefix_path.
if(NOT Torch_DIR AND NOT DEFINED ENV{Torch_DIR})
  find_package(Torch QUIET CONFIG)
  if(NOT Torch_FOUND)
    if(NOT KILN_PYTHON)
      if(EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python")
        set(KILN_PYTHON "${CMAKE_CURRENT_SOURCE_DIR}/.venv/bin/python")
      else()
        find_program(KILN_PYTHON NAMES python3 python)
      endif()
    endif()
    execute_process(
      COMMAND "${KILN_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _kiln_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _kiln_torch_rc ERROR_QUIET)
    if(NOT _kiln_torch_rc EQUAL 0 OR NOT _kiln_torch_prefix)
      message(FATAL_ERROR
        "kiln: LibTorch not found. Run scripts/setup (creates .venv with torch), or pass "
        "-DTorch_DIR=<libtorch>/share/cmake/Torch, or -DKILN_PYTHON=<python with torch>.")
    endif()
    list(APPEND CMAKE_PREFIX_PATH "${_kiln_torch_prefix}")
  endif()
endif()
find_package(Torch REQUIRED CONFIG)
message(STATUS "kiln: LibTorch ${Torch_VERSION} from ${Torch_DIR}")
# Torch adds its ABI flag through TORCH_CXX_FLAGS; carry it as a compile option on our targets.
separate_arguments(KILN_TORCH_COMPILE_OPTIONS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
