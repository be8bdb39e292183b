/**
 * @file detail/retired_segments.hpp
 * @brief Segments that outlived a device pool's reset(), and their live blocks.
 *
 * A reset means the context is about to go (Numba's context reset): what still holds live
 * blocks is retired. A retired segment is never handed out again; its live blocks are freed
 * by their owners' frees, matched by the reset generation they were allocated in (or by their
 * library, for callers that cannot say), and once its last block is freed it goes back to the
 * driver, but only if the driver still knows it as the same allocation (after a real context
 * reset its address may belong to someone else by now). Not thread-safe: its pool's mutex.
 */
#pragma once

#include <emmpool/detail/address_map.hpp>
#include <emmpool/detail/block.hpp>
#include <emmpool/driver.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace emmpool::detail {

class retired_segments {
 public:
  retired_segments(driver& drv, int device, block_arena& arena) noexcept
    : driver_{&drv}, device_{device}, arena_{&arena}
  {
  }

  /// @brief Retire every segment of `segments` and every block of `live` (allocated in reset
  /// generation `generation`), taking both over: the two are left empty.
  void retire(std::map<device_ptr, std::unique_ptr<segment>>& segments,
              live_map& live, std::uint64_t generation);

  /// @brief Free the live retired block at `ptr` of `generation`: its segment goes back to the
  /// driver if it was the last (and the driver still knows it), unless the process is exiting.
  /// @return false if there is no such block
  bool free(std::uint64_t generation, device_ptr ptr);
  /// @brief The same for a caller that knows the block's library but not its generation: the
  /// newest generation's block of that library at `ptr`.
  bool free_tagged(device_ptr ptr, std::uint8_t tag)
  {
    return !live_.empty() && free_newest(ptr, tag);  // none, but after a reset
  }

  /// @brief Whether a retired block is still live (a free may be one of them).
  [[nodiscard]] bool holds_any() const noexcept { return !live_.empty(); }

  /// @brief The pool is going away: every segment the driver still knows goes back to it.
  void release_all() noexcept;

 private:
  void free(block* blk);
  bool free_newest(device_ptr ptr, std::uint8_t tag);

  driver* driver_;
  int device_;
  block_arena* arena_;
  std::vector<std::unique_ptr<segment>> segments_;
  std::map<std::pair<std::uint64_t, device_ptr>, block*> live_;  // by (generation, address)
};

}  // namespace emmpool::detail
