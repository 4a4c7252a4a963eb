# Third-party packages. Everything is found with find_package; htslib and Boost.Program_options may also be
# given by path (MAMBAMOE_HTSLIB_ROOT, MAMBAMOE_BOOST_PO_LIBRARY) for machines that have no packaged build.

# ---------------------------------------------------------------- Kokkos and Kokkos Kernels (same major.minor)
# Kokkos Kernels provides the host GEMMs (KokkosBlas); a CUDA build calls cuBLAS instead and uses it only if found.
find_package(Kokkos 4.6 REQUIRED CONFIG)
if(Kokkos_ENABLE_CUDA)
  find_package(KokkosKernels CONFIG QUIET HINTS ${Kokkos_ROOT} ${Kokkos_DIR}/../../..)
else()
  find_package(KokkosKernels REQUIRED CONFIG HINTS ${Kokkos_ROOT} ${Kokkos_DIR}/../../..)
endif()
if(KokkosKernels_FOUND)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" _kk_mm "${KokkosKernels_VERSION}")
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" _k_mm "${Kokkos_VERSION}")
  if(NOT _kk_mm STREQUAL _k_mm)
    message(FATAL_ERROR "Kokkos ${Kokkos_VERSION} and Kokkos Kernels ${KokkosKernels_VERSION} differ in version: "
                        "install matching releases (spack install kokkos@X kokkos-kernels@X)")
  endif()
endif()

set(MAMBAMOE_HAVE_CUDA OFF)
set(MAMBAMOE_HAVE_OPENMP OFF)
if(Kokkos_ENABLE_CUDA)
  set(MAMBAMOE_HAVE_CUDA ON)
endif()
if(Kokkos_ENABLE_OPENMP)
  set(MAMBAMOE_HAVE_OPENMP ON)
endif()

# ---------------------------------------------------------------- CUDA toolkit, cuBLAS, the CUDA 13 shim, NCCL
set(MAMBAMOE_CUDA13_COMPAT OFF)
if(MAMBAMOE_HAVE_CUDA)
  find_package(CUDAToolkit REQUIRED)
  # Kokkos < 4.7 calls three runtime functions with their pre-13 signatures; see cmake/cuda13_kokkos46_compat.h.
  if(CUDAToolkit_VERSION VERSION_GREATER_EQUAL 13.0 AND Kokkos_VERSION VERSION_LESS 4.7)
    set(MAMBAMOE_CUDA13_COMPAT ON)
  endif()
endif()

# NCCL: looked for in CUDA builds under MAMBAMOE_NCCL_ROOT / NCCL_ROOT (CMake or environment), NCCL_HOME, the CUDA
# toolkit and the system paths. MAMBAMOE_ENABLE_NCCL defaults to ON when it is found (the cache keeps a value given
# with -D, or an earlier configure's).
set(MAMBAMOE_NCCL_ROOT "" CACHE PATH "Prefix of an NCCL install (include/nccl.h, lib/libnccl.so)")
set(_nccl_found OFF)
if(MAMBAMOE_HAVE_CUDA)
  set(_nccl_roots ${MAMBAMOE_NCCL_ROOT} ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
  set(_nccl_inc_hints ${CUDAToolkit_INCLUDE_DIRS})
  set(_nccl_lib_hints ${CUDAToolkit_LIBRARY_DIR})
  foreach(_r ${_nccl_roots})
    list(PREPEND _nccl_inc_hints ${_r}/include)
    list(PREPEND _nccl_lib_hints ${_r}/lib ${_r}/lib64)
  endforeach()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_inc_hints})
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_lib_hints})
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(_nccl_found ON)
  endif()
