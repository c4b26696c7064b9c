# FindNCCL: locates NCCL's header and library, from one installation.
# Looks in NCCL_ROOT / $NCCL_ROOT / $NCCL_HOME first and alone, then the CUDA toolkit, then
# the system. Defines NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION and target
# NCCL::NCCL, and says which it found.
#
# Why the named roots are searched alone first: find_library walks every directory for its
# first name before trying the next, and CMAKE_PREFIX_PATH comes before HINTS, so a Python
# wheel's NCCL (which ships libnccl.so.2 and no unversioned link) named by NCCL_ROOT would
# lose its library to any libnccl.so on a default path while keeping its own nccl.h: a header
# of one version with a library of another links, and fails or misbehaves at run time.

set(_nccl_roots ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
if(_nccl_roots)
  find_path(NCCL_INCLUDE_DIR nccl.h PATHS ${_nccl_roots} PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR PATHS ${_nccl_roots}
               PATH_SUFFIXES lib64 lib NO_DEFAULT_PATH)
endif()
set(_nccl_hints)
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()
list(APPEND _nccl_hints /usr/local/cuda)
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
# libnccl.so.2 too: the Python wheel (nvidia-nccl-*) ships no unversioned link.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_hints} PATH_SUFFIXES lib64 lib)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _m "${_nccl_lines}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
                                  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND)
  # One installation: the header's prefix is the library's (lib/<multiarch> counts as lib).
  get_filename_component(_nccl_header_root "${NCCL_INCLUDE_DIR}" DIRECTORY)
  get_filename_component(_nccl_library_dir "${NCCL_LIBRARY}" DIRECTORY)
  get_filename_component(_nccl_library_root "${_nccl_library_dir}" DIRECTORY)
  get_filename_component(_nccl_library_parent "${_nccl_library_root}" NAME)
  if(_nccl_library_parent STREQUAL "lib")
    get_filename_component(_nccl_library_root "${_nccl_library_root}" DIRECTORY)
  endif()
  get_filename_component(_nccl_header_root "${_nccl_header_root}" REALPATH)
  get_filename_component(_nccl_library_root "${_nccl_library_root}" REALPATH)
  if(NOT _nccl_header_root STREQUAL _nccl_library_root)
    message(WARNING "NCCL: nccl.h ${NCCL_VERSION} from ${NCCL_INCLUDE_DIR} but the library from "
                    "${NCCL_LIBRARY}: two installations. Set NCCL_ROOT to the one to use (and clear "
                    "NCCL_INCLUDE_DIR and NCCL_LIBRARY from the cache).")
  endif()
  if(NOT NCCL_FIND_QUIETLY)
    message(STATUS "NCCL ${NCCL_VERSION}: header ${NCCL_INCLUDE_DIR}/nccl.h, library ${NCCL_LIBRARY}")
  endif()
endif()

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
