/**
 * @file detail/page_policy.hpp
 * @brief When the growable segment maps, keeps, moves and gives back pages, and when a
 * request waits instead of mapping: the policy, in one place, apart from the mechanism
 * (detail/growable_space.hpp maps and moves; the pool's ladder asks it when to wait). Its
 * options are pool_options' growable_* fields.
 *
 * - Page size: the driver's granularity (2 MiB on today's GPUs), or growable_page_size rounded
 *   up to a multiple of it (20 MiB by default, PyTorch's large segment): what one cuMemCreate +
 *   cuMemMap serves. Larger pages mean fewer driver calls per growth and coarser returns (a page
 *   goes back only once no live block lies on it): on programs that mix libraries, about no
 *   driver call per step after warm-up, where 2 MiB pages move many pages per step, for more
 *   memory on a churn of random sizes (benchmarks/replay.py; docs/limits.md has the figures).
 * - Reservation: the address space of the device's memory (at most the cap), so that growth
 *   never runs out of addresses before memory; growable_reserve where set. Never more than the
 *   device's memory for a first request larger than that: such a request fails at once.
 * - Placement: a request first looks, from its best fit up through mapped_candidates free
 *   blocks, for one whose pages are all mapped where it would start: a slightly larger block
 *   beats a best fit that needs pages (no driver call, no page moved at a new peak). One that
 *   finds none goes where it lacks the fewest pages, among the best fit and the next
 *   placement_candidates larger free blocks (the smallest first among equals): mapped pages
 *   deeper in a larger block are reused before any page is mapped or moved. On the mixed
 *   programs' recorded traces (benchmarks/replay.py --traces) the best fit alone moved more
 *   pages per step (benchmarks/results/ has the figures).
 * - Room: a map covers up to growable_room of the free block it carves (room for the next
 *   requests of that size): without it a caller that frees and allocates mid-sized blocks on no
 *   stream would miss on every request (its freed block still pending), where a fixed segment
 *   has up to large_segment to spare.
 * - Keeping and moving: freed pages stay mapped and serve later requests, as PyTorch's
 *   expandable segments keep theirs, up to growable_free_limit bytes of them inside free blocks.
 *   Beyond the limit, a request that lacks pages moves free pages under its block first (the
 *   largest free blocks', from the top down): a cuMemUnmap and a cuMemMap each, no new memory.
 * - Waiting at a new peak: new pages that would pass the peak while frees of the requesting
 *   stream that could cover them wait for their fence are not mapped: the request waits for that
 *   stream's frees first (a step of the out-of-memory ladder, device_pool.cpp). Else a program
 *   whose frees run ahead of the GPU (PyTorch's, CuPy's) makes again, in pages that stay, the
 *   memory in flight. Its own stream's only: what it asks for next runs after its earlier work
 *   anyway, so the wait costs the CPU's lead, never another stream's concurrency.
 * - Giving back: trim, the cap and the out-of-memory ladder unmap every wholly free page. A new
 *   peak of either kind of memory gives the other kind's back no more: the fixed segments serve
 *   small requests, the growable one the rest, and a program that mixes them would unmap and
 *   make the same memory again every step.
 */
#pragma once

#include <emmpool/pool_options.hpp>
#include <emmpool/round_up.hpp>

#include <algorithm>
#include <cstddef>

namespace emmpool::detail {

class page_policy {
 public:
  page_policy() noexcept = default;
  /// `granularity`: the driver's page size for the device, 0 where it has no virtual memory
  /// management (then the pool has fixed segments only).
  page_policy(pool_options const& o, std::size_t granularity) noexcept
    : small_request_{o.small_request},
      reserve_{o.growable_reserve},
      room_{o.growable_room},
      free_limit_{o.growable_free_limit}
  {
    if (o.segments != segment_kind::growable || o.mode != pool_mode::pool || granularity == 0) {
      return;
    }
    page_ = std::max(granularity, round_up(o.growable_page_size, granularity));
  }

  /// Free blocks a request looks through for one mapped where it would start (Placement,
  /// above): on the allocation's usual path, so few.
  static constexpr int mapped_candidates = 8;
  /// Free blocks beyond the best fit that a placement weighs (Placement, above): beyond a few
  /// the recorded traces placed no differently, and each costs a walk over its pages.
  static constexpr int placement_candidates = 16;

  /// The page size; 0: fixed segments only.
  [[nodiscard]] std::size_t page() const noexcept { return page_; }
  /// The driver refused a reservation: fixed segments from now on.
  void disable() noexcept { page_ = 0; }
  /// Whether a request of `rounded` bytes uses the growable segment.
  [[nodiscard]] bool serves(std::size_t rounded) const noexcept
  {
    return page_ != 0 && rounded > small_request_;
  }

  /// The address space to reserve, for a first request of `rounded` bytes under `cap` (where
  /// the policy serves requests: page() above 0).
  [[nodiscard]] std::size_t reservation(std::size_t cap, std::size_t device_memory,
                                        std::size_t rounded) const noexcept
  {
    std::size_t const bytes = reserve_ != 0 ? reserve_ : std::min(cap, device_memory);
    return std::max(round_up(bytes, page_), round_up(std::min(rounded, device_memory), page_));
  }

  /// What a map for a request of `rounded` bytes in a free block of `block` bytes covers.
  [[nodiscard]] std::size_t room(std::size_t block, std::size_t rounded) const noexcept
  {
    return std::min(block, std::max(rounded, room_));
  }

  /// Bytes of free pages to move under a claim that lacks `wanted` bytes of pages, while free
  /// blocks keep `kept` mapped bytes and `spare` bytes are held unmapped: those beyond the
  /// limit, as many as the claim lacks.
  [[nodiscard]] std::size_t to_move(std::size_t kept, std::size_t wanted,
                                    std::size_t spare) const noexcept
  {
    if (kept <= free_limit_ || wanted <= spare) { return 0; }
    return std::min(kept - free_limit_, wanted - spare);
  }

  /// Whether a request whose `fresh` bytes of new pages would pass the peak waits for its own
  /// stream's frees first: `own_waiting` bytes of them wait for their fence.
  [[nodiscard]] static constexpr bool waits_at_new_peak(std::size_t fresh, bool past_peak,
                                                        std::size_t own_waiting) noexcept
  {
    return fresh != 0 && past_peak && own_waiting >= fresh;
  }

 private:
  std::size_t page_{};  // 0: fixed segments only
  std::size_t small_request_{};
  std::size_t reserve_{};
  std::size_t room_{};
  std::size_t free_limit_{};
};

}  // namespace emmpool::detail
