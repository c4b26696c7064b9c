# cmake -DSOURCE=<cohort> -DWORK=<scratch folder> -P check.cmake
# Two fake NCCL installations: a system one on CMAKE_PREFIX_PATH with an unversioned
# libnccl.so (2.18.1), and a Python wheel's named by NCCL_ROOT with libnccl.so.2 only
# (2.28.9). FindNCCL must take header and library both from NCCL_ROOT's.
file(REMOVE_RECURSE "${WORK}")
function(fake_nccl prefix minor patch library)
  file(WRITE "${prefix}/include/nccl.h"
       "#define NCCL_MAJOR 2\n#define NCCL_MINOR ${minor}\n#define NCCL_PATCH ${patch}\n")
  file(WRITE "${prefix}/lib/${library}" "")
endfunction()
fake_nccl("${WORK}/system" 18 1 libnccl.so)
fake_nccl("${WORK}/wheel/nvidia/nccl" 28 9 libnccl.so.2)
execute_process(
  COMMAND ${CMAKE_COMMAND} -S "${SOURCE}/tests/find_nccl" -B "${WORK}/build"
          -DCOHORT_CMAKE_DIR=${SOURCE}/cmake -DCMAKE_PREFIX_PATH=${WORK}/system
          -DNCCL_ROOT=${WORK}/wheel/nvidia/nccl
  OUTPUT_VARIABLE output ERROR_VARIABLE errors RESULT_VARIABLE status)
message("${output}${errors}")
if(NOT status EQUAL 0)
  message(FATAL_ERROR "the probe failed to configure")
endif()
if(NOT output MATCHES "probe: NCCL_LIBRARY=${WORK}/wheel/nvidia/nccl/lib/libnccl.so.2")
  message(FATAL_ERROR "FindNCCL took the library from another installation than NCCL_ROOT's")
endif()
if(NOT output MATCHES "probe: NCCL_INCLUDE_DIR=${WORK}/wheel/nvidia/nccl/include" OR NOT output MATCHES "NCCL_VERSION=2.28.9")
  message(FATAL_ERROR "FindNCCL took the header from another installation than NCCL_ROOT's")
endif()
if(errors MATCHES "two installations")
  message(FATAL_ERROR "FindNCCL warned of two installations where it found one")
endif()
