# cohort_add_compiled_library(<name>): cohort's non-template code compiled once, for a program
# whose translation units would otherwise each compile it (see cohort/detail/config.hpp).
#
#   cohort_add_compiled_library(cohort_impl)
#   target_link_libraries(trainer PRIVATE cohort_impl)   # instead of cohort::gloo / cohort::nccl
#
# The library defines COHORT_SEPARATE_COMPILATION for everything that links it, so those
# translation units see declarations only; it brings the backends whose targets exist
# (cohort::gloo, cohort::nccl) and compiles their code too. Every translation unit of the
# program that includes cohort must link it (mixing modes breaks the one-definition rule).
#
# With cohort::nccl and the CUDA language enabled, the library also compiles the device
# backend's kernels, once, in a .cu of its own, and defines COHORT_SEPARATE_DEVICE_CODE: the
# program's translation units then launch them through declarations, need not be .cu files
# to use the algorithms on NCCL, and instantiate no cohort kernel.
function(cohort_add_compiled_library name)
  set(source "${CMAKE_CURRENT_BINARY_DIR}/${name}_cohort_src.cpp")
  file(CONFIGURE OUTPUT "${source}" CONTENT "#include <cohort/impl/src.hpp>\n" @ONLY)
  add_library(${name} STATIC "${source}")
  target_compile_definitions(${name} PUBLIC COHORT_SEPARATE_COMPILATION=1)
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  if(TARGET cohort::gloo)
    target_link_libraries(${name} PUBLIC cohort::gloo)
  endif()
  if(TARGET cohort::nccl)
    target_link_libraries(${name} PUBLIC cohort::nccl)
    get_property(languages GLOBAL PROPERTY ENABLED_LANGUAGES)
    if("CUDA" IN_LIST languages)
      set(device_source "${CMAKE_CURRENT_BINARY_DIR}/${name}_cohort_device.cu")
      file(CONFIGURE OUTPUT "${device_source}" CONTENT "#include <cohort/impl/device_src.cuh>\n" @ONLY)
      target_sources(${name} PRIVATE "${device_source}")
      target_compile_definitions(${name} PUBLIC COHORT_SEPARATE_DEVICE_CODE=1)
    endif()
  endif()
  if(NOT TARGET cohort::gloo AND NOT TARGET cohort::nccl)
    target_link_libraries(${name} PUBLIC cohort::cohort)
  endif()
endfunction()
