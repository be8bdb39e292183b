/**
 * @file detail/free_list.hpp
 * @brief The device pool's free blocks: best fit, split and coalesce (as RMM's free_list).
 *
 * Two size-ordered sets, one for blocks of small segments and one for blocks of large ones
 * (a segment serves one kind of request only, so the two never mix). Best fit is the smallest
 * block of at least the requested size, lowest address first among equals: O(log n). A block
 * taken for less than its size is split, the rest going back to the set; a block returned
 * merges with its free physical neighbours (same segment: segments are separate driver
 * allocations), found in O(1) through the segment's address-ordered block list.
 *
 * take() and coalesce() change a free block's size in place, in its set, whenever it still
 * sorts between its neighbours there (reseat()): the usual case, a segment's large free rest
 * cut from the front by each allocation and grown back by each return, then costs no set
 * insertion or erasure (a tree rebalance each: a third of the allocate/free pair's
 * instructions before). The record kept in the set is the one that stays free, so a split
 * hands out a new record for the front, and a merge may keep the upper neighbour's record
 * (segment::first follows).
 *
 * The growable segment (detail/growable_space.hpp) has a free_lists of its own, whose large
 * set holds its blocks (address space): find_large(), cheapest_large() and for_each_large()
 * serve it.
 *
 * Knows nothing of streams or fences: a block reaches insert() or coalesce() only once the
 * reuse rule says no work can still touch it (reuse_rule.hpp). Not thread-safe: its pool's
 * mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/node_cache.hpp>

#include <cstddef>
#include <cstdint>
#include <set>

namespace emmpool::detail {

/// Blocks by size, lowest address first among equals: lower_bound is the best fit.
struct by_size {
  bool operator()(block const* a, block const* b) const noexcept
  {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
};
// Nodes recycled through a node_cache: splits and coalesces insert and erase constantly, and a
// malloc + free per insert/erase showed in the allocate/free pair.
using block_set = std::set<block*, by_size, cached_allocator<block*>>;

/// @brief The smallest block of `s` of at least `size` bytes (lowest address among equals).
[[nodiscard]] inline block_set::const_iterator best_fit(block_set const& s, std::size_t size)
{
  block probe;
  probe.size = size;
  return s.lower_bound(&probe);
}

/// Which way a block's order in its set moved when it changed in place.
enum class moved : std::uint8_t { lower, higher };

/// @brief Put back in order the block at `it` of `s`, whose size or address just changed in
/// place (found before the change; `way`: whether it sorts higher now, or lower): nothing to
/// do while it still sorts between its neighbours, the usual case, else out and back in
/// (which cannot throw: the erasure caches the node the insertion needs).
void reseat(block_set& s, block_set::const_iterator it, moved way);

class free_lists {
 public:
  explicit free_lists(block_arena& arena) noexcept : arena_{&arena} {}
  free_lists(free_lists const&)            = delete;
  free_lists& operator=(free_lists const&) = delete;

  /// @brief Add a free block (state becomes free) to the set of its segment's kind.
  void insert(block* blk);
  /// @brief Remove a free block (a wholly free segment about to go back to the driver, say).
  void erase(block* blk);

  /// @brief Remove every free block of `seg` (a segment retired by a reset).
  void erase_all_of(segment const& seg);

  /// @brief Take the smallest block of at least `size` bytes from the set of `kind` (small,
  /// else large); null if none. The block leaves the set unsplit: see split().
  [[nodiscard]] block* take_best_fit(std::size_t size, block_kind kind);

  /// @brief The size of the block take_best_fit() would take; 0 if none.
  [[nodiscard]] std::size_t best_fit_size(std::size_t size, block_kind kind) const
  {
    auto const& s = set_of(kind);
    auto it       = best_fit(s, size);
    return it != s.end() ? (*it)->size : 0;
  }

  /// @brief take_best_fit()'s block, cut down to its first `size` bytes if at least
  /// `min_rest` would remain (a new record: the rest keeps the old one, in the set). Null if
  /// none fits.
  [[nodiscard]] block* take(std::size_t size, block_kind kind, std::size_t min_rest);
  /// @brief As take(), of the large set's block at `it` (find_large()'s): the rest cut off in
  /// place, where an erase and a split would search the set twice more.
  [[nodiscard]] block* take_large(block_set::const_iterator it, std::size_t size,
                                  std::size_t min_rest)
  {
    return take_at(large_, it, size, min_rest);
  }
  /// @brief The large set's block at `it` (cheapest_large()'s) out of the set, whole.
  block* erase_large(block_set::const_iterator it) { return erase_at(large_, it); }

  /// @brief Cut `blk` (taken, not in a set) down to `size` bytes if at least `min_rest` would
  /// remain; the rest, a new block record, joins the free set. @return blk
  block* split(block* blk, std::size_t size, std::size_t min_rest);

  /// @brief Merge a returned block (not in a set) with its free neighbours and insert the
  /// result. Of the records merged, one survives (the lowest free neighbour's, if any, else
  /// the upper neighbour's, else blk's); the others are recycled. @return the merged block
  block* coalesce(block* blk);

  /// @brief The first block of the large set, from the best fit for `size` on through the
  /// next `candidates` larger ones, that `ready` says yes to; none_large() if none. The block
  /// stays in the set (take_large() or erase_large() takes it).
  template <class Ready>
  [[nodiscard]] block_set::const_iterator find_large(std::size_t size, Ready&& ready,
                                                     int candidates) const
  {
    for (auto it = best_fit(large_, size); candidates >= 0 && it != large_.end();
         --candidates, ++it) {
      if (ready(*it)) { return it; }
    }
    return large_.end();
  }
  /// @brief Of the large set's blocks from the best fit for `size` on through the next
  /// `candidates` larger ones, the first of the lowest `cost(blk)` (a cost of 0 ends the
  /// search); none_large() if none fits. The block stays in the set.
  template <class Cost>
  [[nodiscard]] block_set::const_iterator cheapest_large(std::size_t size, Cost&& cost,
                                                         int candidates) const
  {
    auto best         = large_.end();
    std::size_t least = 0;
    for (auto it = best_fit(large_, size); candidates >= 0 && it != large_.end();
         --candidates, ++it) {
      auto const c = cost(*it);
      if (best == large_.end() || c < least) {
        best  = it;
        least = c;
        if (c == 0) { break; }
      }
    }
    return best;
  }
  [[nodiscard]] block_set::const_iterator none_large() const noexcept { return large_.end(); }
  /// @brief Every block of the large set, largest first, while f(blk) says true.
  template <class F>
  void for_each_large(F&& f) const
  {
    for (auto it = large_.rbegin(); it != large_.rend() && f(*it); ++it) {}
  }

  /// @brief Bytes in free blocks.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// @brief Whether the large set holds a block (a take() from it can succeed).
  [[nodiscard]] bool any_large() const noexcept { return !large_.empty(); }
  /// @brief The largest free block's size (0 if none).
  [[nodiscard]] std::size_t largest() const noexcept;
  /// @brief Insertions so far: a search that missed misses again until this changes.
  [[nodiscard]] std::uint64_t insertions() const noexcept { return insertions_; }

 private:
  using set = block_set;
  [[nodiscard]] set& set_of(block const* blk) noexcept { return blk->seg->small ? small_ : large_; }
  // The set a request of `kind` takes from: the small one, else the large one (which a
  // growable request may take from too).
  [[nodiscard]] set& set_of(block_kind kind) noexcept
  {
    return kind == block_kind::small ? small_ : large_;
  }
  [[nodiscard]] set const& set_of(block_kind kind) const noexcept
  {
    return kind == block_kind::small ? small_ : large_;
  }
  block* erase_at(set& s, set::const_iterator it);  // *it, out of s and of bytes()
  block* take_at(set& s, set::const_iterator it, std::size_t size, std::size_t min_rest);

  block_arena* arena_;
  node_cache nodes_;  // before the sets: outlives them
  set small_{by_size{}, set::allocator_type{&nodes_}};
  set large_{by_size{}, set::allocator_type{&nodes_}};
  std::size_t bytes_{};
  std::uint64_t insertions_{};
};

}  // namespace emmpool::detail
