/**
 * @file detail/pool_mutex.hpp
 * @brief The pools' mutex. Uncontended, lock() and unlock() are one atomic instruction each,
 * inline: std::mutex does the same two atomic operations, but through pthread_mutex_lock and
 * _unlock, whose checks of the mutex's kind cost the allocate+free pair (two locks) about a
 * hundred instructions, a sixth of it. Contended, a waiter spins briefly, then sleeps in the
 * kernel (futex on Linux) until unlock() wakes it: a pool's lock is held across CUDA calls that
 * may wait for the GPU, so waiters must not burn a CPU.
 */
#pragma once

#include <atomic>

namespace emmpool::detail {

class pool_mutex {
 public:
  pool_mutex() = default;
  pool_mutex(pool_mutex const&)            = delete;
  pool_mutex& operator=(pool_mutex const&) = delete;

  [[nodiscard]] bool try_lock() noexcept
  {
    int expected = unlocked;
    return state_.compare_exchange_strong(expected, locked, std::memory_order_acquire,
                                          std::memory_order_relaxed);
  }

  void lock() noexcept
  {
    if (!try_lock()) { lock_contended(); }
  }

  void unlock() noexcept
  {
    if (state_.exchange(unlocked, std::memory_order_release) == waited_for) { wake_one(); }
  }

 private:
  // The three states of Drepper's "Futexes Are Tricky" (mutex 3): a waiter sets waited_for
  // before it sleeps, so the unlock that follows knows to wake one.
  static constexpr int unlocked = 0, locked = 1, waited_for = 2;
  void lock_contended() noexcept;
  void wake_one() noexcept;

  std::atomic<int> state_{unlocked};
};

}  // namespace emmpool::detail
