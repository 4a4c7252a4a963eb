# Spack package recipe for mambamoe.
#
# This single file is the recipe; Spack only loads recipes from a package repository, so copy or
# symlink it to <root>/spack_repo/mambamoe/packages/mambamoe/package.py (steps in spack/spack.yaml).
#
# SPDX-License-Identifier: (Apache-2.0 OR MIT)

from spack_repo.builtin.build_systems.cmake import CMakePackage
from spack_repo.builtin.build_systems.cuda import CudaPackage

from spack.package import *


class Mambamoe(CMakePackage, CudaPackage):
    """mambamoe: a C++20 Kokkos application that trains and runs Mamba-family selective state-space
    models (Mamba-2 SSD scan) with mixture-of-experts layers on long sequences: DNA (FASTA, BGZF and
    VCF through htslib) and time series. CUDA is the primary backend, with OpenMP for CPU
    runs. It uses MPI for multi-process runs, NCCL (optional) for device-buffer collectives and
    HDF5 for checkpoints.

    Recipe style: the spack-packages layout introduced with Spack v1.0 (build systems imported
    from ``spack_repo.builtin.build_systems.*``), checked against spack/spack-packages 1e8cf059
    (2026-07), where kokkos, kokkos-kernels, arborx and cabana use it. Spack 0.x cannot load this
    import style.
    """

    # PLACEHOLDER: the project has no public home yet; replace both URLs before publishing.
    homepage = "https://example.invalid/mambamoe"  # PLACEHOLDER
    git = "https://example.invalid/mambamoe.git"  # PLACEHOLDER

    version("main", branch="main")

    # ------------------------------------------------------------------ variants
    # "cuda" and "cuda_arch" come from CudaPackage.
    variant("openmp", default=True, description="Use the Kokkos OpenMP backend for host execution")
    variant(
        "nccl",
        default=False,
        description="Use NCCL for collectives on device buffers (needs +cuda)",
    )
    variant("tests", default=False, description="Build the Catch2 test suite (run with ctest)")

    conflicts("+nccl", when="~cuda", msg="NCCL collectives need a CUDA build (+cuda)")
    conflicts(
        "cuda_arch=none",
        when="+cuda",
        msg="Set the GPU architecture, e.g. cuda_arch=90 for H100/H200",
    )

    # ------------------------------------------------------------------ build tools
    depends_on("c", type="build")  # project(... LANGUAGES C CXX)
    depends_on("cxx", type="build")
    depends_on("cmake@3.22:", type="build")

    # ------------------------------------------------------------------ Kokkos and Kokkos Kernels
    # The code is C++20 and needs Kokkos >= 4.6 (cmake/Dependencies.cmake). The upper bound is the
    # last release series it is tested with. CMake's find_package(Kokkos 4.6) also rejects 5.x.
    # Kokkos Kernels must come from the same release series as Kokkos, and Dependencies.cmake stops
    # on a major.minor mismatch. The builtin kokkos-kernels recipe already pins kokkos to its exact
    # version. The pin below also covers an external kokkos-kernels, which has no dependencies
    # in Spack.
    kokkos_series = ("4.6", "4.7")
    depends_on(f"kokkos@{kokkos_series[0]}:{kokkos_series[-1]} cxxstd=20")
    depends_on(f"kokkos-kernels@{kokkos_series[0]}:{kokkos_series[-1]}")
    for _series in kokkos_series:
        depends_on(f"kokkos-kernels@{_series}", when=f"^kokkos@{_series}")

    # The backends come from the Kokkos build (Kokkos_ENABLE_CUDA/OPENMP), so both directions are
    # pinned to keep the variants true.
    depends_on("kokkos+openmp", when="+openmp")
    depends_on("kokkos~openmp", when="~openmp")
    depends_on("kokkos~cuda", when="~cuda")

    with when("+cuda"):
        # +wrapper: mambamoe compiles with Kokkos' nvcc_wrapper (MAMBAMOE_USE_NVCC_WRAPPER). The
        # kokkos recipe also refuses +cuda without it unless the compiler is clang.
        # +cuda_lambda: on Kokkos 4 the recipe passes Kokkos_ENABLE_CUDA_LAMBDA from this
        # variant (default off). The code uses KOKKOS_LAMBDA in device kernels.
        depends_on("kokkos+cuda+cuda_lambda+wrapper")
        # GEMMs on the GPU call cuBLAS directly (CUDA::cublas). The cuBLAS TPL in Kokkos Kernels
        # keeps any KokkosBlas call on device views on cuBLAS too.
        depends_on("kokkos-kernels+cuda+cublas")
        depends_on("cuda@12:")

    # Kokkos builds for one GPU architecture at a time, so cuda_arch goes to it (and to NCCL)
    # as in arborx/cabana. A multi-valued cuda_arch here then fails to concretize, which is the
    # intent.
    for _arch in CudaPackage.cuda_arch_values:
        depends_on(f"kokkos+cuda cuda_arch={_arch}", when=f"+cuda cuda_arch={_arch}")
        depends_on(f"nccl cuda_arch={_arch}", when=f"+nccl cuda_arch={_arch}")

    # ------------------------------------------------------------------ other libraries
    depends_on("mpi")
    # Checkpoints use the HDF5 C API (find_package(HDF5 COMPONENTS C)): serial HDF5 (~mpi) is
    # enough and the high-level library (+hl) is not used, so neither is required here.
    depends_on("hdf5")
    depends_on("boost+program_options")
    depends_on("htslib")
    depends_on("nccl", when="+nccl")
    # tests/CMakeLists.txt prefers Catch2 v3 (a compiled library) and falls back to v2. Pulled in
    # with +tests, not as type="test", because MAMBAMOE_ENABLE_TESTS=ON needs it at configure time.
    depends_on("catch2@3:", when="+tests", type=("build", "link"))

    # NOTE: the project's CMakeLists.txt has no install() rules yet. Until it does, `spack install`
    # stops with "Nothing was installed" after a good build. `spack install --test=root` runs the
    # ctest suite (with +tests) before that point.

    def cmake_args(self):
        spec = self.spec
        args = [
            self.define("Kokkos_ROOT", spec["kokkos"].prefix),
            # nvcc_wrapper for +cuda (kokkos+wrapper), Spack's C++ compiler wrapper otherwise.
            self.define("CMAKE_CXX_COMPILER", self["kokkos"].kokkos_cxx),
            self.define_from_variant("MAMBAMOE_ENABLE_NCCL", "nccl"),
            self.define_from_variant("MAMBAMOE_ENABLE_TESTS", "tests"),
            self.define("MAMBAMOE_USE_NVCC_WRAPPER", spec.satisfies("+cuda")),
            self.define("MAMBAMOE_HTSLIB_ROOT", spec["htslib"].prefix),
            self.define("MPI_CXX_COMPILER", spec["mpi"].mpicxx),
        ]

        # Spack injects cxxflags through its compiler wrapper, and nvcc_wrapper/Kokkos' launch
        # compiler can lose them. Route them through CMAKE_CXX_FLAGS, as kokkos-kernels does.
        cxxflags = list(spec.compiler_flags["cxxflags"])
        if spec.satisfies("+cuda"):
            args.append(self.define("CUDAToolkit_ROOT", spec["cuda"].prefix))
            # nvcc_wrapper defaults to -arch=sm_70, which CUDA 13 rejects. Without an explicit arch,
            # CMake's compiler check fails before Kokkos adds its own flags. Use the (single) arch
            # Kokkos is built for.
            kokkos_arch = spec["kokkos"].variants["cuda_arch"].value
            cxxflags.append(f"-arch=sm_{kokkos_arch}")
        if cxxflags:
            args.append(self.define("CMAKE_CXX_FLAGS", " ".join(cxxflags)))

        if spec.satisfies("+nccl"):
            args.append(self.define("NCCL_ROOT", spec["nccl"].prefix))

        return args
