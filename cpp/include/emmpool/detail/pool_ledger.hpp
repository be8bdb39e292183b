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

/// A growable segment's pages' own totals at one moment: the ledger books what changed between
/// two of them.
struct page_totals {
  std::size_t held{};  ///< memory held: mapped and spare pages
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
  /// The growable segment's pages changed what they hold (maps, moves, releases) from
  /// `before` to `after`.
  void pages(page_totals const& before, page_totals const& after) noexcept
  {
    if (after.held >= before.held) {
      grow(after.held - before.held);
    } else {
      reserved_ -= before.held - after.held;
    }
    page_maps_ += after.maps - before.maps;
    page_unmaps_ += after.unmaps - before.unmaps;
    page_creates_ += after.creates - before.creates;
    page_releases_ += after.releases - before.releases;
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
