/**
 * @file host_pool.hpp
 * @brief A cache of pinned (page-locked) host memory for one device's context.
 *
 * cuMemHostAlloc costs far more than the copies pinned memory speeds up (benchmarks/
 * bench_pinned.py measures both), so freed pinned blocks are kept and handed out again.
 * Blocks come in size classes (four per doubling, at least one page: at most 25% rounding)
 * and are kept apart by allocation flags (mapped / portable / write-combined are properties
 * of an allocation). Each block is its own cuMemHostAlloc: no splitting, so a cached block is
 * reused only for its class.
 *
 * Reuse follows the device pool's rule (reuse_rule.hpp): a freed block waits until an
 * event recorded after its free has completed, so an asynchronous copy issued before the free
 * can no longer read or write it. A limit caps the pinned bytes held (in use + waiting +
 * cached): past it, cached blocks are returned to the driver first, then pending frees are
 * waited for, and only then does an allocation fail.
 *
 * cuMemHostRegister of caller memory (Numba's mempin) is passed through, counted, and undone
 * at once on release: the same memory may be pinned again right after.
 *
 * Thread-safe (one mutex); inert after fork, like device_pool.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/capture_mode.hpp>
#include <emmpool/detail/fence_queue.hpp>
#include <emmpool/detail/pool_lifecycle.hpp>
#include <emmpool/detail/stream_key.hpp>
#include <emmpool/driver.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emmpool {

/// @brief A snapshot of one host pool. Bytes are class sizes.
struct host_pool_stats {
  std::size_t bytes_in_use{};
  std::size_t bytes_waiting{};   ///< freed, waiting for their event
  std::size_t bytes_cached{};    ///< reusable now
  std::size_t bytes_held{};      ///< all of the above: what the limit caps
  std::size_t peak_bytes_held{};
  std::size_t limit{};
  std::size_t bytes_registered{};  ///< caller memory pinned through register_memory
  std::uint64_t allocations{};
  std::uint64_t cache_hits{};      ///< allocations served without the driver
  std::uint64_t driver_allocations{};
  std::uint64_t driver_frees{};
};

class host_pool : private detail::pool_lifecycle {
 public:
  /// @param limit cap on bytes held; 0: a quarter of the machine's physical memory
  host_pool(driver& drv, int device, std::size_t limit);
  ~host_pool();
  host_pool(host_pool const&)            = delete;
  host_pool& operator=(host_pool const&) = delete;

  /// @brief Size class of a request: at least 4 KiB, four classes per power of two.
  [[nodiscard]] static std::size_t size_class(std::size_t bytes) noexcept;

  /// @brief Pinned host memory of at least `bytes` with `flags` (host_alloc_flags).
  /// @param generation_out where given, the reset generation the block was allocated in, read
  ///        under the pool's lock (a read after the call could already be a reset's)
  /// @throws out_of_memory past the limit or when the driver has none, after the ladder
  [[nodiscard]] void* allocate(std::size_t bytes, unsigned flags,
                               std::uint64_t* generation_out = nullptr);
  /// @brief Free a block: reusable once an event recorded on `stream` after now completes.
  /// A stream other than the null/legacy/per-thread one must be alive during the call: its
  /// event is recorded in it.
  /// @throws pool_error for a pointer that is not a live block of this pool
  void deallocate(void* ptr, stream_handle stream = legacy_stream);
  /// @brief The same, for a block handed out before reset() `generation`: never reused.
  void deallocate(void* ptr, stream_handle stream, std::uint64_t generation);

  /// @brief cuMemHostRegister (flags: host_mapped, host_portable).
  void register_memory(void* ptr, std::size_t bytes, unsigned flags);
  /// @brief cuMemHostUnregister, at once. @throws pool_error if not registered here
  void unregister_memory(void* ptr);

  /// @brief Wait for pending frees; return every cached block to the driver. @return bytes
  std::size_t trim();
  /// @brief The context is about to be reset: wait, release what is free, and retire live
  /// blocks (never reused, never freed: their pages go with the context).
  void reset();
  void defer_cleanup_begin();
  void defer_cleanup_end();

  using pool_lifecycle::generation;  ///< incremented by every reset()
  using pool_lifecycle::forked;      ///< a copy in a forked child: inert
  [[nodiscard]] host_pool_stats stats() const;
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  using block = detail::block;
  block* take_cached(std::size_t cls, unsigned flags);
  void release_cached(std::size_t needed);  // return cached blocks until `needed` fits
  void free_to_driver(block* blk);
  void on_fenced(block* blk);
  void settle_fenced();  // fenced_: each block released into the cache
  void free_live_locked(void* ptr, stream_handle stream);  // or pool_error if not live
  void maintain();

  driver* driver_;
  int device_;
  detail::stream_keys keys_{*driver_, device_};
  // No allocation names a stream: no stream order, no lanes.
  detail::fence_queue fences_{*driver_, device_, SIZE_MAX};
  std::vector<detail::fenced_block> fenced_;  // what the fences reported, until settled
  std::unordered_map<std::uintptr_t, block*> live_;
  std::map<std::pair<unsigned, std::size_t>, std::vector<block*>> cached_;  // (flags, class)
  std::map<std::pair<std::uint64_t, std::uintptr_t>, block*> retired_;
  std::unordered_map<std::uintptr_t, std::size_t> registered_;
  detail::block_arena blocks_;
  detail::cleanup_deferrals deferrals_;
  host_pool_stats stats_{};
};

}  // namespace emmpool
