// CUDA 13 compatibility shim for Kokkos 4.6 (force-included with `-include`).
//
// CUDA 13.0 changed three runtime signatures that Kokkos 4.6's CUDA backend still calls the old way:
//   cudaGraphAddDependencies  gained a `const cudaGraphEdgeData*` argument (nullptr = default edges);
//   cudaMemAdvise             takes a `cudaMemLocation` instead of a device ordinal;
//   cudaMemPrefetchAsync      takes a `cudaMemLocation` and a flags word instead of a device ordinal.
// Supplying inline overloads with the old signatures lets Kokkos 4.6 itself, and any code that includes its
// headers, compile unchanged. CMake applies this header only when the toolkit is >= 13 and Kokkos < 4.7
// (Kokkos 4.7.1 and newer handle CUDA 13 themselves). Nothing else belongs here.
#pragma once
#if defined(__has_include)
#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
inline cudaError_t cudaGraphAddDependencies(cudaGraph_t graph, const cudaGraphNode_t* from,
                                            const cudaGraphNode_t* to, size_t numDependencies) {
  return cudaGraphAddDependencies(graph, from, to, nullptr, numDependencies);
}
inline cudaMemLocation mambamoe_compat_location(int device) {
  cudaMemLocation loc{};
  if (device == cudaCpuDeviceId) {
    loc.type = cudaMemLocationTypeHost;
    loc.id = 0;
  } else {
    loc.type = cudaMemLocationTypeDevice;
    loc.id = device;
  }
  return loc;
}
inline cudaError_t cudaMemAdvise(const void* devPtr, size_t count, cudaMemoryAdvise advice, int device) {
  return cudaMemAdvise(devPtr, count, advice, mambamoe_compat_location(device));
}
inline cudaError_t cudaMemPrefetchAsync(const void* devPtr, size_t count, int dstDevice,
                                        cudaStream_t stream = nullptr) {
  return cudaMemPrefetchAsync(devPtr, count, mambamoe_compat_location(dstDevice), 0u, stream);
}
#endif
#endif
#endif
