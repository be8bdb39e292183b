// The rule every entry point into a pool follows (the C ones for CuPy and PyTorch, Numba's,
// the pools' Python methods), written once: first try without waiting for the pool's lock or
// the GPU (try_allocate / try_deallocate: no CUDA call), holding the caller's lock (Python's
// GIL), which saves a GIL hand-over per call when nothing contends; else let go of it and wait
// (a thread holding the pool's lock may be waiting for GPU work queued behind a host callback
// that needs the GIL: caller_lock.hpp). Internal to the extension.
#pragma once

#include "caller_lock.hpp"

#include <emmpool/device_pool.hpp>

#include <cstdint>

namespace emmpool::pool_calls {

/// pool.allocate(), by the rule. @throws as device_pool::allocate (after the lock is back)
[[nodiscard]] inline device_ptr allocate(device_pool& pool, std::size_t size,
                                         stream_handle stream, alloc_tag tag,
                                         std::uint64_t* generation = nullptr)
{
  if (auto const p = pool.try_allocate(size, stream, tag, generation)) { return *p; }
  return caller_lock::without_caller_lock(
    [&] { return pool.allocate(size, stream, tag, generation); });
}

/// pool.deallocate() of a block allocated in reset generation `generation`, by the rule.
inline void deallocate(device_pool& pool, device_ptr ptr, stream_handle stream,
                       std::uint64_t generation)
{
  if (pool.try_deallocate(ptr, stream, generation)) { return; }
  caller_lock::without_caller_lock([&] { pool.deallocate(ptr, stream, generation); });
}

/// pool.deallocate_tagged(), by the rule.
inline void deallocate_tagged(device_pool& pool, device_ptr ptr, stream_handle stream,
                              alloc_tag tag)
{
  if (pool.try_deallocate_tagged(ptr, stream, tag)) { return; }
  caller_lock::without_caller_lock([&] { pool.deallocate_tagged(ptr, stream, tag); });
}

}  // namespace emmpool::pool_calls
