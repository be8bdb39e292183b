// Plain C entry points into the process-wide pools, for allocators that call C function
// pointers with no Python in between: PyTorch's CUDAPluggableAllocator (which dlsym()s these
// names from this extension's .so) here, CuPy's CFunctionAllocator in cupy_adapter.cpp.
// They must not throw across the C boundary: failures return NULL (allocation; for CuPy, what
// the adapter's reporter says) or are dropped (free), as neither caller has a way to receive a
// C++ exception.
#include "c_api.hpp"

#include <emmpool/error.hpp>
#include <emmpool/registry.hpp>

#include <stdexcept>

namespace emmpool::c_api {

failure current_failure() noexcept
{
  // Rethrown, the exception being handled stays the same object: what() outlives this call.
  try {
    throw;
  } catch (out_of_memory const& e) {
    return {0, e.what()};
  } catch (std::invalid_argument const& e) {
    return {1, e.what()};
  } catch (std::exception const& e) {
    return {2, e.what()};
  } catch (...) {
    return {2, "unknown error"};
  }
}

void* allocate_tagged(std::size_t size, int device, stream_handle stream, alloc_tag tag,
                      failure_fn report) noexcept
{
  try {
    return reinterpret_cast<void*>(pool_registry::instance().pool(device).allocate(size, stream, tag));
  } catch (...) {
    auto const f = current_failure();
    return report != nullptr ? report(size, device, f.kind, f.what) : nullptr;
  }
}

void free_on(void* ptr, int device, stream_handle stream, alloc_tag tag) noexcept
{
  if (ptr == nullptr) { return; }
  try {
    pool_registry::instance().pool(device).deallocate_tagged(reinterpret_cast<device_ptr>(ptr),
                                                             stream, tag);
  } catch (...) {
    // A foreign or doubly freed pointer: nothing safe to do from a C callback but ignore it.
  }
}

}  // namespace emmpool::c_api

/// PyTorch: void* alloc(size_t size, int device, cudaStream_t stream). 0 is the null stream
/// (a stream like any other to the pool); the per-thread handle the pool maps itself.
EMMPOOL_C_API void* emmpool_torch_malloc(std::size_t size, int device, void* stream)
{
  return emmpool::c_api::allocate_tagged(size, device, reinterpret_cast<emmpool::stream_handle>(stream),
                                         emmpool::alloc_tag::torch);
}

/// PyTorch: void free(void* ptr, size_t size, int device, cudaStream_t stream). PyTorch passes
/// the stream of the allocation, which may have died since (torch.cuda.ExternalStream): the
/// free is fenced on the allocation's stream as the pool knows it, and the handle passed here
/// is never used (reuse_policy.hpp, "stream lifetime").
EMMPOOL_C_API void emmpool_torch_free(void* ptr, std::size_t, int device, void*)
{
  emmpool::c_api::free_on(ptr, device, emmpool::allocation_stream, emmpool::alloc_tag::torch);
}
