/**
 * @file deferred_free_queue.hpp
 * @brief Freed blocks wait here until no work issued before their free can still touch them.
 *
 * THE REUSE RULE (the pool's safety argument, in one place)
 * ----------------------------------------------------------
 * A block freed at time t may still be read or written by GPU work issued before t, on any
 * stream: Numba frees from garbage-collection finalizers while kernels run, and its memalloc()
 * carries no stream. A block is therefore handed to a new owner only after a fence that
 * follows the free has completed:
 *
 *  1. free(block, stream) appends the block to the open batch of `stream` (legacy_stream for
 *     Numba's frees, which carry none). No CUDA call: frees are cheap and thread-agnostic.
 *  2. close_open_batches() records one event per open batch on that batch's stream. Events on
 *     the legacy default stream complete only after all work issued earlier to every blocking
 *     stream of the context (default, per-thread default and ordinary streams alike). Recording
 *     later than the free is always safe: it only covers more work.
 *  3. promote_completed() hands back the blocks of batches whose event has completed
 *     (cuEventQuery: never blocks). Only then do they join the free lists.
 *
 * Not covered: work on a *non-blocking* stream that is not the stream passed to free(). Such
 * users must say so with device_pool::record_stream(ptr, stream) (as PyTorch's record_stream),
 * which fences the block on that stream too, at the free.
 *
 * The one exception, stream order: a block freed on a stream S that the caller *named* (CuPy's
 * current stream, PyTorch's stream; never legacy_stream, which stands for "no stream named")
 * may go at once to a new allocation on the same S (take_same_stream). Work on one stream runs
 * in issue order, so everything the old owner issued to S precedes whatever the new owner
 * issues to S. This is the contract of CuPy's and PyTorch's own pools: memory used on another
 * stream must be synchronized with S by the user, or declared with record_stream (such a block
 * is never taken this way).
 *
 * STREAM LIFETIME: a stream handle reaches CUDA only while it is certain to be alive
 * --------------------------------------------------------------------------------------
 * Clients destroy their streams whenever they like: CuPy destroys a Stream when its Python
 * object dies, often before the arrays made on it are freed; torch.cuda.ExternalStream and RMM
 * streams may dangle too. Their own pools never touch a stream after its allocations, so such
 * programs are correct there, and must be here. Using a destroyed stream's handle is undefined
 * (cuEventRecord on one crashes), and a new stream may get the same handle. So:
 *
 *  - A stream is named by a stream_ref: its handle and the driver's unique stream id
 *    (cuStreamGetId), taken when the stream is certain to be alive: during an allocation on it
 *    (no client allocates on a dead stream), or during a free or record_stream whose caller
 *    passes it explicitly and so vouches for it. A stream_ref stored with a block (the
 *    allocation's stream, for the frees of CuPy and PyTorch, which name none or that one) is
 *    never passed to CUDA afterwards on its own say-so.
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
 *  - record_stream(ptr, S): S is the caller's, alive until the free by the same contract as
 *    PyTorch's record_stream; its fence is therefore recorded in the free itself (close_now),
 *    never later.
 *
 * This class is not thread-safe: its pool serializes access under its mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/driver.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace emmpool {

class deferred_free_queue {
 public:
  using stream_ref = detail::stream_ref;

  deferred_free_queue(driver& drv, int device) : driver_{&drv}, device_{device} {}
  ~deferred_free_queue();
  deferred_free_queue(deferred_free_queue const&)            = delete;
  deferred_free_queue& operator=(deferred_free_queue const&) = delete;

  /// @brief The stream_ref of a stream that its caller guarantees alive during this call: the
  /// per-thread stream as the legacy one (a free may come from another thread), context
  /// streams as they are, any other stream with its driver id (one cuStreamGetId).
  [[nodiscard]] stream_ref ref_of(stream_handle alive) const;

  /// @brief Add a freed block to the open batch of stream. Never calls CUDA.
  void push(detail::block* blk, stream_ref stream);

  /// @brief Take back, unfenced, a block recently freed on `stream` (its open batch, or its
  /// latest closed one, whose event may not have completed) of at least `size` bytes and at
  /// most 1/8 more, for an allocation on that same stream; null if none among the last few,
  /// and always for legacy_stream ("no stream named"). Blocks with a record_stream fence
  /// pending are never taken.
  detail::block* take_same_stream(stream_ref stream, std::size_t size);

  /// @brief Record an event on the stream of each open batch whose stream is certainly alive
  /// (a context stream, or `alive`), closing it; other batches stay open, dormant. If recording
  /// on a stream other than the legacy one fails, the device is synchronized and the batch
  /// fenced on the legacy stream instead: nothing is released unfenced, and one bad stream
  /// never wedges the queue. A failure on the legacy stream (a broken context) propagates, the
  /// batch staying open.
  /// @return the number of batches closed
  std::size_t close_open_batches(stream_ref alive = {});

  /// @brief Close the open batch of `alive` now (record_stream's fence, at the free).
  void close_now(stream_ref alive);

  /// @brief Whether dormant batches hold more than `bytes`, or are more than a few: then
  /// fence_dormant() is due (call after close_open_batches, which leaves only dormant ones).
  [[nodiscard]] bool dormant_due(std::size_t bytes) const noexcept
  {
    return open_bytes_ > bytes || open_.size() > max_dormant;
  }

  /// @brief Fence every open batch with one device synchronization and release every batch,
  /// open or closed: all work issued before now, on every stream, has completed.
  template <class Release>
  void fence_dormant(Release&& release);

  /// @brief Call release(block*) for every block of every closed batch whose event completed.
  /// Never blocks. Events of one stream complete in order, so a stream's later batches are not
  /// queried once an earlier one is found incomplete.
  template <class Release>
  void promote_completed(Release&& release);

  /// @brief Fence every batch, block until all complete, release them all.
  template <class Release>
  void drain(Release&& release);

  /// @brief Forget every batch without touching CUDA (the context is gone: reset, or exit).
  /// Returns the blocks so the pool can retire them.
  std::vector<detail::block*> abandon();

  /// @brief Destroy cached events (the context is about to be reset).
  void release_events() noexcept;
  /// @brief Forget every event without touching CUDA (forked child, process exit).
  void drop_events() noexcept;
  /// @brief Batches closed so far (events recorded to fence frees).
  [[nodiscard]] std::uint64_t batches_closed() const noexcept { return batches_closed_; }
  /// @brief Device synchronizations that fenced dormant batches so far.
  [[nodiscard]] std::uint64_t dormant_fences() const noexcept { return dormant_fences_; }

  [[nodiscard]] std::size_t waiting_bytes() const noexcept { return waiting_bytes_; }
  [[nodiscard]] std::size_t waiting_blocks() const noexcept { return waiting_blocks_; }
  /// @brief Bytes in open batches (freed, not yet fenced).
  [[nodiscard]] std::size_t open_bytes() const noexcept { return open_bytes_; }
  [[nodiscard]] bool has_open() const noexcept { return !open_.empty(); }
  [[nodiscard]] bool has_closed() const noexcept { return !closed_.empty(); }

  /// Dormant batches kept at most before fence_dormant() is due: push() searches the open
  /// batches linearly, and a program that drops a stream per task would grow them unbounded.
  static constexpr std::size_t max_dormant = 32;

 private:
  struct batch {
    stream_ref stream{};
    event_handle event{};
    std::size_t bytes{};
    std::vector<detail::block*> blocks;
  };
  template <class Release>
  void release_batch(batch& b, Release& release);
  void close(std::vector<batch>::iterator b);  // record its event; move it to closed_
  [[nodiscard]] event_handle take_event();
  void recycle(std::vector<detail::block*>&& blocks) noexcept;  // into spare_lists_

  driver* driver_;
  int device_;
  std::vector<batch> open_;     // at most one per stream; few streams, so a vector
  std::deque<batch> closed_;    // in closing order
  std::vector<event_handle> spare_events_;
  // Emptied block lists, kept with their capacity for the next batch: a stream that frees and
  // allocates in turn empties and reopens its batch on every pair.
  std::vector<std::vector<detail::block*>> spare_lists_;
  std::size_t waiting_bytes_{};
  std::size_t waiting_blocks_{};
  std::size_t open_bytes_{};
  std::uint64_t batches_closed_{};
  std::uint64_t dormant_fences_{};
};

// ---- template members ------------------------------------------------------------------------

template <class Release>
void deferred_free_queue::release_batch(batch& b, Release& release)
{
  // One block at a time, off the batch before its release: if a release throws (a failed
  // cuMemFree in passthrough mode), the batch keeps exactly the blocks not yet released.
  while (!b.blocks.empty()) {
    auto* blk = b.blocks.back();
    b.blocks.pop_back();
    waiting_bytes_ -= blk->size;
    --waiting_blocks_;
    release(blk);
  }
  if (b.event != 0) { spare_events_.push_back(b.event); }
  b.event = 0;
  recycle(std::move(b.blocks));
}

template <class Release>
void deferred_free_queue::promote_completed(Release&& release)
{
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
    if (is_blocked(it->stream)) {
      ++it;
      continue;
    }
    if (!driver_->event_completed(device_, it->event)) {
      if (nblocked == std::size(blocked)) { break; }
      blocked[nblocked++] = it->stream;
      ++it;
      continue;
    }
    release_batch(*it, release);
    it = closed_.erase(it);
  }
}

template <class Release>
void deferred_free_queue::fence_dormant(Release&& release)
{
  if (open_.empty() && closed_.empty()) { return; }
  driver_->synchronize_device(device_);  // everything issued so far, on every stream, is done
  ++dormant_fences_;
  // Every block here was freed before the synchronization, so its record_stream stream's work
  // is done too: no second fence (which, on a dead stream, would cost another synchronization).
  auto release_fenced = [&release](detail::block* blk) {
    blk->also_fence = stream_ref::none();
    release(blk);
  };
  // Move the batches out first: releases must not meet the containers being walked.
  std::vector<batch> open  = std::move(open_);
  std::deque<batch> closed = std::move(closed_);
  open_.clear();
  closed_.clear();
  open_bytes_ = 0;
  for (auto& b : closed) { release_batch(b, release_fenced); }
  for (auto& b : open) { release_batch(b, release_fenced); }
}

template <class Release>
void deferred_free_queue::drain(Release&& release)
{
  // release() may queue a block again, on its second fence (device_pool::record_stream):
  // repeat until no batch is left, open or closed.
  do {
    close_open_batches();
    if (!open_.empty()) {
      fence_dormant(release);  // dormant batches: only a device synchronization covers them
      continue;
    }
    while (!closed_.empty()) {
      driver_->synchronize_event(device_, closed_.front().event);
      release_batch(closed_.front(), release);
      closed_.pop_front();
    }
  } while (!open_.empty() || !closed_.empty());
}

}  // namespace emmpool
