// Threads that allocate and free through RMM's resource of a device with no Python, as
// libcudf's do: each takes the device's resource_ref as RMM's C++ callers find it
// (rmm::mr::get_per_device_resource_ref, which rmm.mr.set_per_device_resource sets from
// Python) and allocates and frees `bytes` `iterations` times on the default stream, or as
// rmm::device_buffers on a stream of its own (GPU only: a buffer asks the runtime its
// device). Built and loaded by rmm_threads.py; its caller may hold the GIL throughout
// (ctypes.PyDLL), which proves that no allocation needs it.
#include <rmm/cuda_device.hpp>
#include <rmm/cuda_stream.hpp>
#include <rmm/device_buffer.hpp>
#include <rmm/mr/per_device_resource.hpp>
#include <rmm/resource_ref.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

extern "C" __attribute__((visibility("default"))) int emmci_rmm_threads(
  int device, int threads, int iterations, std::size_t bytes, int buffers, double* seconds,
  char* error, std::size_t error_size)
{
  auto mr = rmm::mr::get_per_device_resource_ref(rmm::cuda_device_id{device});
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::mutex failed_lock;
  std::string failed;  // the first failure's words
  auto fail = [&](char const* what) {
    std::lock_guard lock{failed_lock};
    if (failed.empty()) { failed = what; }
  };
  auto work = [&] {
    std::unique_ptr<rmm::cuda_stream> stream;
    try {
      if (buffers != 0) { stream = std::make_unique<rmm::cuda_stream>(); }
    } catch (std::exception const& e) {
      fail(e.what());
    }
    ++ready;
    while (!go.load()) { std::this_thread::yield(); }
    if (buffers != 0 && !stream) { return; }
    try {
      for (int i = 0; i < iterations; ++i) {
        if (buffers != 0) {
          rmm::device_buffer b{bytes, stream->view(), mr};
        } else {
          auto const stream = cuda::stream_ref{cudaStream_t{}};
          void* p           = mr.allocate(stream, bytes, rmm::CUDA_ALLOCATION_ALIGNMENT);
          mr.deallocate(stream, p, bytes, rmm::CUDA_ALLOCATION_ALIGNMENT);
        }
      }
      if (stream) { stream->synchronize(); }
    } catch (std::exception const& e) {
      fail(e.what());
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) { pool.emplace_back(work); }
  while (ready.load() < threads) { std::this_thread::yield(); }
  auto const start = std::chrono::steady_clock::now();
  go = true;
  for (auto& t : pool) { t.join(); }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!failed.empty() && error != nullptr && error_size != 0) {
    std::strncpy(error, failed.c_str(), error_size - 1);
    error[error_size - 1] = '\0';
  }
  return failed.empty() ? 0 : -1;
}

// Allocate on stream `a` and free on stream `b`, `iterations` times, in the calling thread:
// a free on another stream than its allocation's takes the pool's full path, which lets go of
// a GIL the caller holds (ctypes.PyDLL) and takes it back (the test of a daemon thread doing
// so while the interpreter exits).
extern "C" __attribute__((visibility("default"))) int emmci_rmm_churn(
  int device, std::uintptr_t a, std::uintptr_t b, int iterations)
{
  auto mr = rmm::mr::get_per_device_resource_ref(rmm::cuda_device_id{device});
  for (int i = 0; i < iterations; ++i) {
    void* p = mr.allocate(cuda::stream_ref{reinterpret_cast<cudaStream_t>(a)}, 4096,
                          rmm::CUDA_ALLOCATION_ALIGNMENT);
    mr.deallocate(cuda::stream_ref{reinterpret_cast<cudaStream_t>(b)}, p, 4096,
                  rmm::CUDA_ALLOCATION_ALIGNMENT);
  }
  return 0;
}
