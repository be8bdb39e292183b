// Plain C entry points into the process-wide pools, for allocators that call C function
// pointers with no Python in between: PyTorch's CUDAPluggableAllocator (which dlsym()s these
// names from this extension's .so) here, CuPy's CFunctionAllocator in cupy_adapter.cpp.
// They throw no exception across the C boundary: failures return NULL (allocation; for CuPy,
// what the adapter's reporter says) or are dropped (free), as neither caller has a way to
// receive a C++ exception. The one thing that crosses it is the end of a thread that takes the
// GIL back while the interpreter finalizes: a forced unwind, which C frames let through and
// noexcept ones would turn into an abort (caller_lock.hpp).
#include "c_api.hpp"

#include "pool_calls.hpp"

#include <emmpool/torch_api.h>

#include <emmpool/error.hpp>
#include <emmpool/registry.hpp>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace emmpool::c_api {

void copy_message(char* to, std::size_t room, char const* what) noexcept
{
  if (to == nullptr || room == 0) { return; }
  auto const n = std::min(std::strlen(what), room - 1);
  std::memcpy(to, what, n);
  to[n] = '\0';
}

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

device_ptr allocate_from(std::size_t size, int device, stream_handle stream, alloc_tag tag)
{
  // The GIL is back before a failure is reported (CuPy's reporter needs it).
  return pool_calls::allocate(pool_registry::instance().pool(device), size, stream, tag);
}

void* allocate_tagged(std::size_t size, int device, stream_handle stream, alloc_tag tag,
                      failure_fn report)
{
  try {
    return reinterpret_cast<void*>(allocate_from(size, device, stream, tag));
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    auto const f = current_failure();
    return report != nullptr ? report(size, device, f.kind, f.what) : nullptr;
  }
}

void free_on(void* ptr, int device, stream_handle stream, alloc_tag tag)
{
  if (ptr == nullptr) { return; }
  try {
    pool_calls::deallocate(pool_registry::instance().pool(device),
                           reinterpret_cast<device_ptr>(ptr), stream, block_owner::of_library(tag));
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    // A foreign or doubly freed pointer: nothing safe to do from a C callback but ignore it.
  }
}

}  // namespace emmpool::c_api

/// PyTorch: void* alloc(size_t size, int device, cudaStream_t stream). 0 is the null stream
/// (a stream like any other to the pool); the per-thread handle the pool maps itself.
EMMPOOL_C_API void* emmpool_torch_malloc(std::size_t size, int device, void* stream)
{
  return emmpool::c_api::allocate_tagged(
    size, device, reinterpret_cast<emmpool::stream_handle>(stream), emmpool::alloc_tag::torch);
}

/// PyTorch: void free(void* ptr, size_t size, int device, cudaStream_t stream). PyTorch passes
/// the stream of the allocation, which may have died since (torch.cuda.ExternalStream): the
/// free is fenced on the allocation's stream as the pool knows it, and the handle passed here
/// is never used (reuse_rule.hpp, "stream lifetime").
EMMPOOL_C_API void emmpool_torch_free(void* ptr, std::size_t, int device, void*)
{
  emmpool::c_api::free_on(ptr, device, emmpool::allocation_stream, emmpool::alloc_tag::torch);
}
