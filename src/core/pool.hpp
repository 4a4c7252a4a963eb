// Device workspaces that outlive the call that used them: a kernel sequence whose scratch buffers are the same at
// every call (the SSD's per-call workspaces: 16 in its forward, 41 in its backward, for each of 24 layers) takes
// them from a cache of blocks instead of allocating and freeing device memory each time, which on CUDA is a
// cudaMalloc and a device-wide synchronizing cudaFree per buffer (about 0.1 ms each, 2,000 per training step).
//
//   {
//     PoolScope ws;                                        // every block taken below goes back at scope end
//     auto a = ws.take<View2<float>>("ssd::xw", n, m);     // an unmanaged view over a cached block
//     ...kernels on the default execution space instance...
//   }
//
// Blocks return to the cache when their scope ends and the next take may hand them out at once: this is safe
// because every kernel that touches them runs on the one default execution-space instance (stream order), and
// nothing taken from a scope may escape it. Each take and return is reported to Kokkos' tools as an allocation and
// a deallocation labelled "pool:<label>" (so the planner's accounting, tools and profilers see what they saw when
// these were Views, and can tell them from device allocations); the cached blocks themselves are allocated under the label "mm::pool" and freed at Kokkos'
// finalize or by pool_trim(). Device memory in use therefore includes the cache (pool_cached_bytes()).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/kokkos_types.hpp"

namespace mm {

namespace pool_detail {
void* acquire(std::size_t bytes, const std::string& label, std::size_t& block);
void release(void* p, std::size_t block, const std::string& label, std::size_t bytes);
}  // namespace pool_detail

class PoolScope {
 public:
  PoolScope() = default;
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;
  ~PoolScope() {
    for (auto it = taken_.rbegin(); it != taken_.rend(); ++it) pool_detail::release(it->p, it->block, it->label, it->bytes);
  }

  // An uninitialised view of the given extents over a cached block (a View type of the default memory space).
  template <class V, class... Extents>
  V take(const std::string& label, Extents... ext) {
    static_assert(std::is_same_v<typename V::memory_space, Mem>, "PoolScope hands out device (Mem) views");
    std::size_t n = 1;
    ((n *= static_cast<std::size_t>(ext)), ...);
    const std::size_t bytes = n * sizeof(typename V::value_type);
    std::size_t block = 0;
    void* p = pool_detail::acquire(bytes, label, block);
    taken_.push_back({p, block, bytes, label});
    return V(static_cast<typename V::pointer_type>(p), static_cast<std::size_t>(ext)...);
  }

 private:
  struct Taken {
    void* p;
    std::size_t block, bytes;
    std::string label;
  };
  std::vector<Taken> taken_;
};

// A view from `ws` when one is given, else a fresh uninitialised allocation (code shared by callers that keep
// their buffers in a scope and callers that do not).
template <class V, class... Extents>
V take_or_alloc(PoolScope* ws, const std::string& label, Extents... ext) {
  return ws ? ws->template take<V>(label, ext...) : make_uninit<V>(label, ext...);
}

// Frees every cached block not in use (all of them between calls); the next takes allocate again.
void pool_trim();
// Bytes of device memory the cache holds (in use or not).
std::size_t pool_cached_bytes();

}  // namespace mm
