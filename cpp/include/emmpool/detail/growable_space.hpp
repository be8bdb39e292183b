/**
 * @file detail/growable_space.hpp
 * @brief The device pool's growable segment: its creation, which free block serves
 * a request, when pages are mapped, and when wholly free pages go back.
 *
 * The segment is one address reservation (detail/growable_segment.hpp: its page map) whose
 * blocks live in a free_lists of its own (detail/free_list.hpp: its large set) and are split
 * and coalesced as any other. A request takes the best fit, or a slightly larger free block whose
 * pages are already mapped; missing pages are mapped, with up to growable_room of the block
 * beyond the request (room for the next requests of that size).
 *
 * Giving pages back, and its hysteresis: a map that would pass the pool's peak reserved first
 * unmaps wholly free pages, but only as many as keep reserved at the peak (the largest free
 * blocks' first, from the top down); the peak grows only where free pages do not cover the
 * request, as when every free page went back (options' growable_hysteresis false, the first
 * version), which unmapped and mapped again, step after step, what a loop whose shapes change
 * every step needs next (PyTorch training on an H100: 32.8 ms/step, 15.8 with fixed segments).
 * A map that would pass the cap, trim, the out-of-memory ladder and reset unmap every wholly
 * free page. Not thread-safe: the pool's mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/free_list.hpp>
#include <emmpool/detail/growable_segment.hpp>
#include <emmpool/detail/pool_cap.hpp>
#include <emmpool/detail/segment_log.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/pool_options.hpp>
#include <emmpool/stats.hpp>

#include <cstddef>
#include <map>
#include <memory>
#include <vector>

namespace emmpool::detail {

class growable_space {
 public:
  /// `stats`, `cap`, `log`: the pool's (reserved bytes counted there, mapping within its cap,
  /// maps and unmaps recorded there).
  growable_space(driver& drv, int device, block_arena& arena, pool_stats& stats,
                 pool_cap const& cap, segment_log& log)
    : driver_{&drv}, device_{device}, arena_{&arena}, free_{arena}, stats_{&stats}, cap_{&cap},
      log_{&log}
  {
  }

  /// Asks the driver for its page size when `o` asks for growable segments (pool mode).
  void configure(pool_options const& o) noexcept;
  /// Whether requests above small_request may use the segment (supported and asked for).
  [[nodiscard]] bool enabled() const noexcept { return page_ != 0; }
  [[nodiscard]] bool serves(std::size_t rounded, alloc_tag tag) const noexcept
  {
    return page_ != 0 && rounded > small_request_ && tag != alloc_tag::numba;
  }

  /// A free block chosen for a request, off the free list (so that unmapping spares it) until
  /// finish() hands it out or puts it back.
  struct claim {
    block* blk{};            ///< null: nothing to claim
    std::size_t rounded{};   ///< the request
    std::size_t need{};      ///< bytes of its pages still to map (0: ready)
    std::uint8_t tag{};      ///< the library asking (segment events)
  };
  /// The best fit (or a mapped candidate) of at least `rounded` bytes; nothing if none fits, or
  /// if its pages would need mapping and !may_map.
  [[nodiscard]] claim claim_best_fit(std::size_t rounded, alloc_tag tag, bool may_map);
  /// What must go back to the driver before the claim's pages are mapped: 0 (nothing),
  /// c.need (the mapping makes a new peak: the pool gives back its wholly free large fixed
  /// segments, then unmap_for_peak), or all_free (the cap: everything wholly free).
  [[nodiscard]] std::size_t room_for(claim const& c) const noexcept;
  /// The claimed block, its pages mapped, split to the request; null (the block back on the
  /// free list) at the cap or out of memory.
  block* finish(claim const& c);
  /// The claimed block back on the free list, unused.
  void give_back(claim const& c) { free_.insert(c.blk); }
  /// Make the segment, if there is none yet: false where the driver refuses a reservation
  /// (then fixed segments only, from now on). `segments`: the pool's, by base.
  bool ensure_segment(std::size_t rounded, segment_map& segments);

  /// Unmap wholly free pages, at most `limit` bytes, the largest free blocks' first.
  /// @return bytes unmapped
  std::size_t unmap_free(std::size_t limit);
  /// About to map `need` bytes (or grow a fixed segment by it) past the peak: unmap what keeps
  /// reserved at the peak (hysteresis), or every wholly free page (without). @return bytes
  std::size_t unmap_for_peak(std::size_t need);
  static constexpr std::size_t all_free = ~std::size_t{0};
  /// The segment goes with a reset(): released if `segments` holds it wholly free (then
  /// erased there), else its pages stay mapped (retired with its live blocks).
  void drop(segment_map& segments);
  /// The pool goes: unmap and free the reservation.
  void release_at_teardown() noexcept;

  /// @throws pool_error: a block of a growable segment has no IPC handle.
  [[noreturn]] static void throw_no_ipc();

  /// The segment's free blocks (address space): a block of it comes back here (coalesce).
  [[nodiscard]] free_lists& free_list() noexcept { return free_; }
  /// Mapped bytes inside free blocks (stats' bytes_free).
  [[nodiscard]] std::size_t free_mapped_bytes() const;
  /// Bytes mapped (what the segment counts in reserved).
  [[nodiscard]] std::size_t mapped_bytes() const noexcept
  {
    return pages_ ? pages_->mapped_bytes() : 0;
  }

 private:
  bool map_for(claim const& c);  // after room_for
  [[nodiscard]] bool fits(std::size_t n) const noexcept
  {
    return cap_->fits(stats_->bytes_reserved, n);
  }
  void count_mapped(device_ptr at, std::size_t n, std::uint8_t tag);
  void count_unmapped(std::size_t n);

  driver* driver_;
  int device_;
  block_arena* arena_;
  free_lists free_;  // its large set: the segment's free blocks
  pool_stats* stats_;
  pool_cap const* cap_;
  segment_log* log_;
  std::size_t page_{};            // 0: fixed segments only
  std::size_t small_request_{};
  std::size_t reserve_{};         // options' growable_reserve (0: the device's memory)
  std::size_t room_{};
  bool hysteresis_{};
  std::unique_ptr<growable_pages> pages_;  // the segment's pages
  segment* seg_{};
  std::vector<std::unique_ptr<growable_pages>> retired_;  // left mapped by a reset
};

}  // namespace emmpool::detail
