/**
 * @file detail/stream_lanes.hpp
 * @brief The blocks that wait for their fence (reuse_rule.hpp), and stream order over them:
 * the fence queue's batches (owned here), and each named stream's lane, which indexes the
 * blocks freed on it that still wait ("takeable"), by best fit, so that the stream's next
 * allocations take them back unfenced, whole or split; blocks freed there merge with their
 * pending neighbours, absorb free ones (null stream) or join the open batch (no stream order).
 *
 * Below the pool, above the fence queue: the only code that changes batches. The pool hands
 * it every freed block (pend, join, merge) and asks it for what completed (poll, drain: each
 * block out of its lane, the blocks back as a list); it never calls up. The free lists are the
 * pool's alone: a request's take() reads them (a tighter free fit wins), and the free
 * neighbours a merge absorbs the pool takes off them first.
 *
 * Not thread-safe: its pool serializes access under its mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/fence_queue.hpp>
#include <emmpool/detail/free_list.hpp>
#include <emmpool/detail/node_cache.hpp>
#include <emmpool/reuse_rule.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace emmpool::detail {

class stream_lanes {
 public:
  /// `enabled`: the pool reuses in stream order (pool mode; passthrough never hands a block
  /// out twice). Off, no stream orders, nothing is indexed, merged or joined.
  /// `open_batch_limit`: the fence queue's (fence_queue.hpp).
  stream_lanes(driver& drv, int device, std::size_t open_batch_limit, block_arena& arena,
               bool enabled);
  stream_lanes(stream_lanes const&)            = delete;
  stream_lanes& operator=(stream_lanes const&) = delete;

  /// @brief Whether blocks freed on `s` go back to `s` unfenced (reuse_rule::orders).
  [[nodiscard]] bool orders(stream_ref s) const noexcept { return reuse_rule::orders(s, enabled_); }

  /// @brief The batches, to read (statistics, whether a fence is due); changed only here.
  [[nodiscard]] fence_queue const& fences() const noexcept { return fences_; }

  // ---- a free ---------------------------------------------------------------------------------

  /// @brief blk, freed on `key`, waits in key's open batch: takeable on key if key orders.
  /// @throws bad_alloc before anything changed
  void pend(block* blk, stream_ref key)
  {
    fences_.push(blk, key);
    if (orders(key)) { index(key, blk); }
  }
  /// @brief blk, freed on `key` with a record_stream fence (block::also_fence): fenced on the
  /// recorded stream first (an event recorded now), then in key's batch, takeable once there.
  void pend_recorded(block* blk, stream_ref key)
  {
    if (fences_.push_recorded(blk, key) && orders(key)) { index(key, blk); }
  }

  /// @brief Whether blocks freed on `key`, which does not order (legacy_stream: Numba's frees),
  /// join their neighbours pending in key's open batch ("join" in reuse_rule.hpp).
  [[nodiscard]] bool joins_open(stream_ref key) const noexcept
  {
    return enabled_ && !orders(key);
  }
  /// @brief blk, freed on key (joins_open), into its neighbour(s) pending in key's open batch,
  /// in place; false if neither is: then blk goes to that batch itself.
  bool join_open(block* blk, stream_ref key);

  /// @brief Whether blocks freed on `key` absorb their free neighbours (of a fixed segment:
  /// reuse_rule::absorbs_free): the pool takes those off its free lists before merging.
  [[nodiscard]] bool absorbs_free(block const* blk, stream_ref key) const noexcept
  {
    return reuse_rule::absorbs_free(blk->kind, key, enabled_);
  }
  /// @brief Whether a neighbour of blk, freed on key, may merge with it: takeable (by some
  /// stream) or, if key absorbs free blocks, free. merge_neighbours() then checks which. Few
  /// branches for Numba's frees (legacy: no lane, no absorbing).
  [[nodiscard]] bool may_merge(block const* blk, stream_ref key) const noexcept
  {
    bool const free_too = absorbs_free(blk, key);
    if (lanes_.empty() && !free_too) { return false; }
    auto mergeable = [&](block const* n) {
      return n != nullptr && (n->takeable || (free_too && n->state == block_state::free));
    };
    return mergeable(blk->prev) || mergeable(blk->next);
  }
  /// @brief blk, freed on key, merged with its takeable neighbours pending on key and, if key
  /// absorbs free blocks, its free ones (which the caller took off its free lists). Into a
  /// neighbour pending in key's open batch, in place: null returned, nothing left to pend.
  /// Else the others leave their batches, and the result (returned) is for pend().
  block* merge_neighbours(block* blk, stream_ref key);

  // ---- fences completed -----------------------------------------------------------------------

  /// @brief Ask the fences (fence_queue::poll, `alive`: the stream of the allocation being
  /// served): every block whose fences completed leaves its lane and is appended to
  /// `released`; one whose record_stream fence completed waits in the batch of its free now.
  void poll(stream_ref alive, std::vector<block*>& released);
  /// @brief The same, once every fence has completed (fence_queue::drain: waits); or, given
  /// `only` (a stream alive now), once that stream's have (fence_queue::wait_for: waits for
  /// no other stream's work).
  void drain(std::vector<block*>& released, std::optional<stream_ref> only = std::nullopt);
  /// @brief For a reset: drain(), or every block unfenced if the context is unusable
  /// (fence_queue::drain_or_abandon).
  void drain_or_abandon(std::vector<block*>& released);
  /// @brief Forget every batch and lane without touching CUDA (the pool goes as the driver may
  /// be gone).
  void abandon() noexcept;
  /// @brief Destroy cached events (the context is about to be reset).
  void release_events() noexcept { fences_.release_events(); }
  /// @brief Forget every event without touching CUDA (forked child, process exit).
  void drop_events() noexcept { fences_.drop_events(); }

  // ---- an allocation --------------------------------------------------------------------------

  /// @brief Take back, unfenced, for an allocation of `size` bytes on `stream`, the best fit
  /// among the blocks freed on that stream that still wait for a fence (any batch of it), of
  /// the request's kind (a growable request may also take a large fixed block): whole if a
  /// near fit (reuse_rule::near_fit), else its front (split()). Null if the free lists hold a
  /// tighter fit (the pool takes that: the less cut off, the less lost), if none fits, and
  /// always for a stream that does not order. A growable request splits only after the
  /// ladder's first step (its free list is not the one given here). O(log n); one branch while
  /// no stream has takeable blocks. `free`: the pool's free lists of fixed segments, read.
  block* take(stream_ref stream, std::size_t size, block_kind kind, free_lists const& free)
  {
    return lanes_.empty() ? nullptr : take_from_lane(stream, size, kind, cut::near_fit, &free);
  }
  /// @brief take()'s best fit of any size and kind, split down to `size` (the rest stays
  /// pending in the same batch: it waits for the fence it waited for), whatever the free lists
  /// hold (the pool calls it once they missed).
  block* split(stream_ref stream, std::size_t size, block_kind kind)
  {
    return lanes_.empty() ? nullptr : take_from_lane(stream, size, kind, cut::any, nullptr);
  }

  /// @brief Blocks handed out again in stream order so far, unfenced.
  [[nodiscard]] std::uint64_t reuses() const noexcept { return reuses_; }

 private:
  /// One named stream's takeable blocks, by best fit, one set per block_kind; the newest one
  /// kept out of the sets, so that a stream that frees and allocates one size in turn never
  /// touches them.
  struct lane {
    lane(stream_ref s, node_cache* nodes);
    [[nodiscard]] bool empty() const noexcept;
    stream_ref stream;
    block* newest{};
    std::array<block_set, block_kinds> sets;
  };

  /// blk, pending in s's batch with no record_stream fence, s ordering: takeable on s.
  void index(stream_ref s, block* blk);
  /// blk has left the fence queue (its fences completed; its batch's stream `s`): out of s's
  /// lane, if it was takeable.
  void forget(block* blk, stream_ref s) noexcept
  {
    if (blk->takeable) { unindex(*lane_of(s), blk); }
  }
  void clear() noexcept;  // forget every lane
  // What the fence queue handed back (fenced_): out of the lanes, into `released`.
  void settle(std::vector<block*>& released);

  [[nodiscard]] lane* lane_of(stream_ref s) noexcept
  {
    for (auto& l : lanes_) {
      if (l.stream == s) { return &l; }
    }
    return nullptr;
  }
  void index_in_sets(stream_ref s, block* blk);  // index()'s other cases
  void unindex(lane& l, block* blk) noexcept;
  static void erase_from_sets(lane& l, block* blk) noexcept;
  void take_out(block* blk, lane* l = nullptr);  // out of its lane (l, if known) and batch
  [[nodiscard]] static bool weighs_free(block_kind kind) noexcept
  {
    return kind != block_kind::growable;  // the free lists given: fixed segments only
  }
  [[nodiscard]] block* best_fit(lane& l, std::size_t size, block_kind kind);
  // How take_from_lane() may cut: take()'s rule (whole if a near fit, else the front where
  // the free lists fit no tighter), or split()'s (any fit, cut down)
  enum class cut : std::uint8_t { near_fit, any };
  // free: null for cut::any (the free lists missed already)
  block* take_from_lane(stream_ref stream, std::size_t size, block_kind kind, cut how,
                        free_lists const* free);
  block* take_split(lane& l, block* blk, std::size_t size);  // blk: l's
  // blk, pending, changes size in place by resize(): its batch counts the difference, and l's
  // set (blk takeable in l; null: blk is in no lane), where blk was found before the change,
  // keeps it in order
  template <class Resize>
  void resize_pending(lane* l, block* blk, Resize&& resize);
  // blk (being freed) and other (null, or blk's neighbour opposite keep, already off its
  // list) into keep, blk's pending neighbour, in place (resize_pending; l as there); their
  // records recycled
  void merge_pending(lane* l, block* keep, block* blk, block* other);
  // Whether the free lists' best fit for `size` is smaller than `have` bytes.
  [[nodiscard]] static bool free_fits_tighter(free_lists const& free, std::size_t have,
                                              std::size_t size, block_kind kind);

  fence_queue fences_;
  std::vector<fenced_block> fenced_;  // what the fence queue handed back, being settled
  block_arena* arena_;
  bool enabled_;
  node_cache nodes_;         // before lanes_: outlives their sets
  std::vector<lane> lanes_;  // streams with takeable blocks (and a few emptied lately)
  std::uint64_t reuses_{};
};

// ---- inline members: the path of an allocate/free pair -------------------------------------

inline void stream_lanes::index(stream_ref s, block* blk)
{
  auto* l = lane_of(s);
  if (l == nullptr || l->newest != nullptr) {
    index_in_sets(s, blk);
    return;
  }
  l->newest     = blk;
  blk->takeable = true;
}

inline void stream_lanes::unindex(lane& l, block* blk) noexcept
{
  if (l.newest == blk) {
    l.newest = nullptr;
  } else {
    erase_from_sets(l, blk);
  }
  blk->takeable = false;
}

}  // namespace emmpool::detail
