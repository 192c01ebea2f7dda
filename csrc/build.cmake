# Reads csrc/build.json, the one build definition that setup.py reads too, into CMake variables:
#   DLLM_FAST_CXX_STANDARD, DLLM_FAST_CUDA_ARCHITECTURES (CMake's form: "80-real;90", the newest as SASS and
#   PTX), DLLM_FAST_INCLUDE_DIRS, DLLM_FAST_SOURCES_CPU, DLLM_FAST_SOURCES_CUDA (sorted, relative to the
#   repository root), DLLM_FAST_CXX_FLAGS, DLLM_FAST_NVCC_FLAGS, DLLM_FAST_LINK_FLAGS.
# `cmake -P csrc/build.cmake` prints them (python_tests/test_build_definition.py compares them with setup.py's).
if(CMAKE_SCRIPT_MODE_FILE)
  cmake_minimum_required(VERSION 3.19)  # string(JSON)
endif()

get_filename_component(DLLM_FAST_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
file(READ "${DLLM_FAST_ROOT}/csrc/build.json" DLLM_FAST_BUILD_JSON)

# A JSON array of strings at the given keys, as a CMake list.
function(dllm_fast_json_list out)
  string(JSON count LENGTH "${DLLM_FAST_BUILD_JSON}" ${ARGN})
  set(items "")
  if(count GREATER 0)
    math(EXPR last "${count} - 1")
    foreach(i RANGE ${last})
      string(JSON item GET "${DLLM_FAST_BUILD_JSON}" ${ARGN} ${i})
      list(APPEND items "${item}")
    endforeach()
  endif()
  set(${out} "${items}" PARENT_SCOPE)
endfunction()

# The files matching the globs of a source list, sorted, relative to the repository root.
function(dllm_fast_sources out kind)
  dllm_fast_json_list(patterns sources ${kind})
  set(files "")
  foreach(pattern IN LISTS patterns)
    file(GLOB matched RELATIVE "${DLLM_FAST_ROOT}" "${DLLM_FAST_ROOT}/${pattern}")
    list(SORT matched)
    list(APPEND files ${matched})
  endforeach()
  set(${out} "${files}" PARENT_SCOPE)
endfunction()

string(JSON DLLM_FAST_CXX_STANDARD GET "${DLLM_FAST_BUILD_JSON}" cxx_standard)
dllm_fast_json_list(DLLM_FAST_INCLUDE_DIRS include_dirs)
dllm_fast_json_list(DLLM_FAST_CXX_FLAGS cxx_flags)
dllm_fast_json_list(DLLM_FAST_NVCC_FLAGS nvcc_flags)
dllm_fast_json_list(DLLM_FAST_LINK_FLAGS link_flags)
dllm_fast_sources(DLLM_FAST_SOURCES_CPU cpu)
dllm_fast_sources(DLLM_FAST_SOURCES_CUDA cuda)

dllm_fast_json_list(architectures cuda_architectures)
list(POP_BACK architectures newest)
set(DLLM_FAST_CUDA_ARCHITECTURES "")
foreach(arch IN LISTS architectures)
  string(REPLACE "." "" arch "${arch}")
  list(APPEND DLLM_FAST_CUDA_ARCHITECTURES "${arch}-real")
endforeach()
string(REPLACE "." "" newest "${newest}")
list(APPEND DLLM_FAST_CUDA_ARCHITECTURES "${newest}")  # no suffix: SASS and PTX

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  foreach(name CXX_STANDARD CUDA_ARCHITECTURES INCLUDE_DIRS SOURCES_CPU SOURCES_CUDA CXX_FLAGS NVCC_FLAGS LINK_FLAGS)
    message(NOTICE "${name}=${DLLM_FAST_${name}}")
  endforeach()
endif()
