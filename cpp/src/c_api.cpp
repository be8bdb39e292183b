// Plain C entry points into the process-wide pools, for allocators that call C function
// pointers with no Python in between: CuPy's CFunctionAllocator and PyTorch's
// CUDAPluggableAllocator (which dlsym()s these names from this extension's .so).
// They must not throw across the C boundary: failures return NULL (allocation; for CuPy, what
// the binding's reporter says, see cupy_failure) or are dropped (free), as neither caller has a
// way to receive a C++ exception.
#include <emmpool/error.hpp>
#include <emmpool/registry.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>

#define EMMPOOL_C_API extern "C" __attribute__((visibility("default")))

namespace {

// What a failed allocation returns: NULL, or what `report` (if any) makes of the failure.
// kind: 0 out of memory, 1 invalid argument, 2 any other error.
using failure_fn = void* (*)(std::size_t size, int device, int kind, char const* what);

void* allocate_tagged(std::size_t size, int device, emmpool::stream_handle stream,
                      emmpool::alloc_tag tag, failure_fn report = nullptr) noexcept
{
  auto failed = [&](int kind, char const* what) {
    return report != nullptr ? report(size, device, kind, what) : nullptr;
  };
  try {
    return reinterpret_cast<void*>(
      emmpool::pool_registry::instance().pool(device).allocate(size, stream, tag));
  } catch (emmpool::out_of_memory const& e) {
    return failed(0, e.what());
  } catch (std::invalid_argument const& e) {
    return failed(1, e.what());
  } catch (std::exception const& e) {
    return failed(2, e.what());
  } catch (...) {
    return failed(2, "unknown error");
  }
}

void free_on(void* ptr, int device, emmpool::stream_handle stream, emmpool::alloc_tag tag) noexcept
{
  if (ptr == nullptr) { return; }
  try {
    emmpool::pool_registry::instance().pool(device).deallocate_tagged(
      reinterpret_cast<emmpool::device_ptr>(ptr), stream, tag);
  } catch (...) {
    // A foreign or doubly freed pointer: nothing safe to do from a C callback but ignore it.
  }
}

// A stream handle as CuPy and PyTorch pass it: 0 is the null stream (the legacy default stream
// for both, a stream like any other to the pool); the per-thread handle the pool maps itself.
emmpool::stream_handle as_stream(void* s) noexcept
{
  return reinterpret_cast<emmpool::stream_handle>(s);
}

// CuPy's current stream on a device, when the binding could find how to ask CuPy
// (emmpool.hooks); it returns a negative value when it cannot say. Without it, CuPy's memory
// names no stream (legacy fence).
std::atomic<std::intptr_t (*)(int)> cupy_stream_source{nullptr};

emmpool::stream_handle cupy_current_stream(int device) noexcept
{
  auto* source = cupy_stream_source.load(std::memory_order_acquire);
  std::intptr_t const s = source != nullptr ? source(device) : -1;
  return s < 0 ? emmpool::legacy_stream : static_cast<emmpool::stream_handle>(s);
}

// How a failed CuPy allocation is reported. By default not at all: NULL (CuPy cannot tell it
// from a pointer: the hook then checks each result). The binding may install a reporter that
// sets a Python exception (CuPy calls with the GIL held) and returns what makes CuPy's Cython
// layer pass that exception on; emmpool.hooks installs it only after seeing this CuPy do so.
std::atomic<failure_fn> cupy_failure{nullptr};

}  // namespace

/// How a failed CuPy allocation is reported (see cupy_failure and failure_fn; null: it returns
/// NULL).
EMMPOOL_C_API void emmpool_set_cupy_failure(failure_fn report)
{
  cupy_failure.store(report, std::memory_order_release);
}

/// How the CuPy entry points learn CuPy's current stream on a device (null: they do not).
EMMPOOL_C_API void emmpool_set_cupy_stream_source(std::intptr_t (*source)(int device))
{
  cupy_stream_source.store(source, std::memory_order_release);
}

/// CuPy: void* malloc(void* param, size_t size, int device_id). The block is used on CuPy's
/// current stream, as in CuPy's own pool.
EMMPOOL_C_API void* emmpool_cupy_malloc(void*, std::size_t size, int device)
{
  return allocate_tagged(size, device, cupy_current_stream(device), emmpool::alloc_tag::cupy,
                         cupy_failure.load(std::memory_order_acquire));
}

/// CuPy: void free(void* param, void* ptr, int device_id). No stream is passed: the free is
/// fenced on the stream of the allocation, as CuPy's own pool does.
EMMPOOL_C_API void emmpool_cupy_free(void*, void* ptr, int device)
{
  free_on(ptr, device, emmpool::allocation_stream, emmpool::alloc_tag::cupy);
}

/// PyTorch: void* alloc(size_t size, int device, cudaStream_t stream).
EMMPOOL_C_API void* emmpool_torch_malloc(std::size_t size, int device, void* stream)
{
  return allocate_tagged(size, device, as_stream(stream), emmpool::alloc_tag::torch);
}

/// PyTorch: void free(void* ptr, size_t size, int device, cudaStream_t stream). PyTorch passes
/// the stream of the allocation, which may have died since (torch.cuda.ExternalStream): the
/// free is fenced on the allocation's stream as the pool knows it, and the handle passed here
/// is never used (deferred_free_queue.hpp, "stream lifetime").
EMMPOOL_C_API void emmpool_torch_free(void* ptr, std::size_t, int device, void*)
{
  free_on(ptr, device, emmpool::allocation_stream, emmpool::alloc_tag::torch);
}
