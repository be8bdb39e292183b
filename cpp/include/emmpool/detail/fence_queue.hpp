/**
 * @file detail/fence_queue.hpp
 * @brief Freed blocks waiting for their fences: batches of blocks freed on one stream, each
 * closed by one event on that stream, and handed back once that event has completed (the
 * reuse rule, steps 1-3: reuse_rule.hpp). Also record_stream's two fences, and the dormant
 * batches of streams that may be dead, fenced by one device synchronization.
 *
 * It knows blocks only as records that wait: no free list, no lane, no pool. What completes
 * comes back to the caller as a list (poll, drain), never through a call back up. The stream
 * lanes (stream_lanes.hpp) take blocks out of it and resize them in place; it never calls
 * them.
 *
 * Not thread-safe: its pool serializes access under its mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/stream_key.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/reuse_rule.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace emmpool::detail {

/// @brief Blocks freed on one stream, all waiting for one fence (an event on that stream). Its
/// address stays put from its opening to its release (its blocks point at it: block::owner).
struct pending_batch {
  stream_ref stream{};
  event_handle event{};
  std::size_t bytes{};
  bool open{};                 ///< not fenced yet (its bytes count in open_bytes())
  std::vector<block*> blocks;  ///< blocks[i]->slot == i: any block leaves in O(1)
};

/// @brief A block the fence queue hands back (poll, drain).
struct fenced_block {
  block* blk;
  /// Released: the stream whose fence it waited for. Requeued: the stream it waits for now.
  stream_ref stream;
  /// Its record_stream fence completed: it now waits in the batch of the stream of its free
  /// (block::freed_on), as any block freed there (a lane may index it). Else every fence it
  /// needed has completed: it may be reused.
  bool requeued;
};

class fence_queue {
 public:
  /// `open_batch_limit`: unfenced bytes of dormant batches past which poll() fences them.
  fence_queue(driver& drv, int device, std::size_t open_batch_limit = std::size_t{64} << 20);
  ~fence_queue();
  fence_queue(fence_queue const&)            = delete;
  fence_queue& operator=(fence_queue const&) = delete;

  // ---- blocks in ------------------------------------------------------------------------------

  /// @brief blk, freed on `key`, joins key's open batch (opened if none). @throws bad_alloc
  /// before anything changed
  void push(block* blk, stream_ref key) { attach(open_batch(key), blk); }

  /// @brief blk, freed on `key` with a record_stream fence pending (block::also_fence): fenced
  /// on the recorded stream first, by an event recorded now (record_stream's caller keeps that
  /// stream alive until the free, not after: "stream lifetime"); once that completed, poll()
  /// moves it to key's batch (requeued). Returns true if the recorded stream is key's (one
  /// fence): then blk is in key's open batch already, like any block freed there.
  bool push_recorded(block* blk, stream_ref key);

  /// @brief Record the event of `alive`'s open batch now (a stream about to be out of reach:
  /// host_pool's named streams). Nothing for a stream that is not identified: its batch may
  /// hold a dead stream's frees (dormant).
  void close_now(stream_ref alive);

  /// @brief blk leaves its batch (a stream-order take or merge). blk->owner is null after.
  void detach(block* blk);

  /// @brief blk, pending, changed size in place from `before` bytes: its batch counts it.
  void resized(block const* blk, std::size_t before) noexcept
  {
    if (blk->size > before) {
      count_bytes(*blk->owner, blk->size - before, change::in);
    } else {
      count_bytes(*blk->owner, before - blk->size, change::out);
    }
  }

  // ---- blocks out -----------------------------------------------------------------------------

  /// @brief Ask the fences recorded before whether they completed; record the events of the
  /// open batches of streams alive now (context streams, and `alive`, the stream being
  /// allocated on); if dormant frees are due (fence_due()), one device synchronization fences
  /// them all. What completed is appended to `done`. Never waits but for that synchronization.
  void poll(stream_ref alive, std::vector<fenced_block>& done);

  /// @brief Fence every batch and wait until all have completed; append them all to `done`.
  void drain(std::vector<fenced_block>& done);

  /// @brief Wait for the batches fenced on `alive` (a stream alive now: its open batch is
  /// closed first; the context streams count as one, reuse_rule::same_fence) and append them
  /// to `done`, with whatever else completed by then. Waits for no other stream's work.
  void wait_for(stream_ref alive, std::vector<fenced_block>& done);
  /// @brief Bytes waiting for fences of `key`'s stream (as wait_for() counts streams).
  [[nodiscard]] std::size_t waiting_bytes_of(stream_ref key) const noexcept;

  /// @brief For a reset: drain(); if the context is unusable already (a fence fails), every
  /// block unfenced instead (its work died with the context), released into `done`.
  void drain_or_abandon(std::vector<fenced_block>& done);

  /// @brief Forget every batch without touching CUDA (the context is gone: reset, or exit).
  /// Returns the blocks as released, with their batches' streams, record_stream fences dropped.
  std::vector<fenced_block> abandon();

  /// @brief Destroy cached events (the context is about to be reset).
  void release_events() noexcept;
  /// @brief Forget every event without touching CUDA (forked child, process exit).
  void drop_events() noexcept;

  // ---- state ----------------------------------------------------------------------------------

  /// @brief Whether dormant frees wait past the open batch limit, or more streams than
  /// reuse_rule::max_dormant have open batches: then poll() fences them (a device sync).
  [[nodiscard]] bool fence_due() const noexcept
  {
    return open_bytes_ > open_batch_limit_ || open_.size() > reuse_rule::max_dormant;
  }
  /// @brief Whether a block waits, or a closed batch (emptied by stream-order takes) still
  /// holds its event.
  [[nodiscard]] bool has_waiting() const noexcept
  {
    return waiting_blocks_ != 0 || !closed_.empty();
  }
  [[nodiscard]] std::size_t waiting_bytes() const noexcept { return waiting_bytes_; }
  [[nodiscard]] std::size_t waiting_blocks() const noexcept { return waiting_blocks_; }
  /// @brief Bytes in open batches (freed, not yet fenced).
  [[nodiscard]] std::size_t open_bytes() const noexcept { return open_bytes_; }
  /// @brief Batches closed so far (events recorded to fence frees).
  [[nodiscard]] std::uint64_t batches_closed() const noexcept { return batches_closed_; }
  /// @brief Fences asked whether they completed so far (cuEventQuery calls).
  [[nodiscard]] std::uint64_t fence_queries() const noexcept { return fence_queries_; }
  /// @brief Device synchronizations that fenced dormant batches so far.
  [[nodiscard]] std::uint64_t dormant_fences() const noexcept { return dormant_fences_; }

 private:
  using batch     = pending_batch;
  using batch_ptr = std::unique_ptr<batch>;

  batch& open_batch(stream_ref stream);  // stream's, opened if none
  batch& open_new_batch(stream_ref stream);
  void attach(batch& b, block* blk);  // pending in b, counted
  enum class change : std::uint8_t { in, out };  // bytes into the batch, or out of it
  void count_bytes(batch& b, std::size_t bytes, change c) noexcept;
  void close(std::vector<batch_ptr>::iterator b);  // record its event; move it to closed_
  void close_open_batches(stream_ref alive);       // see poll()
  // What covered a batch's fences: its event, or a device synchronization (every fence).
  enum class covered : std::uint8_t { by_event, by_device_sync };
  // Every block of b into done: released, or requeued for its second fence while a
  // record_stream fence was pending (unless a device sync covered that too).
  void release_batch(batch& b, std::vector<fenced_block>& done, covered by = covered::by_event);
  // Completed closed batches, never blocking; returns how many.
  std::size_t release_completed(std::vector<fenced_block>& done);
  void fence_dormant(std::vector<fenced_block>& done);  // one device sync, then every batch
  [[nodiscard]] event_handle take_event();
  [[nodiscard]] batch_ptr new_batch();
  void recycle(batch_ptr b) noexcept;  // its event and block list kept for the next batch

  driver* driver_;
  int device_;
  std::size_t open_batch_limit_;
  std::vector<batch_ptr> open_;   // at most one per stream; few streams, so a vector
  std::deque<batch_ptr> closed_;  // in closing order
  std::vector<event_handle> spare_events_;
  // Emptied batches, kept with their block list's capacity for the next batch: a stream that
  // frees and allocates in turn empties and reopens its batch on every pair.
  std::vector<batch_ptr> spare_batches_;
  std::size_t waiting_bytes_{};
  std::size_t waiting_blocks_{};
  std::size_t open_bytes_{};
  std::uint64_t batches_closed_{};
  std::uint64_t fence_queries_{};
  std::uint64_t dormant_fences_{};
};

// ---- inline members: the path of a free -----------------------------------------------------

inline fence_queue::batch& fence_queue::open_batch(stream_ref stream)
{
  for (auto& b : open_) {
    if (b->stream == stream) { return *b; }
  }
  return open_new_batch(stream);
}

inline void fence_queue::attach(batch& b, block* blk)
{
  blk->slot = static_cast<std::uint32_t>(b.blocks.size());
  b.blocks.push_back(blk);  // the one step that may throw: before anything is counted
  blk->owner = &b;
  blk->state = block_state::pending;
  ++waiting_blocks_;
  count_bytes(b, blk->size, change::in);
}

inline void fence_queue::detach(block* blk)
{
  auto& b             = *blk->owner;
  auto* last          = b.blocks.back();  // swap-remove: the last block takes blk's slot
  last->slot          = blk->slot;
  b.blocks[blk->slot] = last;
  b.blocks.pop_back();
  blk->owner = nullptr;
  --waiting_blocks_;
  count_bytes(b, blk->size, change::out);
}

inline void fence_queue::count_bytes(batch& b, std::size_t bytes, change c) noexcept
{
  auto add = [&](std::size_t& n) { n = c == change::in ? n + bytes : n - bytes; };
  add(b.bytes);
  add(waiting_bytes_);
  if (b.open) { add(open_bytes_); }
}

}  // namespace emmpool::detail
