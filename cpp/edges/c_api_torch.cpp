// C entry points for emmpool's PyTorch allocator (python/emmpool/_torch_allocator.cpp), beyond
// the malloc/free pair of c_api.cpp: what PyTorch's CUDAAllocator interface asks of an
// allocator (statistics, record_stream, IPC, the cache's largest block, empty_cache, the cap
// of set_per_process_memory_fraction, the blocks of a memory snapshot, CUDA graph captures)
// and an allocation that says why it failed.
//
// The PyTorch extension is compiled on the user's machine against the installed PyTorch and
// finds these with dlsym() in this library, so nothing links against the other: the layout of
// what they exchange is fixed by emmpool_torch_abi_version() (bump it on any change).
// None of them throws across the C boundary (but a thread's end: caller_lock.hpp), and none
// holds the caller's GIL while it waits for the pool's lock or the GPU.
#include "c_api.hpp"
#include "caller_lock.hpp"

#include <emmpool/registry.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// Copies what(), truncated, into the caller's buffer (which may be null).
void say(char* buffer, std::size_t length, char const* what) noexcept
{
  if (buffer == nullptr || length == 0) { return; }
  std::size_t const n = std::min(std::strlen(what), length - 1);
  std::memcpy(buffer, what, n);
  buffer[n] = '\0';
}

emmpool::device_pool* pool_of(int device) noexcept
{
  try {
    return &emmpool::pool_registry::instance().pool(device);
  } catch (...) {
    return nullptr;
  }
}

// The pool of a device only if it exists already: statistics, peaks and empty_cache must not
// create pools (and with them CUDA contexts, initial reservations) on devices the program never
// used, as torch.cuda.empty_cache() asks of every device.
emmpool::device_pool* existing_pool_of(int device) noexcept
{
  try {
    for (auto* p : emmpool::pool_registry::instance().pools()) {
      if (p->device() == device) { return p; }
    }
  } catch (...) {
  }
  return nullptr;
}

}  // namespace

/// The layout version of the structures below; the extension refuses another.
EMMPOOL_C_API int emmpool_torch_abi_version() { return 3; }

/// PyTorch: allocate `size` bytes on `device` for `stream`. NULL on failure, with the reason in
/// `error` (`error_length` bytes, may be null) and *kind = 0 out of memory, 1 invalid argument,
/// 2 any other error.
EMMPOOL_C_API void* emmpool_torch_allocate(std::size_t size, int device, void* stream,
                                           int* kind, char* error, std::size_t error_length)
{
  try {
    return reinterpret_cast<void*>(emmpool::c_api::allocate_from(
      size, device, reinterpret_cast<emmpool::stream_handle>(stream), emmpool::alloc_tag::torch));
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    auto const f = emmpool::c_api::current_failure();
    if (kind != nullptr) { *kind = f.kind; }
    say(error, error_length, f.what);
    return nullptr;
  }
}

// The calls below take the pool's lock, maybe for a while: the GIL, if the caller holds it, is
// let go of throughout (each body catches its own errors; caller_lock.hpp says why it must).
using emmpool::caller_lock::without_caller_lock;

/// PyTorch: tensor.record_stream(stream). 0 done; -1 with the reason in `error` (a pointer the
/// pool did not allocate, a stream it cannot name).
EMMPOOL_C_API int emmpool_torch_record_stream(void* ptr, int device, void* stream, char* error,
                                              std::size_t error_length)
{
  return without_caller_lock([&]() noexcept {
    try {
      emmpool::pool_registry::instance().pool(device).record_stream(
        reinterpret_cast<emmpool::device_ptr>(ptr),
        reinterpret_cast<emmpool::stream_handle>(stream));
      return 0;
    } catch (...) {
      say(error, error_length, emmpool::c_api::current_failure().what);
    }
    return -1;
  });
}

