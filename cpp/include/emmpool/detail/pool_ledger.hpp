/**
 * @file detail/pool_ledger.hpp
 * @brief What a device pool holds from the driver, on one set of books: reserved bytes and
 * their peak, segments made and released, and the growable segment's page traffic.
 *
 * Every change is a call named for what happened (a segment made, pages mapped, a segment
 * retired by a reset), made by whoever made it happen: the pool for fixed segments, the
 * growable space for its reservation and pages. Nothing else writes these counters; a
 * statistics snapshot copies them (copy_to). Not thread-safe: the pool's mutex.
 */
#pragma once

#include <emmpool/stats.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace emmpool::detail {

/// What a growable segment's pages did in one step, from the pages' own totals around it.
struct page_traffic {
  std::size_t held_before{}, held_after{};  ///< memory held: mapped and spare pages
  std::uint64_t maps{}, unmaps{}, creates{}, releases{};
};

class pool_ledger {
 public:
  /// A fixed segment of `bytes` came from the driver.
  void segment_made(std::size_t bytes) noexcept
  {
    grow(bytes);
    ++segments_;
    ++segment_allocations_;
  }
  /// A fixed segment of `bytes` went back to the driver.
  void segment_released(std::size_t bytes) noexcept
  {
    reserved_ -= bytes;
    --segments_;
    ++segment_releases_;
  }
  /// The growable segment's address reservation: a segment that holds no memory by itself.
  void reservation_made() noexcept
  {
    ++segments_;
    ++segment_allocations_;
  }
  void reservation_released() noexcept
  {
    --segments_;
    ++segment_releases_;
  }
  /// The growable segment's pages changed what they hold (maps, moves, releases).
  void pages(page_traffic const& t) noexcept
  {
    if (t.held_after >= t.held_before) {
      grow(t.held_after - t.held_before);
    } else {
      reserved_ -= t.held_before - t.held_after;
    }
    page_maps_ += t.maps;
    page_unmaps_ += t.unmaps;
    page_creates_ += t.creates;
    page_releases_ += t.releases;
  }
  /// A reset retired a segment still holding live blocks: its `bytes` leave the books (they are
  /// the retired blocks' until freed, no longer the pool's).
  void retired(std::size_t bytes) noexcept
  {
    reserved_ -= bytes;
    --segments_;
  }

  [[nodiscard]] std::size_t reserved() const noexcept { return reserved_; }
  [[nodiscard]] std::size_t peak() const noexcept { return peak_; }
  /// Whether `bytes` more would reserve more than ever before.
  [[nodiscard]] bool past_peak(std::size_t bytes) const noexcept
  {
    return reserved_ + bytes > peak_;
  }
  void reset_peak() noexcept { peak_ = reserved_; }

  /// The counters into a statistics snapshot.
  void copy_to(pool_stats& s) const noexcept
  {
    s.bytes_reserved      = reserved_;
    s.peak_bytes_reserved = peak_;
    s.segments            = segments_;
    s.segment_allocations = segment_allocations_;
    s.segment_releases    = segment_releases_;
    s.page_maps           = page_maps_;
    s.page_unmaps         = page_unmaps_;
    s.page_creates        = page_creates_;
    s.page_releases       = page_releases_;
  }

 private:
  void grow(std::size_t bytes) noexcept
  {
    reserved_ += bytes;
    peak_ = std::max(peak_, reserved_);
  }

  std::size_t reserved_{};
  std::size_t peak_{};
  std::size_t segments_{};
  std::uint64_t segment_allocations_{};
  std::uint64_t segment_releases_{};
  std::uint64_t page_maps_{};
  std::uint64_t page_unmaps_{};
  std::uint64_t page_creates_{};
  std::uint64_t page_releases_{};
};

}  // namespace emmpool::detail