endif()
option(MAMBAMOE_ENABLE_NCCL "NCCL communicator backend (parallel.backend = nccl; CUDA builds)" ${_nccl_found})
if(MAMBAMOE_ENABLE_NCCL)
  if(NOT MAMBAMOE_HAVE_CUDA)
    message(FATAL_ERROR "MAMBAMOE_ENABLE_NCCL=ON needs a Kokkos built with CUDA")
  endif()
  if(NOT _nccl_found)
    message(FATAL_ERROR "NCCL not found (looked for nccl.h and libnccl under MAMBAMOE_NCCL_ROOT, NCCL_ROOT, "
                        "NCCL_HOME, the CUDA toolkit and the system paths): set MAMBAMOE_NCCL_ROOT or turn "
                        "MAMBAMOE_ENABLE_NCCL off")
  endif()
  add_library(mambamoe::nccl UNKNOWN IMPORTED)
  set_target_properties(mambamoe::nccl PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                                                  INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
  message(STATUS "NCCL: ${NCCL_LIBRARY} (headers ${NCCL_INCLUDE_DIR})")
endif()

# ---------------------------------------------------------------- MPI, HDF5
find_package(MPI REQUIRED COMPONENTS CXX)
find_package(HDF5 REQUIRED COMPONENTS C)

# ---------------------------------------------------------------- Boost.Program_options
if(MAMBAMOE_BOOST_PO_LIBRARY)
  if(NOT EXISTS "${MAMBAMOE_BOOST_PO_LIBRARY}")
    message(FATAL_ERROR "MAMBAMOE_BOOST_PO_LIBRARY=${MAMBAMOE_BOOST_PO_LIBRARY} does not exist")
  endif()
  add_library(mambamoe::program_options UNKNOWN IMPORTED)
  set_target_properties(mambamoe::program_options PROPERTIES IMPORTED_LOCATION ${MAMBAMOE_BOOST_PO_LIBRARY})
  # Boost's headers: its CMake package where installed, else the directory that holds boost/program_options.hpp.
  find_package(Boost QUIET CONFIG)
  if(TARGET Boost::headers)
    target_link_libraries(mambamoe::program_options INTERFACE Boost::headers)
  else()
    find_path(MAMBAMOE_BOOST_INCLUDE_DIR boost/program_options.hpp HINTS ${BOOST_ROOT}/include)
    if(NOT MAMBAMOE_BOOST_INCLUDE_DIR)
      message(FATAL_ERROR "Boost headers not found: set BOOST_ROOT or MAMBAMOE_BOOST_INCLUDE_DIR")
    endif()
    set_target_properties(mambamoe::program_options PROPERTIES INTERFACE_INCLUDE_DIRECTORIES
                                                               ${MAMBAMOE_BOOST_INCLUDE_DIR})
  endif()
else()
  find_package(Boost REQUIRED COMPONENTS program_options)
  add_library(mambamoe::program_options INTERFACE IMPORTED)
  target_link_libraries(mambamoe::program_options INTERFACE Boost::program_options)
endif()

# ---------------------------------------------------------------- htslib (FASTA, BGZF, VCF)
if(MAMBAMOE_HTSLIB_ROOT)
  find_path(HTSLIB_INCLUDE_DIR htslib/hts.h PATHS ${MAMBAMOE_HTSLIB_ROOT}/include ${MAMBAMOE_HTSLIB_ROOT}
            NO_DEFAULT_PATH)
  find_library(HTSLIB_LIBRARY NAMES hts PATHS ${MAMBAMOE_HTSLIB_ROOT}/lib ${MAMBAMOE_HTSLIB_ROOT} NO_DEFAULT_PATH)
else()
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(PC_HTSLIB QUIET htslib)
  endif()
  find_path(HTSLIB_INCLUDE_DIR htslib/hts.h HINTS ${PC_HTSLIB_INCLUDE_DIRS})
  find_library(HTSLIB_LIBRARY NAMES hts HINTS ${PC_HTSLIB_LIBRARY_DIRS})
endif()
if(NOT HTSLIB_INCLUDE_DIR OR NOT HTSLIB_LIBRARY)
  message(FATAL_ERROR "htslib not found: install it (apt-get install libhts-dev, spack install htslib) "
                      "or set MAMBAMOE_HTSLIB_ROOT to its prefix")
endif()
add_library(mambamoe::htslib UNKNOWN IMPORTED)
set_target_properties(mambamoe::htslib PROPERTIES IMPORTED_LOCATION ${HTSLIB_LIBRARY}
                                                  INTERFACE_INCLUDE_DIRECTORIES ${HTSLIB_INCLUDE_DIR})
if(HTSLIB_LIBRARY MATCHES "\\.a$")
  # A static htslib (built by hand, e.g. with bz2/lzma/curl off) brings its own dependencies: zlib, libm, threads.
  find_package(ZLIB REQUIRED)
  find_package(Threads REQUIRED)
  target_link_libraries(mambamoe::htslib INTERFACE ZLIB::ZLIB m Threads::Threads)
endif()
