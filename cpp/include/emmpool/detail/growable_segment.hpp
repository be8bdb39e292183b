/**
 * @file detail/growable_segment.hpp
 * @brief The pages of a growable segment: one address reservation, physical memory mapped into
 * it page by page as blocks need it and unmapped page by page when no block uses it.
 *
 * A growable segment is an ordinary segment to device_pool (blocks, best fit, split, coalesce),
 * except that its free blocks are address space, not memory: a block handed out must first
 * have every page it overlaps mapped (map), and a page that lies wholly inside one free block
 * may be unmapped (unmap_inside). Free blocks are coalesced, so a page overlapped by no
 * allocated or pending block lies inside one free block. "Free" means the block came back
 * through the fence queue (its fence completed, reuse_rule.hpp): no work
 * issued before its free can touch it, so unmapping it cannot pull memory from under a kernel.
 * Pending blocks (and their pages) are never unmapped.
 *
 * One physical allocation per page (as PyTorch's expandable segments), so that any page can
 * go back on its own, or move: a page unmapped from a free block may be kept ("spare") and
 * mapped again under another block, which costs a cuMemUnmap and a cuMemMap where a new page
 * would cost a cuMemCreate too (and its release a cuMemRelease). Spare pages are memory the
 * pool holds. Which pages go back or move when: detail/growable_space.hpp. Pages are created
 * exportable where the driver allows (IPC: export). Internal to device_pool; not thread-safe
 * (the pool's mutex).
 */
#pragma once

