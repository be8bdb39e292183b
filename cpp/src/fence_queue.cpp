#include <emmpool/detail/fence_queue.hpp>

#include <emmpool/error.hpp>
#include <emmpool/reuse_rule.hpp>

#include <iterator>
#include <utility>

namespace emmpool::detail {

fence_queue::fence_queue(driver& drv, int device, std::size_t open_batch_limit)
  : driver_{&drv}, device_{device}, open_batch_limit_{open_batch_limit}
{
}

fence_queue::~fence_queue()
{
  // Batches still here belong to a pool being destroyed, which has drained or abandoned them.
  release_events();
}

// ---- blocks in ------------------------------------------------------------------------------

bool fence_queue::push_recorded(block* blk, stream_ref key)
{
  if (!reuse_rule::same_fence(blk->also_fence, key)) {
    // Fence 1, on the recorded stream, now. release_batch() queues fence 2, on key.
    blk->freed_on = key;
    push(blk, blk->also_fence);
    close_now(blk->also_fence);
    return false;
  }
  blk->also_fence = stream_ref::none();
  push(blk, key);
  return true;
}

fence_queue::batch& fence_queue::open_new_batch(stream_ref stream)
{
  auto b    = new_batch();
  b->stream = stream;
  b->open   = true;
  open_.push_back(std::move(b));
  return *open_.back();
}

fence_queue::batch_ptr fence_queue::new_batch()
{
  if (spare_batches_.empty()) { return std::make_unique<batch>(); }
  auto b = std::move(spare_batches_.back());
  spare_batches_.pop_back();
  return b;
}

void fence_queue::recycle(batch_ptr b) noexcept
{
  try {
    if (b->event != 0) { spare_events_.push_back(b->event); }
    b->event = 0;
    if (spare_batches_.size() < reuse_rule::spare_batches_kept) {
      b->blocks.clear();
      b->bytes = 0;
      b->open  = false;
      spare_batches_.push_back(std::move(b));
    }
  } catch (...) {
    // No room to keep it: it is freed here (an event it still holds leaks: harmless).
  }
}

// ---- fences ---------------------------------------------------------------------------------

event_handle fence_queue::take_event()
{
  if (!spare_events_.empty()) {
    auto e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return driver_->create_event(device_);
}

void fence_queue::close(std::vector<batch_ptr>::iterator it)
{
  auto& b = **it;
  if (b.event == 0) { b.event = take_event(); }
  try {
    driver_->record_event(device_, b.event, b.stream.handle);
  } catch (cuda_error const&) {
    if (b.stream.handle == legacy_stream) { throw; }  // the batch stays open with its event
    driver_->synchronize_device(device_);            // all work done, that stream's included
    driver_->record_event(device_, b.event, legacy_stream);
  }
  closed_.push_back(std::move(*it));  // may throw: then it stays open, fenced twice later
  open_.erase(it);
  b.open = false;
  open_bytes_ -= b.bytes;
  ++batches_closed_;
}

void fence_queue::close_open_batches(stream_ref alive)
{
  // Only streams certain to be alive now: context streams, and `alive` ("stream lifetime").
  // The rest stay open, dormant.
  for (std::size_t i = open_.size(); i-- > 0;) {
    auto const b  = open_.begin() + static_cast<std::ptrdiff_t>(i);
    auto const& s = (*b)->stream;
    if ((*b)->blocks.empty()) {
      // Emptied by stream-order takes (kept open till now: a stream that frees and allocates
      // in turn would reopen it at once): nothing to fence, on any stream.
      recycle(std::move(*b));
      open_.erase(b);
      continue;
    }
    if (!s.is_context() && (s != alive || !s.identified())) { continue; }
    close(b);
  }
}

void fence_queue::close_now(stream_ref alive)
{
  if (!alive.identified()) { return; }  // its batch may hold a dead stream's frees: dormant
  for (auto b = open_.begin(); b != open_.end(); ++b) {
    if ((*b)->stream == alive) {
      close(b);
      return;
    }
  }
}

// ---- blocks out -----------------------------------------------------------------------------

void fence_queue::release_batch(batch& b, std::vector<fenced_block>& done, covered by)
{
  // One block at a time, off the batch before it is reported: if reporting throws (no memory
  // for `done`), the batch keeps exactly the blocks not yet reported.
  while (!b.blocks.empty()) {
    auto* blk = b.blocks.back();
    bool const second = !blk->also_fence.is_none() && by == covered::by_event;
    done.push_back({blk, second ? blk->freed_on : b.stream, second});  // may throw: first
    b.blocks.pop_back();
    b.bytes -= blk->size;
    waiting_bytes_ -= blk->size;
    if (b.open) { open_bytes_ -= blk->size; }  // a dormant batch's, fenced by a device sync
    --waiting_blocks_;
    blk->owner = nullptr;
    if (!blk->also_fence.is_none()) {
      blk->also_fence = stream_ref::none();
      // The record_stream fence completed (or a device sync covered both): now the free's.
      if (second) { push(blk, blk->freed_on); }
    }
  }
}

std::size_t fence_queue::release_completed(std::vector<fenced_block>& done)
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
    release_batch(**it, done);
    recycle(std::move(*it));
    it = closed_.erase(it);
    ++released;
  }
  return released;
}

