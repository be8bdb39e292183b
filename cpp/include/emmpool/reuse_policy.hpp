/**
 * @file reuse_policy.hpp
 * @brief When a freed block may be handed out again: the rule, and all the code that enforces
 * it. Pools ask it "free this block from this stream" and get blocks back only once every
 * fence that rule asks for has completed; every stream decision of the pools is made here.
 *
 * THE REUSE RULE (the pool's safety argument, in one place)
 * ----------------------------------------------------------
 * A block freed at time t may still be read or written by GPU work issued before t, on any
 * stream: Numba frees from garbage-collection finalizers while kernels run, and its memalloc()
 * carries no stream. A block is therefore handed to a new owner only after a fence that
 * follows the free has completed:
 *
 *  1. free(block, stream) appends the block to the open batch of `stream` (legacy_stream for
 *     Numba's frees, which carry none; allocation_stream: the stream named when the block was
 *     allocated, as CuPy's and PyTorch's pools do). No CUDA call but the stream's id (below).
 *  2. close_open_batches() records one event per open batch on that batch's stream. Events on
 *     the legacy default stream complete only after all work issued earlier to every blocking
 *     stream of the context (default, per-thread default and ordinary streams alike). Recording
 *     later than the free is always safe: it only covers more work.
 *  3. promote_completed() hands back the blocks of batches whose event has completed
 *     (cuEventQuery: never blocks). Only then do they join the free lists.
 *
 * Not covered: work on a *non-blocking* stream that is not the stream passed to free(). Such
 * users must say so with record_stream(block, stream) (as PyTorch's record_stream): the free
 * then fences the block twice, first on that stream (an event recorded in the free itself),
 * then, once that completed, on the stream of the free. Only after both is it handed back.
 *
 * The one exception, stream order: a block freed on a stream S that the caller *named* (CuPy's
 * current stream, PyTorch's stream; never legacy_stream, which stands for "no stream named")
 * may go at once to a new allocation on the same S (take_in_stream_order). Work on one stream
 * runs in issue order, so everything the old owner issued to S precedes whatever the new owner
 * issues to S. This is the contract of CuPy's and PyTorch's own pools: memory used on another
 * stream must be synchronized with S by the user, or declared with record_stream (such a block
 * is never taken this way).
 *
 * Such blocks (pending on S, no record_stream fence: "takeable", indexed per stream by best
 * fit over every batch of S) may also change shape while they wait, as in PyTorch's pool,
 * where a block freed on S is S's at once (so that a GPU running behind the program, whose
 * fences complete late, costs S no more memory than it costs PyTorch):
 *  - split (take_in_stream_order, split_in_stream_order): S takes the front of a larger one;
 *    the rest stays in the same batch, so it waits for exactly the fence it waited for: no
 *    other stream, and no Numba request, gets it before that fence completed.
 *  - merge (free on S): a block freed on S absorbs its physical neighbours (same segment)
 *    that are takeable on S, in any batch of S, and the result joins S's *open* batch. Each
 *    neighbour was freed on S earlier; the work that may still touch it was issued to S before
 *    its free, hence before this free, and events on one stream complete in issue order: S's
 *    next event covers it as well as the one it waited for. A merged block therefore waits
 *    longer, never less.
 *  - absorb (free on the null stream, PyTorch's and CuPy's default): it also absorbs its
 *    *free* neighbours of a fixed segment (taken off the pool's free lists). No work may touch
 *    a free block, so any fence covers it; it is the null stream's until that fence completes
 *    (every allocation that misses records it: a context stream), then everyone's again.
 *    Another stream's batch may wait dormant, so it never hides free bytes. Never merged or
 *    absorbed: blocks of another stream, Numba's (legacy) blocks (but see "join" below),
 *    record_stream blocks (two fences), blocks of another segment. On the growable segment
 *    only pending neighbours: a pending block's pages are mapped and stay so (only pages
 *    wholly inside free blocks are unmapped, so a free one may have none), and a merge there
 *    turns no pending byte free.
 *
 * Join (no stream order needed): a block freed on a stream that does not order (legacy_stream:
 * Numba's frees) merges with its physical neighbours pending in that stream's *open* batch
 * (join_open). All of them wait for that batch's fence, not recorded yet, so recorded after
 * every one of their frees: the merged block waits for exactly the fence each part waited
 * for. Neighbouring frees since the last fence then come back as one block, coalesced once.
 *
 * STREAM LIFETIME: a stream handle reaches CUDA only while it is certain to be alive
 * --------------------------------------------------------------------------------------
 * Clients destroy their streams whenever they like: CuPy destroys a Stream when its Python
 * object dies, often before the arrays made on it are freed; torch.cuda.ExternalStream and RMM
 * streams may dangle too. Their own pools never touch a stream after its allocations, so such
 * programs are correct there, and must be here. Using a destroyed stream's handle is undefined
 * (cuEventRecord on one crashes), and a new stream may get the same handle. So:
 *
 *  - A stream is named by a stream_ref (its key): its handle and the driver's unique stream id
 *    (cuStreamGetId), taken when the stream is certain to be alive: during an allocation on it
 *    (allocation_key: no client allocates on a dead stream), or during a free or record_stream
 *    whose caller passes it explicitly and so vouches for it. A stream_ref stored with a block
 *    (the allocation's stream, for the frees of CuPy and PyTorch, which name none or that one)
 *    is never passed to CUDA afterwards on its own say-so. A free that passes the allocation's
 *    handle (cuda.core and RMM pass the stream they allocated on) is fenced on that stored key,
 *    unasked: if the handle is another stream's by now, the key's stream is dead, and its
 *    batch waits for the device synchronization below, which covers the new stream's work too.
 *  - Batches are keyed by stream_ref, so a new stream that reuses a dead stream's handle is
 *    another stream: it can neither take a dead stream's blocks in "stream order" (whose
 *    work it does not follow) nor have events recorded for them.
 *  - close_open_batches(alive) records events only on context streams (null, legacy: they live
 *    as long as the context) and on `alive`, the stream of the allocation being served, which
 *    its caller guarantees alive at that moment. The open batch of any other stream is
 *    *dormant*: its stream may be dead. It is fenced at the next allocation on that stream, or
 *    else by fence_dormant(): one cuCtxSynchronize (every stream's work, destroyed streams'
 *    included, done: the only fence that covers a stream nobody can name any more), which
 *    the pool does only when dormant frees pile up past a limit, and on the out-of-memory
 *    ladder, trim and reset, which wait for everything anyway.
 *  - record_stream(block, S): S is the caller's, alive until the free by the same contract as
 *    PyTorch's record_stream; its fence is therefore recorded in the free itself, never later.
 *  - A block freed by a reset's retirement, or in a forked child, never gets here: its stream
 *    may have gone with the context.
 *
 * This class is not thread-safe: its pool serializes access under its mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/free_list.hpp>
#include <emmpool/detail/node_cache.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace emmpool {

/// As the stream of a free: fence it on the stream named when the block was allocated (the
/// CuPy and PyTorch entry points, whose frees carry no stream they vouch for, use this). Never
/// reaches the driver, and names no stream to allocate on or to record.
inline constexpr stream_handle allocation_stream = ~stream_handle{0};

/// @brief How a pool uses its reuse policy.
struct reuse_options {
  /// Allocations name their stream (device_pool): blocks freed on a named stream may go back
  /// to it in stream order, and its batch is fenced at its next allocation. Otherwise
  /// (host_pool: no allocation names a stream, so a named stream is never seen alive again)
  /// the fence of a free on a named stream is recorded in the free itself.
  bool stream_order{true};
  /// Unfenced bytes of dormant batches past which maintain() fences them (one device sync).
  std::size_t open_batch_limit{64u << 20};
  /// Blocks freed on a named stream go back to that stream's allocations unfenced, by best fit
  /// over all its pending blocks, split and merged with their pending neighbours of that stream
  /// (take_in_stream_order, split_in_stream_order; the reuse rule above). Needs stream_order
  /// and the pool's block arena: device_pool in pool mode (passthrough never hands a block out
  /// twice).
  bool reuse_in_stream_order{false};
};

namespace detail {

/// @brief Blocks freed on one stream, all waiting for one fence (an event on that stream). Its
/// address stays put from its opening to its release (its blocks point at it: block::owner).
struct pending_batch {
  stream_ref stream{};
  event_handle event{};
  std::size_t bytes{};
  bool open{};                 ///< not fenced yet (its bytes count in open_bytes())
  bool ordered{};              ///< its stream orders (reuse_policy::orders): blocks indexed
  std::vector<block*> blocks;  ///< blocks[i]->slot == i: any block leaves in O(1)
};

}  // namespace detail

class reuse_policy {
 public:
  using stream_ref = detail::stream_ref;

  /// `arena`: the pool's block records, which stream-order splits and merges make and recycle
  /// (required with reuse_options::reuse_in_stream_order). `free`: the pool's free lists of
  /// fixed segments, whose blocks frees on the null stream absorb and whose best fit
  /// take_in_stream_order() weighs (optional: without it neither).
  reuse_policy(driver& drv, int device, reuse_options options = {},
               detail::block_arena* arena = nullptr, detail::free_lists* free = nullptr);
  ~reuse_policy();
  reuse_policy(reuse_policy const&)            = delete;
  reuse_policy& operator=(reuse_policy const&) = delete;

  // ---- stream keys ---------------------------------------------------------------------------

  /// @brief The stream_ref of a stream that its caller guarantees alive during this call: the
  /// per-thread stream as the legacy one (a free may come from another thread), context
  /// streams as they are, any other stream with its driver id (one cuStreamGetId).
  [[nodiscard]] stream_ref ref_of(stream_handle alive) const
  {
    if (alive == per_thread_stream) { return {legacy_stream, 0}; }
    if (is_context_stream(alive)) { return {alive, 0}; }
    return {alive, driver_->stream_id(device_, alive)};
  }

  /// @brief The key of the stream an allocation names (alive: it is allocated on).
  /// @throws std::invalid_argument for allocation_stream
  [[nodiscard]] stream_ref allocation_key(stream_handle stream) const
  {
    EMMPOOL_EXPECTS(stream != allocation_stream,
                    "allocation_stream names no stream to allocate on");
    return ref_of(stream);  // alive: the caller allocates on it (cuStreamGetId never waits)
  }

  // ---- frees ---------------------------------------------------------------------------------

  /// @brief Whether a free of `blk` from `stream` is fenced on the stream of its allocation, as
  /// the pool knows it: allocation_stream, or a stream with that stream's handle (see
  /// "stream lifetime": its key is never asked again).
  [[nodiscard]] static bool frees_on_allocation_stream(detail::block const& blk,
                                                       stream_handle stream) noexcept
  {
    return stream == allocation_stream || stream == blk.alloc_stream.handle;
  }

  /// @brief Whether free() of `blk` from `stream` calls no CUDA: a context stream or the
  /// allocation's (no id to ask), and no record_stream fence to record.
  [[nodiscard]] static bool free_is_local(detail::block const& blk, stream_handle stream) noexcept
  {
    return (is_context_stream(stream) || frees_on_allocation_stream(blk, stream)) &&
           blk.also_fence.is_none();
  }

  /// @brief Free `blk` from `stream`: allocation_stream, or the handle of the block's
  /// allocation stream, stands for that stream (which may be gone by now: never asked); any
  /// other stream is the caller's, alive now (its id is asked: the one step that may throw,
  /// before anything changed). Then
  /// `off_books(key)` lets the pool take the block off its books (key: the stream the free is
  /// fenced on), and the block joins that stream's open batch. A record_stream stream other
  /// than `key` is fenced first, by an event recorded now (its caller keeps it alive until the
  /// free, not after); the fence on `key` follows once that one completed.
  template <class OffBooks>
  void free(detail::block* blk, stream_handle stream, OffBooks&& off_books)
  {
    auto const key = frees_on_allocation_stream(*blk, stream) ? blk->alloc_stream : ref_of(stream);
    off_books(key);
    enqueue(blk, key);
  }

  /// @brief Declare that `stream` (alive now; 0 is the legacy stream) also uses `blk` until its
  /// free. One extra stream per block: the most recent, the one a caller most likely still
  /// uses. @throws std::invalid_argument for allocation_stream
  void record_stream(detail::block* blk, stream_handle stream) const;

  // ---- allocations ---------------------------------------------------------------------------

  /// @brief Take back, unfenced, for an allocation of `size` bytes on `stream`, the best fit
  /// among the blocks freed on that same stream that still wait for a fence (any batch of it),
  /// of the request's kind (`kind`; a growable request may also take a large fixed block):
  /// whole if it is at most 1/8 larger, else its front (split_in_stream_order). Null if the
  /// pool's free lists hold a tighter fit (the pool takes that: the less cut off, the less
  /// lost), if none fits, and always for legacy_stream ("no stream named") or without
  /// reuse_options::reuse_in_stream_order. A growable request splits only after the ladder's
  /// first step (its free list is not the one given here). Blocks with a record_stream
  /// fence pending are never taken. O(log n); one branch while no stream has such blocks.
  detail::block* take_in_stream_order(stream_ref stream, std::size_t size, detail::block_kind kind)
  {
    return lanes_.empty() ? nullptr : take_from_lane(stream, size, kind, false);
  }

  /// @brief take_in_stream_order()'s best fit of any size and kind, split down to `size` (the
  /// rest stays pending in the same batch: it waits for the fence it waited for), whatever
  /// the free lists hold (the pool calls it once they missed).
  detail::block* split_in_stream_order(stream_ref stream, std::size_t size, detail::block_kind kind)
  {
    return lanes_.empty() ? nullptr : take_from_lane(stream, size, kind, true);
  }

  /// @brief Whether dormant frees wait past reuse_options::open_batch_limit, or more streams
  /// than max_dormant have open batches: then maintain() fences them (a device sync).
  [[nodiscard]] bool fence_due() const noexcept
  {
    return open_bytes_ > options_.open_batch_limit || open_.size() > max_dormant;
  }

  // ---- handing blocks back: release(block*) gets only blocks whose every fence completed -----

  /// @brief Fence the frees of the streams alive now (context streams and `alive`, the stream
  /// being allocated on), fence dormant ones too if due (fence_due), and release the blocks of
  /// every completed batch. Never waits but for that device sync.
  template <class Release>
  void maintain(stream_ref alive, Release&& release);

  /// @brief Fence every batch, block until all complete, release them all.
  template <class Release>
  void drain(Release&& release);

  /// @brief For a reset: drain(); if the context is unusable already (a fence fails), release
  /// every block unfenced instead: its work died with the context.
  template <class Release>
  void drain_or_abandon(Release&& release);

  /// @brief Forget every batch without touching CUDA (the context is gone: reset, or exit).
  /// Returns the blocks, their record_stream fences dropped, so the pool can retire them.
  std::vector<detail::block*> abandon();

  /// @brief Destroy cached events (the context is about to be reset).
  void release_events() noexcept;
  /// @brief Forget every event without touching CUDA (forked child, process exit).
  void drop_events() noexcept;

  // ---- statistics ----------------------------------------------------------------------------

  /// @brief Batches closed so far (events recorded to fence frees).
  [[nodiscard]] std::uint64_t batches_closed() const noexcept { return batches_closed_; }
  /// @brief Fences asked whether they completed so far (cuEventQuery calls).
  [[nodiscard]] std::uint64_t fence_queries() const noexcept { return fence_queries_; }
  /// @brief Blocks handed out again in stream order (take_in_stream_order), unfenced.
  [[nodiscard]] std::uint64_t stream_order_reuses() const noexcept { return stream_order_reuses_; }
  /// @brief Device synchronizations that fenced dormant batches so far.
  [[nodiscard]] std::uint64_t dormant_fences() const noexcept { return dormant_fences_; }
  [[nodiscard]] std::size_t waiting_bytes() const noexcept { return waiting_bytes_; }
  [[nodiscard]] std::size_t waiting_blocks() const noexcept { return waiting_blocks_; }
  /// @brief Bytes in open batches (freed, not yet fenced).
  [[nodiscard]] std::size_t open_bytes() const noexcept { return open_bytes_; }
  /// @brief Whether a block waits, or a closed batch (emptied by stream-order takes) still
  /// holds its event.
  [[nodiscard]] bool has_waiting() const noexcept
  {
    return waiting_blocks_ != 0 || !closed_.empty();
  }
  /// @brief Changes to the batches so far (a block in or out, a batch closed or gone): a
  /// stream-order search that missed misses again until this changes.
  [[nodiscard]] std::uint64_t version() const noexcept { return version_; }

  /// Dormant batches kept at most before a fence is due: push() searches the open batches
  /// linearly, and a program that drops a stream per task would grow them unbounded.
  static constexpr std::size_t max_dormant = 32;

 private:
  using batch     = detail::pending_batch;
  using batch_ptr = std::unique_ptr<batch>;
  /// The stream-order index of one named stream: its takeable blocks (block::takeable), by
  /// best fit, one set per block_kind; the newest one kept out of the sets, so that a stream
  /// that frees and allocates one size in turn never touches them.
  struct lane {
    lane(stream_ref s, detail::node_cache* nodes);
    [[nodiscard]] bool empty() const noexcept;
    stream_ref stream;
    detail::block* newest{};
    std::array<detail::block_set, detail::block_kinds> sets;
  };

  // ---- batches: a block joins one (attach) and leaves it (detach, or its release)
  void push(detail::block* blk, stream_ref stream) { attach(open_batch(stream), blk); }
  // free() after its off_books: the block onto key's batches (out of line: inlined into every
  // free, it kept the key in memory, and cost the pair a stalled reload)
  void enqueue(detail::block* blk, stream_ref key);
  void queue_freed(detail::block* blk, stream_ref key);  // enqueue()'s record_stream fences
  batch& open_batch(stream_ref stream);                  // stream's, opened if none
  batch& open_new_batch(stream_ref stream);
  void attach(batch& b, detail::block* blk);             // pending in b, counted, indexed
  batch& detach(detail::block* blk, lane* l = nullptr);  // out of its batch and l (its lane)
  void close_now(stream_ref alive);                  // close alive's open batch, if identified
  std::size_t close_open_batches(stream_ref alive);  // see maintain()
  // Every block of b: to release(), or to its second fence while a record_stream fence was
  // pending; `synced`: a device sync covered every fence, so none is pending.
  template <class Release>
  void release_batch(batch& b, Release& release, bool synced = false);
  // Completed closed batches, never blocking; returns how many.
  template <class Release>
  std::size_t promote_completed(Release& release);
  template <class Release>
  void fence_dormant(Release& release);      // one device sync, then every batch
  void close(std::vector<batch_ptr>::iterator b);  // record its event; move it to closed_
  [[nodiscard]] event_handle take_event();
  [[nodiscard]] batch_ptr new_batch();
  void recycle(batch_ptr b) noexcept;  // its event and block list kept for the next batch

  // ---- stream order: the index, splits and merges
  /// Whether blocks freed on s may go back to s unfenced: a named, identified stream.
  [[nodiscard]] bool orders(stream_ref s) const noexcept
  {
    return options_.reuse_in_stream_order && s.handle != legacy_stream && s.identified();
  }
  [[nodiscard]] lane* lane_of(stream_ref s) noexcept
  {
    for (auto& l : lanes_) {
      if (l.stream == s) { return &l; }
    }
    return nullptr;
  }
  void index(stream_ref s, detail::block* blk);
  void index_in_sets(stream_ref s, detail::block* blk);  // index()'s other cases
  void unindex(lane& l, detail::block* blk) noexcept;
  static void erase_from_sets(lane& l, detail::block* blk) noexcept;
  // Whether blk, freed on key (no record_stream fence), absorbs its free neighbours: on the
  // null stream only (PyTorch's and CuPy's default), whose batch every allocation's miss
  // fences (a context stream): free bytes absorbed by another stream's batch could wait,
  // dormant, hidden from every other stream and from Numba, until that stream allocates again.
  [[nodiscard]] bool absorbs_free(detail::block const* blk, stream_ref key) const noexcept
  {
    return weighs_free(blk->kind) && key.is_context() && orders(key);
  }
  // Whether the free lists given here (free_: fixed segments only) hold blocks of `kind`.
  [[nodiscard]] bool weighs_free(detail::block_kind kind) const noexcept
  {
    return free_ != nullptr && kind != detail::block_kind::growable;
  }
  // Whether a neighbour of blk may merge with it: takeable (by some stream) or, if
  // absorbs_free(), free. merge_neighbours() then checks which. Few branches for
  // Numba's frees (legacy: no lane, no absorbing).
  [[nodiscard]] bool may_merge(detail::block const* blk, stream_ref key) const noexcept
  {
    bool const free_too = absorbs_free(blk, key);
    if (lanes_.empty() && !free_too) { return false; }
    auto mergeable = [&](detail::block const* n) {
      return n != nullptr && (n->takeable || (free_too && n->state == detail::block_state::free));
    };
    return mergeable(blk->prev) || mergeable(blk->next);
  }
  [[nodiscard]] detail::block* best_fit(lane& l, std::size_t size, detail::block_kind kind);
  detail::block* take_from_lane(stream_ref stream, std::size_t size, detail::block_kind kind,
                                bool split);
  detail::block* take_split(lane& l, detail::block* blk, std::size_t size);  // blk: l's
  // Whether blocks freed on key, which does not order (legacy_stream: Numba's frees), join
  // their neighbours pending in key's open batch ("join" above). Needs the pool's block arena
  // (reuse_in_stream_order: the device pool in pool mode), whose records a join recycles.
  [[nodiscard]] bool joins_open(stream_ref key) const noexcept
  {
    return options_.reuse_in_stream_order && !orders(key);
  }
  // blk, freed on key (joins_open), into its neighbour(s) pending in key's open batch, in
  // place; false if neither is: then blk goes to that batch itself.
  bool join_open(detail::block* blk, stream_ref key);
  // blk, freed on key, merged with its takeable neighbours pending on key and, if
  // absorbs_free(), its free ones. Into a neighbour pending in key's open batch, in place
  // (null returned: nothing left to push); else the others leave their batches or the free
  // lists, and the result (returned) goes to key's open batch.
  detail::block* merge_neighbours(detail::block* blk, stream_ref key);
  // b's byte counts (and the pool's) as `bytes` join b (`in`) or leave it
  void count_bytes(batch& b, std::size_t bytes, bool in) noexcept;
  // blk, pending, changes size in place by resize(): its batch counts the difference, and l's
  // set (blk takeable in l; null: blk is in no lane), where blk was found before the change,
  // keeps it in order
  template <class Resize>
  void resize_pending(lane* l, detail::block* blk, Resize&& resize);
  // blk (being freed) and other (null, or blk's neighbour opposite keep, already off its
  // list) into keep, blk's pending neighbour, in place (resize_pending; l as there); their
  // records recycled
  void merge_pending(lane* l, detail::block* keep, detail::block* blk, detail::block* other);
  // Whether the free lists' best fit for `size` is smaller than `have` bytes.
  [[nodiscard]] bool free_fits_tighter(std::size_t have, std::size_t size,
                                       detail::block_kind kind) const;

  driver* driver_;
  int device_;
  reuse_options options_;
  detail::block_arena* arena_;
  detail::free_lists* free_;
  std::vector<batch_ptr> open_;   // at most one per stream; few streams, so a vector
  std::deque<batch_ptr> closed_;  // in closing order
  std::vector<event_handle> spare_events_;
  // Emptied batches, kept with their block list's capacity for the next batch: a stream that
  // frees and allocates in turn empties and reopens its batch on every pair.
  std::vector<batch_ptr> spare_batches_;
  detail::node_cache nodes_;  // before lanes_: outlives their sets
  std::vector<lane> lanes_;   // streams with takeable blocks (and a few emptied lately)
  std::size_t waiting_bytes_{};
  std::size_t waiting_blocks_{};
  std::size_t open_bytes_{};
  std::uint64_t version_{};  // see version()
  std::uint64_t stream_order_reuses_{};
  std::uint64_t batches_closed_{};
  std::uint64_t fence_queries_{};
  std::uint64_t dormant_fences_{};
};

// ---- inline members: the path of an allocate/free pair -------------------------------------
// Short and without their rare cases (out of line), so that the pair pays no call for them.

inline reuse_policy::batch& reuse_policy::open_batch(stream_ref stream)
{
  for (auto& b : open_) {
    if (b->stream == stream) { return *b; }
  }
  return open_new_batch(stream);
}

inline void reuse_policy::attach(batch& b, detail::block* blk)
{
  blk->slot = static_cast<std::uint32_t>(b.blocks.size());
  b.blocks.push_back(blk);  // the one step that may throw: before anything is counted
  blk->owner = &b;
  blk->state = detail::block_state::pending;
  ++waiting_blocks_;
  count_bytes(b, blk->size, true);
  if (b.ordered && blk->also_fence.is_none()) { index(b.stream, blk); }
}

inline reuse_policy::batch& reuse_policy::detach(detail::block* blk, lane* l)
{
  auto& b = *blk->owner;
  if (blk->takeable) { unindex(l != nullptr ? *l : *lane_of(b.stream), blk); }
  auto* last          = b.blocks.back();  // swap-remove: the last block takes blk's slot
  last->slot          = blk->slot;
  b.blocks[blk->slot] = last;
  b.blocks.pop_back();
  blk->owner = nullptr;
  --waiting_blocks_;
  count_bytes(b, blk->size, false);
  return b;
}

inline void reuse_policy::count_bytes(batch& b, std::size_t bytes, bool in) noexcept
{
  auto add = [&](std::size_t& n) { n = in ? n + bytes : n - bytes; };
  add(b.bytes);
  add(waiting_bytes_);
  if (b.open) { add(open_bytes_); }
  ++version_;
}

inline void reuse_policy::index(stream_ref s, detail::block* blk)
{
  auto* l = lane_of(s);
  if (l == nullptr || l->newest != nullptr) {
    index_in_sets(s, blk);
    return;
  }
  l->newest     = blk;
  blk->takeable = true;
}

inline void reuse_policy::unindex(lane& l, detail::block* blk) noexcept
{
  if (l.newest == blk) {
    l.newest = nullptr;
  } else {
    erase_from_sets(l, blk);
  }
  blk->takeable = false;
}

// ---- template members ------------------------------------------------------------------------

template <class Release>
void reuse_policy::release_batch(batch& b, Release& release, bool synced)
{
  ++version_;
  // One block at a time, off the batch before its release: if a release throws (a failed
  // cuMemFree in passthrough mode), the batch keeps exactly the blocks not yet released.
  while (!b.blocks.empty()) {
    auto* blk = b.blocks.back();
    b.blocks.pop_back();
    b.bytes -= blk->size;
    waiting_bytes_ -= blk->size;
    --waiting_blocks_;
    blk->owner = nullptr;
    // Looked up anew for each: a push below may open a lane (which moves the others).
    if (blk->takeable) { unindex(*lane_of(b.stream), blk); }
    if (!blk->also_fence.is_none()) {
      blk->also_fence = stream_ref::none();
      // The record_stream fence completed (or a device sync covered both): now the free's.
      if (!synced) {
        push(blk, blk->freed_on);
        continue;
      }
    }
    release(blk);
  }
}

template <class Release>
void reuse_policy::maintain(stream_ref alive, Release&& release)
{
  // The fences recorded before are asked first, the new ones recorded after: an event just
  // recorded has not completed yet on a GPU (about 0.4 us from record to completion on an idle
  // H200, longer than a whole miss), so asking it at once is a driver call for nothing (one
  // per miss: fence_queries). Measured on an H200, that query was cheap: the pair's time did
  // not change (results/*-s13-core.md). Only when none of the earlier ones had completed is
  // the new one asked at once too: an idle GPU (and the host driver) may have completed it,
  // and a block it hands back beats a new segment.
  bool const released = promote_completed(release) != 0;
  close_open_batches(alive);
  // What is left open belongs to streams that may be gone: past the limit, one device
  // synchronization fences them all ("stream lifetime" above).
  if (fence_due()) { fence_dormant(release); }
  if (!released) { promote_completed(release); }
}

template <class Release>
std::size_t reuse_policy::promote_completed(Release& release)
{
  std::size_t released = 0;
  // Streams seen with an incomplete batch: their later batches cannot have completed.
  stream_ref blocked[8];
  std::size_t nblocked = 0;
  auto is_blocked      = [&](stream_ref s) {
    for (std::size_t i = 0; i < nblocked; ++i) {
      if (blocked[i] == s) { return true; }
    }
    return false;
  };
  for (auto it = closed_.begin(); it != closed_.end();) {
    if (is_blocked((*it)->stream)) {
      ++it;
      continue;
    }
    ++fence_queries_;
    if (!driver_->event_completed(device_, (*it)->event)) {
      if (nblocked == std::size(blocked)) { break; }
      blocked[nblocked++] = (*it)->stream;
      ++it;
      continue;
    }
    release_batch(**it, release);
    recycle(std::move(*it));
    it = closed_.erase(it);
    ++released;
  }
  return released;
}

template <class Release>
void reuse_policy::fence_dormant(Release& release)
{
  if (open_.empty() && closed_.empty()) { return; }
  driver_->synchronize_device(device_);  // everything issued so far, on every stream, is done
  ++dormant_fences_;
  // Every block here was freed before the synchronization, so its record_stream stream's work
  // is done too: no second fence (which, on a dead stream, would cost another synchronization).
  // Move the batches out first: releases must not meet the containers being walked.
  std::vector<batch_ptr> open  = std::move(open_);
  std::deque<batch_ptr> closed = std::move(closed_);
  open_.clear();
  closed_.clear();
  open_bytes_ = 0;
  for (auto& b : closed) {
    release_batch(*b, release, true);
    recycle(std::move(b));
  }
  for (auto& b : open) {
    release_batch(*b, release, true);
    recycle(std::move(b));
  }
}

template <class Release>
void reuse_policy::drain(Release&& release)
{
  // A block whose record_stream fence completes goes back into a batch for its second fence:
  // repeat until no batch is left, open or closed.
  do {
    close_open_batches({});
    if (!open_.empty()) {
      fence_dormant(release);  // dormant batches: only a device synchronization covers them
      continue;
    }
    while (!closed_.empty()) {
      driver_->synchronize_event(device_, closed_.front()->event);
      release_batch(*closed_.front(), release);
      recycle(std::move(closed_.front()));
      closed_.pop_front();
    }
  } while (!open_.empty() || !closed_.empty());
}

template <class Release>
void reuse_policy::drain_or_abandon(Release&& release)
{
  try {
    drain(release);
  } catch (...) {
    for (auto* b : abandon()) { release(b); }
  }
}

}  // namespace emmpool