/// What emmpool_torch_stats() fills, in this order (abi version 1): all uint64.
///  0 torch bytes in use, 1 pool bytes in use (every library), 2 pool peak bytes in use,
///  3 bytes reserved, 4 peak bytes reserved, 5 torch allocations (count), 6 pool frees,
///  7 blocks in use, 8 segments, 9 segment allocations, 10 segment releases,
///  11 out-of-memory failures, 12 bytes waiting for their fence, 13 bytes free,
///  14 largest free block, 15 device synchronizations for dormant streams.
/// Returns how many it filled (at most n), or -1 if the device has no pool yet (none is made:
/// torch.cuda.memory_stats(d) must not create a context on a device the program never used).
EMMPOOL_C_API int emmpool_torch_stats(int device, std::uint64_t* out, int n)
{
  return without_caller_lock([&]() noexcept {
    auto* pool = existing_pool_of(device);
    if (pool == nullptr || out == nullptr) { return -1; }
    try {
      auto const s             = pool->stats();
      auto const torch         = static_cast<std::size_t>(emmpool::alloc_tag::torch);
      std::uint64_t const v[] = {
        s.bytes_in_use_by_tag[torch], s.bytes_in_use,        s.peak_bytes_in_use,
        s.bytes_reserved,             s.peak_bytes_reserved, s.allocations_by_tag[torch],
        s.frees,                      s.blocks_in_use,       s.segments,
        s.segment_allocations,        s.segment_releases,    s.out_of_memory,
        s.bytes_waiting,              s.bytes_free,          s.largest_free_block,
        s.dormant_fences};
      int const m = std::min<int>(n, static_cast<int>(sizeof v / sizeof v[0]));
      std::copy(v, v + m, out);
      return m;
    } catch (...) {
      return -1;
    }
  });
}

/// torch.cuda.reset_peak_memory_stats(): the pool's peaks (every library's) start again.
EMMPOOL_C_API void emmpool_torch_reset_peaks(int device)
{
  without_caller_lock([&]() noexcept {
    if (auto* pool = existing_pool_of(device)) {
      try {
        pool->reset_peaks();
      } catch (...) {
      }
    }
  });
}

/// torch.cuda.empty_cache(): wait for pending frees and return wholly free segments. Bytes
/// released, 0 on any failure.
EMMPOOL_C_API std::size_t emmpool_torch_trim(int device)
{
  return without_caller_lock([&]() noexcept -> std::size_t {
    if (auto* pool = existing_pool_of(device)) {
      try {
        return pool->trim();
      } catch (...) {
      }
    }
    return 0;
  });
}

/// cuDNN's benchmark mode asks the allocator for the largest block it could hand out at once
/// (CUDAAllocator::cacheInfo) and sizes its workspace by it. As PyTorch's own pool answers: the
/// largest free block of the pool, or what the device still has free, within the pool's cap,
/// if that is more.
EMMPOOL_C_API std::size_t emmpool_torch_largest_block(int device)
{
  return without_caller_lock([&]() noexcept -> std::size_t {
    auto* pool = pool_of(device);
    if (pool == nullptr) { return 0; }
    try {
      auto const s   = pool->stats();
      auto& drv      = emmpool::pool_registry::instance().get_driver();
      auto const mi  = drv.memory_info_of(device);
      auto const cap = pool->maximum_size();
      std::size_t const headroom = cap > s.bytes_reserved ? cap - s.bytes_reserved : 0;
      return std::max(s.largest_free_block, std::min(mi.free, headroom));
    } catch (...) {
      return 0;
    }
  });
}

/// torch.multiprocessing: the CUDA IPC handle (64 bytes into `handle`) of the pool segment that
/// holds ptr, and ptr's offset in it. 0 done; -1 with the reason in `error`. The pool never
/// releases a segment while a block in it is live.
EMMPOOL_C_API int emmpool_torch_ipc_handle(void* ptr, int device, unsigned char* handle,
                                           std::size_t* offset, char* error,
                                           std::size_t error_length)
{
  return without_caller_lock([&]() noexcept {
    auto* pool = pool_of(device);
    if (pool == nullptr) {
      say(error, error_length, "no pool for this device");
      return -1;
    }
    try {
      auto const info = pool->ipc_handle(reinterpret_cast<emmpool::device_ptr>(ptr));
      if (!info) {
        say(error, error_length, "the pointer is not a block of emmpool's pool");
        return -1;
      }
      std::memcpy(handle, info->handle.data(), info->handle.size());
      *offset = info->offset;
      return 0;
    } catch (...) {
      say(error, error_length, emmpool::c_api::current_failure().what);
    }
    return -1;
  });
}