void fence_queue::poll(stream_ref alive, std::vector<fenced_block>& done)
{
  // The fences recorded before are asked first, the new ones recorded after: an event just
  // recorded has not completed yet on a GPU (from record to completion takes longer than a
  // whole miss, even on an idle one), so asking it at once is a driver call for nothing (one
  // per miss: fence_queries). Only when none of the earlier ones had completed is the new one
  // asked at once too: an idle GPU (and the host driver) may have completed it, and a block
  // it hands back beats a new segment.
  bool const released = release_completed(done) != 0;
  close_open_batches(alive);
  // What is left open belongs to streams that may be gone: past the limit, one device
  // synchronization fences them all ("stream lifetime").
  if (fence_due()) { fence_dormant(done); }
  if (!released) { release_completed(done); }
}

void fence_queue::fence_dormant(std::vector<fenced_block>& done)
{
  if (open_.empty() && closed_.empty()) { return; }
  driver_->synchronize_device(device_);  // everything issued so far, on every stream, is done
  ++dormant_fences_;
  // Every block here was freed before the synchronization, so its record_stream stream's work
  // is done too: no second fence (which, on a dead stream, would cost another synchronization).
  // Batches leave one at a time, so that what an exception leaves is still here.
  while (!closed_.empty()) {
    release_batch(*closed_.front(), done, covered::by_device_sync);
    recycle(std::move(closed_.front()));
    closed_.pop_front();
  }
  while (!open_.empty()) {
    // counts its bytes out of open_bytes_ too
    release_batch(*open_.back(), done, covered::by_device_sync);
    recycle(std::move(open_.back()));
    open_.pop_back();
  }
}

void fence_queue::drain(std::vector<fenced_block>& done)
{
  // A block whose record_stream fence completes goes back into a batch for its second fence:
  // repeat until no batch is left, open or closed.
  do {
    close_open_batches({});
    if (!open_.empty()) {
      fence_dormant(done);  // dormant batches: only a device synchronization covers them
      continue;
    }
    while (!closed_.empty()) {
      driver_->synchronize_event(device_, closed_.front()->event);
      release_batch(*closed_.front(), done);
      recycle(std::move(closed_.front()));
      closed_.pop_front();
    }
  } while (!open_.empty() || !closed_.empty());
}

void fence_queue::wait_for(stream_ref alive, std::vector<fenced_block>& done)
{
  if (!alive.identified()) { return; }  // its batch may hold a dead stream's frees: dormant
  for (std::size_t i = open_.size(); i-- > 0;) {
    auto const b = open_.begin() + static_cast<std::ptrdiff_t>(i);
    if (reuse_rule::same_fence((*b)->stream, alive) && !(*b)->blocks.empty()) { close(b); }
  }
  // One stream's events complete in the order recorded: its newest covers the older ones.
  event_handle newest = 0;
  for (auto const& b : closed_) {
    if (reuse_rule::same_fence(b->stream, alive)) { newest = b->event; }
  }
  if (newest != 0) { driver_->synchronize_event(device_, newest); }
  release_completed(done);
}

std::size_t fence_queue::waiting_bytes_of(stream_ref key) const noexcept
{
  std::size_t bytes = 0;
  for (auto const& b : open_) { bytes += reuse_rule::same_fence(b->stream, key) ? b->bytes : 0; }
  for (auto const& b : closed_) { bytes += reuse_rule::same_fence(b->stream, key) ? b->bytes : 0; }
  return bytes;
}

void fence_queue::drain_or_abandon(std::vector<fenced_block>& done)
{
  try {
    drain(done);
  } catch (...) {
    auto abandoned = abandon();
    done.insert(done.end(), abandoned.begin(), abandoned.end());
  }
}

std::vector<fenced_block> fence_queue::abandon()
{
  std::vector<fenced_block> blocks;
  blocks.reserve(waiting_blocks_);
  auto take = [&](batch_ptr& b) {
    for (auto* blk : b->blocks) {
      blk->also_fence = stream_ref::none();
      blk->owner      = nullptr;
      blocks.push_back({blk, b->stream, false});
    }
    recycle(std::move(b));
  };
  for (auto& b : open_) { take(b); }
  for (auto& b : closed_) { take(b); }
  open_.clear();
  closed_.clear();
  waiting_bytes_  = 0;
  waiting_blocks_ = 0;
  open_bytes_     = 0;
  return blocks;
}

void fence_queue::drop_events() noexcept
{
  for (auto& b : open_) { b->event = 0; }
  for (auto& b : closed_) { b->event = 0; }
  spare_events_.clear();
}

void fence_queue::release_events() noexcept
{
  if (!process_is_exiting()) {
    for (auto e : spare_events_) {
      try {
        driver_->destroy_event(device_, e);
      } catch (...) {
        // The context may already be gone; a leaked event handle is harmless.
      }
    }
  }
  spare_events_.clear();
}

}  // namespace emmpool::detail