#include <emmpool/driver.hpp>

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emmpool::detail {

/// What unmapped pages become: spare (held, to be mapped elsewhere) or released to the driver.
enum class unmapped_pages : std::uint8_t { keep_spare, release };

class growable_pages {
 public:
  /// Reserves `bytes` (rounded up to pages) of address space. @throws cuda_error
  growable_pages(driver& drv, int device, std::size_t page_size, std::size_t bytes);
  /// Calls no driver: release() first, or the reservation and its pages are left to the
  /// driver (process exit, a context reset).
  ~growable_pages() = default;
  growable_pages(growable_pages const&)            = delete;
  growable_pages& operator=(growable_pages const&) = delete;

  [[nodiscard]] device_ptr base() const noexcept { return base_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t page_size() const noexcept { return page_; }
  /// Bytes physically mapped.
  [[nodiscard]] std::size_t mapped_bytes() const noexcept { return mapped_pages_ * page_; }
  /// Bytes of spare pages: held, not mapped.
  [[nodiscard]] std::size_t spare_bytes() const noexcept { return spare_.size() * page_; }
  /// Memory held: mapped and spare pages (what the pool counts as reserved).
  [[nodiscard]] std::size_t held_bytes() const noexcept { return mapped_bytes() + spare_bytes(); }

  /// Bytes of unmapped pages overlapping [ptr, ptr + bytes).
  [[nodiscard]] std::size_t unmapped_in(device_ptr ptr, std::size_t bytes) const noexcept
  {
    return ptr + bytes <= solid_end_ ? 0 : unmapped_past_prefix(ptr, bytes);
  }
  /// Where in [ptr, ptr + bytes) a range of `want` bytes lacks the fewest pages: at ptr or at
  /// a page start, the lowest of the best; and the bytes of pages it lacks.
  [[nodiscard]] std::pair<device_ptr, std::size_t> fewest_unmapped(
    device_ptr ptr, std::size_t bytes, std::size_t want) const noexcept;
  /// Mapped bytes inside [ptr, ptr + bytes) (a page partly inside counts its part).
  [[nodiscard]] std::size_t mapped_overlap(device_ptr ptr, std::size_t bytes) const noexcept;
  /// The longest run of mapped bytes inside [ptr, ptr + bytes): the largest request a free
  /// block of that range serves with no new page.
  [[nodiscard]] std::size_t longest_mapped_run(device_ptr ptr, std::size_t bytes) const noexcept;
  /// What a failed map() does with the pages it mapped before it failed.
  enum class on_failure : std::uint8_t {
    keep,  ///< they stay mapped (under a block that is free again, where mapped pages are
           ///< allowed): undoing them would call cuMemUnmap, which a capture forbids
    undo,  ///< unmapped again: a page that was spare before becomes spare again, a page this
           ///< call made is released (the driver holds what it held before)
  };
  /// Map every unmapped page overlapping [ptr, ptr + bytes), spare pages first. On failure the
  /// pages this call mapped stay or go as `failure` says; a page made but not mapped stays
  /// spare (keep) or is released (undo); either way the caller counts what changed from
  /// held_bytes(), mapped_bytes() and creates().
  /// @throws out_of_memory, cuda_error
  void map(device_ptr ptr, std::size_t bytes, on_failure failure = on_failure::keep);
  /// Unmap the mapped pages lying wholly inside [ptr, ptr + bytes), the highest first, at
  /// most `limit` bytes of them; kept spare, or released. @return bytes unmapped
  /// @throws cuda_error (pages unmapped before the failure stay unmapped: the counts say)
  std::size_t unmap_inside(device_ptr ptr, std::size_t bytes, std::size_t limit,
                           unmapped_pages what);
  /// Release spare pages, at most `limit` bytes. @return bytes released
  std::size_t release_spares(std::size_t limit);
  /// Unmap and release every page and free the reservation. @throws cuda_error (consistent
  /// as above)
  void release();

  /// A file descriptor for the mapped page holding `ptr`, exported once per page and kept
  /// until the page is released (IPC: another process maps it). An exported descriptor holds
  /// its page's memory in the driver while open, here or in a process it was passed to:
  /// releasing the page closes the pool's. @throws pool_error if the page is not mapped,
  /// cuda_error where the driver cannot export it
  [[nodiscard]] int export_page(device_ptr ptr);
  /// The descriptor export_page() gave for the page mapped at `ptr` (a page start), or -1 if
  /// no page is mapped there or it was never exported.
  [[nodiscard]] int exported_at(device_ptr ptr) const noexcept;

  /// Counters for statistics and tests: driver calls, and pages made and released.
  [[nodiscard]] std::uint64_t maps() const noexcept { return maps_; }
  [[nodiscard]] std::uint64_t unmaps() const noexcept { return unmaps_; }
  [[nodiscard]] std::uint64_t creates() const noexcept { return creates_; }
  [[nodiscard]] std::uint64_t releases() const noexcept { return releases_; }

 private:
  [[nodiscard]] bool mapped(std::size_t page) const noexcept
  {
    return page < mapped_.size() && mapped_[page];
  }
  void unmap_page(std::size_t page, unmapped_pages what);
  [[nodiscard]] physical_handle take_page();     // a spare, else a new one
  // A failed map(on_failure::undo): the pages it mapped, (page, made by it), go as they came.
  // Never throws: what the driver refuses to undo stays mapped or spare, counted.
  void undo_map(std::vector<std::pair<std::size_t, bool>> const& mapped) noexcept;
  void release_page(physical_handle h);          // to the driver, its descriptor closed
  // unmapped_in() of a range that ends past the mapped prefix: page by page
  [[nodiscard]] std::size_t unmapped_past_prefix(device_ptr ptr, std::size_t bytes) const noexcept;

  driver* driver_;
  int device_;
  std::size_t page_;
  std::size_t size_;
  device_ptr base_{};
  // Per page, grown on demand up to the highest page ever mapped (beyond: unmapped).
  std::vector<physical_handle> handles_;
  std::vector<bool> mapped_;
  std::size_t mapped_pages_{};
  // [base_, solid_end_): pages all mapped, from the first. Inside it unmapped_in() answers
  // without dividing by the page size (no power of two), the test every request makes.
  device_ptr solid_end_{};
  std::vector<physical_handle> spare_;  // held, unmapped, newest last
  std::unordered_map<physical_handle, int> fds_;  // exported pages' descriptors
  std::uint64_t maps_{};
  std::uint64_t unmaps_{};
  std::uint64_t creates_{};
  std::uint64_t releases_{};
};

}  // namespace emmpool::detail
