/**
 * @file detail/pool_lifecycle.hpp
 * @brief What device_pool and host_pool share of their lives, alike in both: one mutex, the
 * fork guard, the reset generation, and what a pool may still do as it goes away. Each pool
 * derives from it privately. (Deferred cleanup, which both have too: detail/capture_mode.hpp.)
 */
#pragma once

#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/detail/pool_mutex.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/error.hpp>

#include <cstdint>
#include <mutex>

namespace emmpool::detail {

class pool_lifecycle {
 public:
  /// @brief Incremented by every reset(); callers that may outlive a reset remember it.
  [[nodiscard]] std::uint64_t generation() const
  {
    std::lock_guard lock{mutex_};
    return generation_;
  }
  /// @brief Whether this is a copy of the pool in a forked child: allocations raise pool_error
  /// saying why, frees (finalizers of inherited arrays) do nothing, and nothing ever calls the
  /// driver: the memory is the parent's.
  [[nodiscard]] bool forked() const
  {
    std::lock_guard lock{mutex_};
    return forked_;
  }

  pool_lifecycle(pool_lifecycle const&)            = delete;
  pool_lifecycle& operator=(pool_lifecycle const&) = delete;

 protected:
  // Held across fork() (so the child never inherits it held by another thread); in the child,
  // forked_ is set. For the pool's whole life, this one included.
  pool_lifecycle();
  ~pool_lifecycle();

  // The rest expect mutex_ held.
  /// As the pool goes away: whether it may call the driver (never in a forked child, whose
  /// driver is the parent's, nor while the process exits: the driver may be gone; leak).
  [[nodiscard]] bool may_call_driver_at_teardown() const noexcept
  {
    return !forked_ && !process_is_exiting();
  }

  mutable pool_mutex mutex_;
  bool forked_{};  // this process is a fork() child of the one that made the pool
  std::uint64_t generation_{};
};

}  // namespace emmpool::detail
