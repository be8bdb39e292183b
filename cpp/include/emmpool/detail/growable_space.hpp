/**
 * @file detail/growable_space.hpp
 * @brief The device pool's growable segment: its reservation, which free block serves a
 * request, and the pages it maps, keeps, moves and gives back (when: detail/page_policy.hpp).
 *
 * The segment is one address reservation (detail/growable_segment.hpp: its page map) whose blocks
 * live in a free_lists of its own (detail/free_list.hpp: its large set) and are split and
 * coalesced as any other. A request takes a free block whose pages are mapped (take_mapped), else
 * claims the free block, and the place in it, where it lacks the fewest pages (the best fit and
 * the next larger blocks weighed; the segment's unmapped end is one free block with the freed
 * memory below it), and maps what is missing: prepare() moves free pages beyond the policy's limit
 * under it first and says how many new pages it still needs (the pool makes room for them, or
 * waits), finish() maps them. Every library's blocks live here, Numba's too: none has a legacy IPC
 * handle, all share their pages (share()). What the pages hold goes on the pool's ledger. Not
 * thread-safe: the pool's mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/free_list.hpp>
#include <emmpool/detail/growable_segment.hpp>
#include <emmpool/detail/page_policy.hpp>
#include <emmpool/detail/pool_cap.hpp>
#include <emmpool/detail/pool_ledger.hpp>
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

/// Whether a step may unmap pages (cuMemUnmap): not during a CUDA graph capture, which forbids
/// it, nor while cleanup is deferred (detail/capture_mode.hpp).
enum class unmapping : std::uint8_t { forbidden, allowed };
/// Whether a claim may map pages: not in the ladder's first steps, which only take what is
/// held already.
enum class mapping : std::uint8_t { none, allowed };

class growable_space {
 public:
  /// `ledger`, `cap`, `log`: the pool's (what the pages hold is counted there, mapping stays
  /// within its cap, maps and unmaps are recorded there).
  growable_space(driver& drv, int device, block_arena& arena, pool_ledger& ledger,
                 pool_cap const& cap, segment_log& log)
    : driver_{&drv}, device_{device}, arena_{&arena}, free_{arena}, ledger_{&ledger}, cap_{&cap},
      log_{&log}
  {
  }

  /// Asks the driver for its page size when `o` asks for growable segments (pool mode).
  void configure(pool_options const& o) noexcept;
  /// Whether requests above small_request may use the segment (supported and asked for).
  [[nodiscard]] bool enabled() const noexcept { return policy_.page() != 0; }
  [[nodiscard]] bool serves(std::size_t rounded) const noexcept { return policy_.serves(rounded); }

  /// Make the segment, if there is none yet: false where the driver refuses a reservation
  /// (then fixed segments only, from now on). `segments`: the pool's, by base.
  bool ensure_segment(std::size_t rounded, segment_map& segments);

  /// The usual request: the best fit, or one of the next few larger free blocks, whose pages
  /// are all mapped, cut to the request in place as a fixed segment's block is. Null if none
  /// is (then claim_placed()).
  [[nodiscard]] block* take_mapped(std::size_t rounded);

  /// A free block chosen for a request, off the free list (so that unmapping spares it) until
  /// finish() hands it out or give_back() puts it back.
  struct claim {
    block* blk{};            ///< null: nothing to claim
    std::size_t rounded{};   ///< the request
    std::size_t need{};      ///< bytes of its pages still to map (0: ready)
    std::uint8_t tag{};      ///< the library asking (segment events)
  };
  /// A free block of at least `rounded` bytes, the request placed where it lacks the fewest
  /// pages, among the best fit and the next larger blocks (page_policy, Placement); nothing if
  /// none fits, or if its pages would need mapping and mapping::none.
  [[nodiscard]] claim claim_placed(std::size_t rounded, alloc_tag tag, mapping m);
  /// Before the claim's pages are mapped: the free pages beyond the policy's limit move under
  /// it (kept spare for finish()), as many as it and its room need, if unmapping is allowed.
  /// @return bytes of new pages it still needs (the pool makes room for them, or waits)
  std::size_t prepare(claim const& c, unmapping u);
  /// The claimed block, its pages mapped, split to the request; null (the block back on the
  /// free list, and what this claim mapped or moved given back where unmapping is allowed) at
  /// the cap or out of memory. @throws cuda_error (the block back on the free list)
  block* finish(claim const& c, unmapping u);
  /// The claimed block back on the free list, unused (joined with free neighbours: the front
  /// a placement left, or the rest of a block cut to the request).
  void give_back(claim const& c) { (void)free_.coalesce(c.blk); }

  /// A block of the segment whose every fence completed: free again, joined with its free
  /// neighbours.
  void release(block* blk) { (void)free_.coalesce(blk); }

  /// Unmap wholly free pages, at most `limit` bytes, the largest free blocks' first; with
  /// unmapped_pages::release every spare page goes too. @return bytes released
  std::size_t unmap_free(std::size_t limit, unmapped_pages what);
  static constexpr std::size_t all_free = ~std::size_t{0};
  /// The segment goes with a reset(): released if `segments` holds it wholly free (then
  /// erased there), else its pages stay mapped (retired with its live blocks: @return the
  /// bytes it held, which leave the ledger with the retired segment).
  std::size_t drop(segment_map& segments);
  /// The pool goes: unmap and free the reservation.
  void release_at_teardown() noexcept;

  /// @throws pool_error: a block of a growable segment has no legacy IPC handle.
  [[noreturn]] static void throw_no_ipc();
  /// The pages under live block `blk` of the segment, from `ptr` (inside it) on, as another
  /// process maps them (pool_sharing::share_pages). @throws cuda_error where the driver cannot
  /// export them (pages made without a shareable handle type)
  [[nodiscard]] shared_pages share(block const& blk, device_ptr ptr);
  /// Whether `first_page`, `page_size` and `fds` (the sending process's descriptor numbers,
  /// one per page) are what share() gives for all of live block `blk`, each descriptor the
  /// one exported for the page mapped there now.
  [[nodiscard]] bool describes_shared(block const& blk, device_ptr first_page,
                                      std::size_t page_size, std::vector<int> const& fds) const;
  /// Duplicates of those descriptors, for another process that asks for `blk`'s pages;
  /// std::nullopt unless describes_shared(). The caller owns and closes the duplicates.
  /// @throws pool_error if a duplicate cannot be made (none is left open)
  [[nodiscard]] std::optional<std::vector<int>> duplicate_shared(block const& blk,
                                                                 device_ptr first_page,
                                                                 std::size_t page_size,
                                                                 std::vector<int> const& fds) const;
  /// Whether `seg` is this space's segment.
  [[nodiscard]] bool holds(segment const* seg) const noexcept { return seg != nullptr && seg == seg_; }

  /// Memory held and free: mapped bytes inside free blocks, and spare pages (stats'
  /// bytes_free).
  [[nodiscard]] std::size_t free_bytes() const;
  /// The largest request a free block serves with the pages mapped now (stats'
  /// largest_free_block): the longest mapped run inside one free block.
  [[nodiscard]] std::size_t largest_free() const;

 private:
  // The pages' totals now, and what changed since `before` onto the ledger.
  [[nodiscard]] page_totals totals() const noexcept;
  void count(page_totals const& before);
  bool map_for(claim const& c, unmapping u);  // after prepare
  [[nodiscard]] std::size_t free_mapped_bytes() const;  // mapped bytes inside free blocks
  void release_spares() noexcept;                        // every spare page, counted
  [[nodiscard]] bool fits(std::size_t n) const noexcept
  {
    return cap_->fits(ledger_->reserved(), n);
  }
  /// Map [ptr, ptr + bytes) and count it (the ledger, a segment event at `at`), whether it
  /// succeeds or fails part way (then kept or undone: `failure`).
  void map_counted(device_ptr ptr, std::size_t bytes, device_ptr at, std::uint8_t tag,
                   growable_pages::on_failure failure);
  /// The start of the page holding `ptr`: pages count from the reservation's base, which the
  /// driver aligns to its granularity only (a 20 MiB page is no power of two).
  [[nodiscard]] device_ptr page_start(device_ptr ptr) const noexcept;

  driver* driver_;
  int device_;
  block_arena* arena_;
  free_lists free_;  // its large set: the segment's free blocks
  pool_ledger* ledger_;
  pool_cap const* cap_;
  segment_log* log_;
  page_policy policy_;
  std::unique_ptr<growable_pages> pages_;  // the segment's pages
  segment* seg_{};
  std::vector<std::unique_ptr<growable_pages>> retired_;  // left mapped by a reset
};

}  // namespace emmpool::detail
