// Plain C entry points into the process-wide pools, for allocators that call C function
// pointers with no Python in between: CuPy's CFunctionAllocator and PyTorch's
// CUDAPluggableAllocator (which dlsym()s these names from this extension's .so).
// They must not throw across the C boundary: failures return NULL (allocation) or are counted
// and dropped (free), as neither caller has a way to receive a C++ exception.
#include <emmpool/registry.hpp>

#include <cstddef>
#include <cstdint>

#define EMMPOOL_C_API extern "C" __attribute__((visibility("default")))

namespace {

void* allocate_tagged(std::size_t size, int device, emmpool::stream_handle stream,
                      emmpool::alloc_tag tag) noexcept
{
  try {
    return reinterpret_cast<void*>(
      emmpool::pool_registry::instance().pool(device).allocate(size, stream, tag));
  } catch (...) {
    return nullptr;
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

// A null stream handle means the legacy default stream to the CUDA runtime (unless the caller
// was built for per-thread default streams, in which case the fence is conservative anyway:
// the legacy stream orders after per-thread default streams too).
emmpool::stream_handle as_stream(void* s) noexcept
{
  return s == nullptr ? emmpool::legacy_stream : reinterpret_cast<emmpool::stream_handle>(s);
}

}  // namespace

/// CuPy: void* malloc(void* param, size_t size, int device_id). No stream: legacy fence.
EMMPOOL_C_API void* emmpool_cupy_malloc(void*, std::size_t size, int device)
{
  return allocate_tagged(size, device, emmpool::legacy_stream, emmpool::alloc_tag::cupy);
}

/// CuPy: void free(void* param, void* ptr, int device_id).
EMMPOOL_C_API void emmpool_cupy_free(void*, void* ptr, int device)
{
  free_on(ptr, device, emmpool::legacy_stream, emmpool::alloc_tag::cupy);
}

/// PyTorch: void* alloc(size_t size, int device, cudaStream_t stream).
EMMPOOL_C_API void* emmpool_torch_malloc(std::size_t size, int device, void* stream)
{
  return allocate_tagged(size, device, as_stream(stream), emmpool::alloc_tag::torch);
}

/// PyTorch: void free(void* ptr, size_t size, int device, cudaStream_t stream).
EMMPOOL_C_API void emmpool_torch_free(void* ptr, std::size_t, int device, void* stream)
{
  free_on(ptr, device, as_stream(stream), emmpool::alloc_tag::torch);
}
