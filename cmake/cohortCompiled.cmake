# cohort_add_compiled_library(<name>): cohort's non-template code compiled once, for a program
# whose translation units would otherwise each compile it (see cohort/config.hpp).
#
#   cohort_add_compiled_library(cohort_impl)
#   target_link_libraries(trainer PRIVATE cohort_impl)
#
# cohort::gloo and cohort::nccl are such a library already (cohort's own, built with cohort);
# this makes one with the project's own compiler and flags (a sanitized build, say).
# The library defines COHORT_SEPARATE_COMPILATION for everything that links it, so those
# translation units see declarations only; it brings the backends whose targets exist
# (cohort::header_only_gloo, cohort::header_only_nccl) and compiles their code too. Every translation unit of the
# program that includes cohort must link it (mixing modes breaks the one-definition rule).
#
# With cohort::nccl the library also compiles the device backend's kernels, once, in a .cu of
# its own (cohort/src.cu; the project must enable CUDA): the program's translation units then
# launch them through declarations, need not be .cu files to use the algorithms on NCCL, and
# instantiate no cohort kernel.
#
# cohort/src.hpp is compiled as its four parts (cohort/impl/src_*.hpp), four units that a
# machine's idle cores compile side by side: as one unit it was the longest of the build, which
# every program that links the library waited for.
function(cohort_add_compiled_library name)
  set(sources "")
  foreach(part comm parallel rendezvous templates)
    set(source "${CMAKE_CURRENT_BINARY_DIR}/${name}_cohort_src_${part}.cpp")
    file(CONFIGURE OUTPUT "${source}" CONTENT "#include <cohort/impl/src_${part}.hpp>\n" @ONLY)
    list(APPEND sources "${source}")
  endforeach()
  add_library(${name} STATIC ${sources})
  target_compile_definitions(${name} PUBLIC COHORT_SEPARATE_COMPILATION=1)
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  if(TARGET cohort::header_only_gloo)
    target_link_libraries(${name} PUBLIC cohort::header_only_gloo)
  endif()
  if(TARGET cohort::header_only_nccl)
    target_link_libraries(${name} PUBLIC cohort::header_only_nccl)
    get_property(languages GLOBAL PROPERTY ENABLED_LANGUAGES)
    if(NOT "CUDA" IN_LIST languages)
      message(FATAL_ERROR "cohort_add_compiled_library(${name}): with cohort::nccl the library compiles "
                          "cohort's kernels once, with nvcc (cohort/src.cu); enable CUDA first: "
                          "project(... LANGUAGES CXX CUDA) or enable_language(CUDA)")
    endif()
    set(device_source "${CMAKE_CURRENT_BINARY_DIR}/${name}_cohort_device.cu")
    file(CONFIGURE OUTPUT "${device_source}" CONTENT "#include <cohort/src.cu>\n" @ONLY)
    target_sources(${name} PRIVATE "${device_source}")
  endif()
  if(NOT TARGET cohort::header_only_gloo AND NOT TARGET cohort::header_only_nccl)
    target_link_libraries(${name} PUBLIC cohort::cohort)
  endif()
endfunction()
