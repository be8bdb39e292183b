/**
 * @file detail/growable_space.hpp
 * @brief The device pool's growable segment: its creation, which free block serves
 * a request, when pages are mapped, and when wholly free pages go back.
 *
 * The segment is one address reservation (detail/growable_segment.hpp: its page map) whose
 * blocks live in a free_lists of its own (detail/free_list.hpp: its large set) and are split
 * and coalesced as any other. A request takes the best fit, or a slightly larger free block whose
 * pages are already mapped; placed inside it where it lacks the fewest pages (the segment's
 * unmapped end is one free block with the freed memory below it); missing pages are mapped,
 * with up to growable_room of the block beyond the request (room for the next requests of that
 * size).
 *
 * Giving pages back, or moving them: freed pages stay mapped and serve later requests (a free
 * block whose pages are mapped is preferred to a tighter fit that needs new ones), as
 * PyTorch's expandable segments keep theirs. When a request needs pages none of the free
 * blocks can lend in place, the free pages beyond options' growable_free_limit move under it
 * (the largest free blocks', from the top down, so that the mapped part of the address space
 * shrinks from its end): a cuMemUnmap and a cuMemMap each, no cuMemCreate or cuMemRelease, and
 * no new memory. New pages are made only for what the free pages within the limit, kept for
 * later requests, do not cover. A map that would pass the cap, trim, the out-of-memory ladder
 * and reset give every wholly free page back. A new peak of either kind of memory gives the
 * other kind's back no more: the fixed segments serve small requests, the growable one the
 * rest, and a program that mixes them would unmap and make the same memory again every step.
 * Every library's blocks live here, Numba's too: none has a legacy IPC handle, all share their
 * pages (share()). Not thread-safe: the pool's mutex.
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
#include <optional>
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
  [[nodiscard]] bool serves(std::size_t rounded) const noexcept
  {
    return page_ != 0 && rounded > small_request_;
  }

  /// The usual request: the best fit, or one of the next few larger free blocks, whose pages
  /// are all mapped, cut to the request in place as a fixed segment's block is. Null if none
  /// is (then claim_best_fit()).
  [[nodiscard]] block* take_mapped(std::size_t rounded);

  /// A free block chosen for a request, off the free list (so that unmapping spares it) until
  /// finish() hands it out or puts it back.
  struct claim {
    block* blk{};            ///< null: nothing to claim
    std::size_t rounded{};   ///< the request
    std::size_t need{};      ///< bytes of its pages still to map (0: ready)
    std::uint8_t tag{};      ///< the library asking (segment events)
  };
  /// The best fit of at least `rounded` bytes, placed inside it where it lacks the fewest
  /// pages; nothing if none fits, or if its pages would need mapping and !may_map.
  [[nodiscard]] claim claim_best_fit(std::size_t rounded, alloc_tag tag, bool may_map);
  /// Before the claim's pages are mapped: the free pages beyond the limit move under it (kept
  /// spare for finish()), as many as it and its room need, if `may_move` (no capture and no
  /// deferred cleanup: a move unmaps). @return bytes of new pages it still needs (the pool
  /// makes room for them first: device_pool::take_growable)
  std::size_t prepare(claim const& c, bool may_move);
  /// The claimed block, its pages mapped, split to the request; null (the block back on the
  /// free list) at the cap or out of memory. Spare pages it did not take go back to the
  /// driver if `may_release` (as may_move: no capture, no deferred cleanup), else stay spare.
  block* finish(claim const& c, bool may_release);
  /// The claimed block back on the free list, unused (joined with free neighbours: the front
  /// a placement left, or the rest of a block cut to the request).
  void give_back(claim const& c) { (void)free_.coalesce(c.blk); }
  /// Make the segment, if there is none yet: false where the driver refuses a reservation
  /// (then fixed segments only, from now on). `segments`: the pool's, by base.
  bool ensure_segment(std::size_t rounded, segment_map& segments);

  /// Unmap wholly free pages, at most `limit` bytes, the largest free blocks' first: kept
  /// spare (`keep`), or released with every spare page (all_free). @return bytes released
  std::size_t unmap_free(std::size_t limit, bool keep);
  static constexpr std::size_t all_free = ~std::size_t{0};
  /// The segment goes with a reset(): released if `segments` holds it wholly free (then
  /// erased there), else its pages stay mapped (retired with its live blocks).
  void drop(segment_map& segments);
  /// The pool goes: unmap and free the reservation.
  void release_at_teardown() noexcept;

  /// @throws pool_error: a block of a growable segment has no legacy IPC handle.
  [[noreturn]] static void throw_no_ipc();
  /// The pages under live block `blk` of the segment, from `ptr` (inside it) on, as another
  /// process maps them (device_pool::share_pages). @throws cuda_error where the driver cannot
  /// export them (pages made without a shareable handle type)
  [[nodiscard]] shared_pages share(block const& blk, device_ptr ptr);
  /// Duplicates of the descriptors `fds` (the sending process's numbers, one per page from
  /// `first_page` on, as share() gave them), for another process that asks for them: only if
  /// each is what share() gave for the page mapped there now, else std::nullopt (the block
  /// was freed and its pages moved, released or exported anew). The caller owns and closes
  /// the duplicates. @throws pool_error if a duplicate cannot be made (none is left open)
  [[nodiscard]] std::optional<std::vector<int>> duplicate_shared(device_ptr first_page,
                                                                 std::size_t page_size,
                                                                 std::vector<int> const& fds) const;
  /// Whether `seg` is this space's segment.
  [[nodiscard]] bool holds(segment const* seg) const noexcept { return seg != nullptr && seg == seg_; }

  /// The segment's free blocks (address space): a block of it comes back here (coalesce).
  [[nodiscard]] free_lists& free_list() noexcept { return free_; }
  /// Memory held and free: mapped bytes inside free blocks, and spare pages (stats'
  /// bytes_free).
  [[nodiscard]] std::size_t free_bytes() const;
  /// The largest request a free block serves with the pages mapped now (stats'
  /// largest_free_block): the longest mapped run inside one free block.
  [[nodiscard]] std::size_t largest_free() const;
  /// Memory held: mapped and spare pages (what the segment counts in reserved).
  [[nodiscard]] std::size_t held_bytes() const noexcept
  {
    return pages_ ? pages_->held_bytes() : 0;
  }

 private:
  bool map_for(claim const& c, bool may_release);  // after prepare
  [[nodiscard]] std::size_t room_of(claim const& c) const noexcept;  // what its map may cover
  [[nodiscard]] std::size_t free_mapped_bytes() const;  // mapped bytes inside free blocks
  std::size_t release_spares(std::size_t bytes);       // @return bytes released
  [[nodiscard]] bool fits(std::size_t n) const noexcept
  {
    return cap_->fits(stats_->bytes_reserved, n);
  }
  /// Map [ptr, ptr + bytes) and count it (reserved, maps, creations, a segment event at `at`),
  /// whether it succeeds or fails part way (then kept or undone: `failure`).
  void map_counted(device_ptr ptr, std::size_t bytes, device_ptr at, std::uint8_t tag,
                   growable_pages::on_failure failure);
  /// The start of the page holding `ptr`: pages count from the reservation's base, which the
  /// driver aligns to its granularity only (a 20 MiB page is no power of two).
  [[nodiscard]] device_ptr page_start(device_ptr ptr) const noexcept;
  std::size_t count_released(std::size_t held_before);  // reserved shrinks by what went

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
  std::size_t free_limit_{};      // options' growable_free_limit
  std::unique_ptr<growable_pages> pages_;  // the segment's pages
  segment* seg_{};
  std::vector<std::unique_ptr<growable_pages>> retired_;  // left mapped by a reset
};

}  // namespace emmpool::detail