/// torch.cuda.set_per_process_memory_fraction(): the cap on what the device's pool reserves, for
/// every library (0: none). 0 done; -1 with the reason in `error` (more than that in use).
EMMPOOL_C_API int emmpool_torch_set_maximum(int device, std::size_t bytes, char* error,
                                            std::size_t error_length)
{
  return without_caller_lock([&]() noexcept {
    try {
      emmpool::pool_registry::instance().pool(device).set_maximum_size(bytes);
      return 0;
    } catch (...) {
      say(error, error_length, emmpool::c_api::current_failure().what);
    }
    return -1;
  });
}

/// The cap on what the device's pool reserves: SIZE_MAX if none, or if the device has no pool.
EMMPOOL_C_API std::size_t emmpool_torch_maximum(int device)
{
  return without_caller_lock([&]() noexcept -> std::size_t {
    if (auto* pool = existing_pool_of(device)) {
      try {
        return pool->maximum_size();
      } catch (...) {
      }
    }
    return std::numeric_limits<std::size_t>::max();
  });
}

/// Bytes another allocator reserves for PyTorch on the device (a MemPool made with its own
/// allocator) change by `delta`, counted against the cap (device_pool::reserve_outside). 0
/// done; 1 an increase that does not fit under the cap; -1 failed (the reason in `error`).
EMMPOOL_C_API int emmpool_torch_reserve_outside(int device, long long delta, char* error,
                                                std::size_t error_length)
{
  return without_caller_lock([&]() noexcept {
    try {
      auto& pool = emmpool::pool_registry::instance().pool(device);
      return pool.reserve_outside(static_cast<std::ptrdiff_t>(delta)) ? 0 : 1;
    } catch (...) {
      say(error, error_length, emmpool::c_api::current_failure().what);
    }
    return -1;
  });
}

/// A CUDA graph capture begins (begin != 0) or ends on the device (device_pool::capture_begin):
/// PyTorch's private pools say when. 0 done; -1 (no pool, or an end without a begin).
EMMPOOL_C_API int emmpool_torch_capture(int device, int begin)
{
  return without_caller_lock([&]() noexcept {
    try {
      auto& pool = emmpool::pool_registry::instance().pool(device);
      if (begin != 0) {
        pool.capture_begin();
      } else {
        pool.capture_end();
      }
      return 0;
    } catch (...) {
    }
    return -1;
  });
}

/// The blocks of the device's pool for a memory snapshot (device_pool::layout), 8 uint64 per
/// block in `out` (room for `n` blocks): segment base, segment size, address, size, stream
/// named at allocation, state (0 free, 1 allocated, 2 waiting for its fence), library tag,
/// segment kind (0 small, 1 large, 2 growable). Returns how many blocks there are (fill again
/// with more room if that is more than n), or -1 if the device has no pool.
EMMPOOL_C_API long emmpool_torch_layout(int device, std::uint64_t* out, std::size_t n)
{
  return without_caller_lock([&]() noexcept -> long {
    auto* pool = existing_pool_of(device);
    if (pool == nullptr) { return -1; }
    try {
      auto const rows = pool->layout();
      for (std::size_t i = 0; i < rows.size() && i < n && out != nullptr; ++i) {
        auto const& r = rows[i];
        std::uint64_t* o = out + 8 * i;
        o[0] = r.segment;
        o[1] = r.segment_size;
        o[2] = r.ptr;
        o[3] = r.size;
        o[4] = r.stream;
        o[5] = static_cast<std::uint64_t>(r.state);
        o[6] = r.tag;
        o[7] = static_cast<std::uint64_t>(r.kind);
      }
      return static_cast<long>(rows.size());
    } catch (...) {
      return -1;
    }
  });
}

/// The name of a library tag ("numba", "cupy", ...), or null past the last.
EMMPOOL_C_API char const* emmpool_torch_tag_name(int tag)
{
  if (tag < 0 || static_cast<std::size_t>(tag) >= emmpool::alloc_tag_count) { return nullptr; }
  return emmpool::alloc_tag_names[tag];
}
