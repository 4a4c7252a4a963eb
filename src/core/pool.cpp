#include "core/pool.hpp"

#include <exception>
#include <map>
#include <mutex>

#include "core/error.hpp"

namespace mm {

namespace {

struct Cache {
  std::mutex mu;
  std::multimap<std::size_t, void*> free;  // block size -> block
  std::map<void*, std::size_t> all;        // every block the cache owns
  std::size_t bytes = 0;
  bool hooked = false;
};

Cache& cache() {
  static Cache c;
  return c;
}

// Blocks come in sizes of 256 bytes up to 1 MiB, then of whole MiB; a block is reused for a request of at least
// 4/5 of its size (the same shape's buffers always fit the block they had; different shapes do not hoard memory).
std::size_t block_size(std::size_t bytes) {
  constexpr std::size_t kSmall = 256, kLarge = std::size_t(1) << 20;
  return bytes <= kLarge ? (bytes + kSmall - 1) / kSmall * kSmall : (bytes + kLarge - 1) / kLarge * kLarge;
}

// Takes and returns are reported as "pool:<label>": tools count them as the allocations they replace, and a
// profiler can tell them from device allocations ("mm::pool" are the cache's own blocks).
void report(bool alloc, const std::string& name, const void* p, std::size_t bytes) {
  if (!Kokkos::Profiling::profileLibraryLoaded()) return;
  const std::string label = "pool:" + name;
  const auto space = Kokkos::Profiling::make_space_handle(Mem::name());
  if (alloc)
    Kokkos::Profiling::allocateData(space, label, p, bytes);
  else
    Kokkos::Profiling::deallocateData(space, label, p, bytes);
}

}  // namespace

namespace pool_detail {

void* acquire(std::size_t bytes, const std::string& label, std::size_t& block) {
  block = 0;
  if (bytes == 0) return nullptr;
  const std::size_t want = block_size(bytes);
  void* p = nullptr;
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free.lower_bound(want);
    if (it != c.free.end() && it->first / 5 * 4 <= want) {
      block = it->first;
      p = it->second;
      c.free.erase(it);
    }
  }
  if (p == nullptr) {
    try {
      p = Mem().allocate("mm::pool", want);
    } catch (const std::exception&) {  // out of memory: give back the cached blocks no one uses, then try once more
      pool_trim();
      p = Mem().allocate("mm::pool", want);
    }
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    c.all[p] = want;
    c.bytes += want;
    block = want;
    if (!c.hooked) {
      c.hooked = true;
      Kokkos::push_finalize_hook([] { pool_trim(); });
    }
  }
  report(true, label, p, bytes);
  return p;
}

void release(void* p, std::size_t block, const std::string& label, std::size_t bytes) {
  if (p == nullptr) return;
  report(false, label, p, bytes);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.free.emplace(block, p);
}

}  // namespace pool_detail

void pool_trim() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.free.empty()) return;
  Kokkos::fence("mm::pool_trim");  // kernels may still use a block returned a moment ago
  for (const auto& [size, p] : c.free) {
    Mem().deallocate("mm::pool", p, size);
    c.all.erase(p);
    c.bytes -= size;
  }
  c.free.clear();
}

std::size_t pool_cached_bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.bytes;
}

}  // namespace mm
