// Device memory in use on this process's GPU, sampled by a background thread (cudaMemGetInfo: everything on the
// device, the CUDA context, libraries' workspaces, the workspace cache's blocks and other processes included); the
// peak of the samples. CUDA builds only: elsewhere sampling() is false and the peak stays 0.
#pragma once

#include <Kokkos_Core.hpp>

#include <atomic>
#include <chrono>
#include <thread>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace mm {

class DeviceMemorySampler {
 public:
  explicit DeviceMemorySampler(std::chrono::microseconds interval = std::chrono::microseconds(500)) {
#if defined(KOKKOS_ENABLE_CUDA)
    const int device = Kokkos::Cuda().cuda_device();
    th_ = std::thread([this, device, interval] {
      cudaSetDevice(device);
      while (!stop_) {
        std::size_t free = 0, total = 0;
        if (cudaMemGetInfo(&free, &total) == cudaSuccess && double(total - free) > peak_) peak_ = double(total - free);
        std::this_thread::sleep_for(interval);
      }
    });
#else
    (void)interval;
#endif
  }
  ~DeviceMemorySampler() {
    stop_ = true;
    if (th_.joinable()) th_.join();
  }
  DeviceMemorySampler(const DeviceMemorySampler&) = delete;
  DeviceMemorySampler& operator=(const DeviceMemorySampler&) = delete;

  static constexpr bool sampling() {
#if defined(KOKKOS_ENABLE_CUDA)
    return true;
#else
    return false;
#endif
  }
  double peak_bytes() const { return peak_; }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<double> peak_{0};
  std::thread th_;
};

}  // namespace mm
