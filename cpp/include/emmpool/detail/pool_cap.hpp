/**
 * @file detail/pool_cap.hpp
 * @brief The cap on what a device pool reserves, and what counts against it.
 *
 * One budget per device: the pool's own segments and mapped pages (the reserved bytes the
 * pool counts in pool_stats), plus what another allocator reserves for the pool's clients (a
 * PyTorch MemPool made with its own allocator: reserve_outside). Growth of either must fit.
 * Read by the pool and by its growable segment; changed only by the pool. Not thread-safe:
 * the pool's mutex.
 */
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>

namespace emmpool::detail {

class pool_cap {
 public:
  static constexpr std::size_t none = std::numeric_limits<std::size_t>::max();

  /// @brief The cap on reserved bytes (none: only the device's memory).
  [[nodiscard]] std::size_t maximum() const noexcept { return maximum_; }
  void set_maximum(std::size_t bytes) noexcept { maximum_ = bytes; }

  /// @brief Bytes another allocator reserves for the pool's clients.
  [[nodiscard]] std::size_t outside() const noexcept { return outside_; }
  void add_outside(std::size_t n) noexcept { outside_ += n; }
  void remove_outside(std::size_t n) noexcept { outside_ -= std::min(outside_, n); }

  /// @brief What the pool's own reservations may reach: the cap less what is reserved outside.
  [[nodiscard]] std::size_t for_growth() const noexcept
  {
    return maximum_ - std::min(maximum_, outside_);
  }
  /// @brief Whether `n` more bytes, on top of the pool's `reserved`, stay within for_growth().
  [[nodiscard]] bool fits(std::size_t reserved, std::size_t n) const noexcept
  {
    std::size_t const cap = for_growth();
    return n <= cap && reserved <= cap - n;
  }

 private:
  std::size_t maximum_{none};
  std::size_t outside_{};
};

}  // namespace emmpool::detail
