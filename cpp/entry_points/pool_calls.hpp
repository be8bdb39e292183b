// The rule every entry point into a pool follows (the C ones for CuPy and PyTorch, Numba's,
// the pools' Python methods), written once: first try without waiting for the pool's lock or
// the GPU (try_allocate / try_deallocate: no CUDA call), holding the caller's lock (Python's
// GIL), which saves a GIL hand-over per call when nothing contends; else let go of it and wait
// (a thread holding the pool's lock may be waiting for GPU work queued behind a host callback
// that needs the GIL: caller_lock.hpp). Internal to the extension.
#pragma once

#include "caller_lock.hpp"
#include "out_of_memory_hook.hpp"

#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>

#include <cstdint>
#include <string>

namespace emmpool::pool_calls {

/// pool.allocate(), by the rule; out of memory, the out-of-memory hook is asked (no pool lock
/// held) and, while it freed something, the allocation tried again (at most
/// out_of_memory_hook::max_asks times). A hook's own allocation that runs out of memory fails
/// without asking it again. @throws as device_pool::allocate (after the lock is back); the
/// message of out_of_memory says when the hook failed
[[nodiscard]] inline device_ptr allocate(device_pool& pool, std::size_t size,
                                         stream_handle stream, alloc_tag tag,
                                         std::uint64_t* generation = nullptr)
{
  if (auto const p = pool.try_allocate(size, stream, tag, generation)) { return *p; }
  thread_local bool asking = false;  // this thread is inside the hook
  for (int asked = 0;; ++asked) {
    std::string failure;
    try {
      return caller_lock::without_caller_lock(
        [&] { return pool.allocate(size, stream, tag, generation); });
    } catch (out_of_memory const& e) {
      failure = e.what();
    }
    // Out of the catch block: the hook may take the caller's lock back (caller_lock.hpp).
    auto const hook = out_of_memory_hook::installed();
    if (hook == nullptr || asking || asked == out_of_memory_hook::max_asks) {
      throw out_of_memory{failure};
    }
    std::string error;
    struct flag {  // set while the hook runs, however it ends
      bool& on;
      explicit flag(bool& b) : on{b} { on = true; }
      ~flag() { on = false; }
    };
    auto const answer = [&] {
      flag const inside{asking};
      return hook(pool, size, error);
    }();
    if (answer == out_of_memory_hook::answer::raised) {
      throw out_of_memory{failure + "; the out-of-memory callback raised " + error};
    }
    if (answer == out_of_memory_hook::answer::freed_nothing) { throw out_of_memory{failure}; }
  }
}

/// pool.deallocate(), by the rule.
inline void deallocate(device_pool& pool, device_ptr ptr, stream_handle stream, block_owner owner)
{
  if (pool.try_deallocate(ptr, stream, owner)) { return; }
  caller_lock::without_caller_lock([&] { pool.deallocate(ptr, stream, owner); });
}

}  // namespace emmpool::pool_calls
