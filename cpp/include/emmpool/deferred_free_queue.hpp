/**
 * @file deferred_free_queue.hpp
 * @brief Freed blocks wait here until no work issued before their free can still touch them.
 *
 * THE REUSE RULE (the pool's safety argument, in one place)
 * ----------------------------------------------------------
 * A block freed at time t may still be read or written by GPU work issued before t, on any
 * stream: Numba frees from garbage-collection finalizers while kernels run, and its memalloc()
 * carries no stream. A block is therefore handed to a new owner only after an event, recorded
 * *after* the free, has completed:
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
 * which moves the block's free onto that stream's batch as well.
 *
 * The one exception, stream order: a block freed on a stream S that the caller *named* (CuPy's
 * current stream, PyTorch's stream; never legacy_stream, which stands for "no stream named")
 * may go at once to a new allocation on the same S (take_same_stream). Work on one stream runs
 * in issue order, so everything the old owner issued to S precedes whatever the new owner
 * issues to S. This is the contract of CuPy's and PyTorch's own pools: memory used on another
 * stream must be synchronized with S by the user, or declared with record_stream (such a block
 * is never taken this way).
 *
 * This class is not thread-safe: device_pool serializes access under its mutex.
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
  deferred_free_queue(driver& drv, int device) : driver_{&drv}, device_{device} {}
  ~deferred_free_queue();
  deferred_free_queue(deferred_free_queue const&)            = delete;
  deferred_free_queue& operator=(deferred_free_queue const&) = delete;

  /// @brief Add a freed block to the open batch of stream. Never calls CUDA.
  void push(detail::block* blk, stream_handle stream);

  /// @brief Take back, unfenced, a block recently freed on `stream` (its open batch, or its
  /// latest closed one, whose event may not have completed) of at least `size` bytes and at
  /// most 1/8 more, for an allocation on that same stream; null if none among the last few.
  /// The caller guarantees `stream` is a named stream (not legacy_stream). Blocks with a
  /// record_stream fence pending are never taken.
  detail::block* take_same_stream(stream_handle stream, std::size_t size);

  /// @brief Record an event on the stream of each open batch, closing it. If recording on a
  /// stream other than the legacy one fails (the stream was destroyed, say), the device is
  /// synchronized and the batch fenced on the legacy stream instead: nothing is released
  /// unfenced, and one bad stream never wedges the queue. A failure on the legacy stream (a
  /// broken context) propagates, the batch staying open.
  /// @return the number of batches closed
  std::size_t close_open_batches();

  /// @brief Call release(block*) for every block of every closed batch whose event completed.
  /// Never blocks. Events of one stream complete in order, so a stream's later batches are not
  /// queried once an earlier one is found incomplete.
  template <class Release>
  void promote_completed(Release&& release);

  /// @brief Close open batches, block until every closed batch completes, release them all.
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

  [[nodiscard]] std::size_t waiting_bytes() const noexcept { return waiting_bytes_; }
  [[nodiscard]] std::size_t waiting_blocks() const noexcept { return waiting_blocks_; }
  [[nodiscard]] bool has_open() const noexcept { return !open_.empty(); }
  [[nodiscard]] bool has_closed() const noexcept { return !closed_.empty(); }

 private:
  struct batch {
    stream_handle stream{};
    event_handle event{};
    std::vector<detail::block*> blocks;
  };
  template <class Release>
  void release_batch(batch& b, Release& release);
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
  std::uint64_t batches_closed_{};
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
  spare_events_.push_back(b.event);
  b.event = 0;
  recycle(std::move(b.blocks));
}

template <class Release>
void deferred_free_queue::promote_completed(Release&& release)
{
  // Streams seen with an incomplete batch: their later batches cannot have completed.
  stream_handle blocked[8];
  std::size_t nblocked = 0;
  auto is_blocked      = [&](stream_handle s) {
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
void deferred_free_queue::drain(Release&& release)
{
  // release() may queue a block again, on its second fence (device_pool::record_stream):
  // repeat until no batch is left, open or closed.
  do {
    close_open_batches();
    while (!closed_.empty()) {
      driver_->synchronize_event(device_, closed_.front().event);
      release_batch(closed_.front(), release);
      closed_.pop_front();
    }
  } while (!open_.empty());
}

}  // namespace emmpool
