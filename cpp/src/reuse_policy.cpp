#include <emmpool/reuse_policy.hpp>

#include <emmpool/error.hpp>

#include <algorithm>

namespace emmpool {

reuse_policy::~reuse_policy()
{
  // Batches still here belong to a pool being destroyed, which has drained or abandoned them.
  release_events();
}

reuse_policy::stream_ref reuse_policy::ref_of(stream_handle alive) const
{
  if (alive == per_thread_stream) { return {legacy_stream, 0}; }
  if (is_context_stream(alive)) { return {alive, 0}; }
  return {alive, driver_->stream_id(device_, alive)};
}

namespace {

// The null stream and the legacy one are the same CUDA stream: one fence serves both. (No
// stream_ref holds the per-thread handle: ref_of() makes it the legacy one.)
constexpr bool same_fence(detail::stream_ref a, detail::stream_ref b) noexcept
{
  return a == b || (a.is_context() && b.is_context());
}

}  // namespace

void reuse_policy::queue_freed(detail::block* blk, stream_ref key)
{
  if (!blk->also_fence.is_none() && !same_fence(blk->also_fence, key)) {
    // Fence 1, on the recorded stream, now: record_stream's caller keeps that stream alive
    // until the free, not after it ("stream lifetime"). release_batch() queues fence 2.
    blk->freed_on = key;
    push(blk, blk->also_fence);
    close_now(blk->also_fence);
    return;
  }
  blk->also_fence = stream_ref::none();
  push(blk, key);
  // Without stream order a named stream is never seen alive again: fence it now.
  if (!options_.stream_order && !key.is_context()) { close_now(key); }
}

void reuse_policy::record_stream(detail::block* blk, stream_handle stream) const
{
  EMMPOOL_EXPECTS(stream != allocation_stream, "allocation_stream names no stream to record");
  // 0, the CUDA runtime's name for the default stream, means the legacy stream here.
  blk->also_fence = ref_of(stream == 0 ? legacy_stream : stream);
}

void reuse_policy::push(detail::block* blk, stream_ref stream)
{
  blk->state = detail::block_state::pending;
  ++version_;
  waiting_bytes_ += blk->size;
  open_bytes_ += blk->size;
  ++waiting_blocks_;
  for (auto& b : open_) {
    if (b.stream == stream) {
      b.blocks.push_back(blk);
      b.bytes += blk->size;
      return;
    }
  }
  batch b;
  b.stream = stream;
  b.bytes  = blk->size;
  if (!spare_lists_.empty()) {
    b.blocks = std::move(spare_lists_.back());
    spare_lists_.pop_back();
  }
  b.blocks.push_back(blk);
  open_.push_back(std::move(b));
}

void reuse_policy::recycle(std::vector<detail::block*>&& blocks) noexcept
{
  constexpr std::size_t keep = 16;  // one per stream in use, roughly; more would be hoarding
  if (spare_lists_.size() < keep && blocks.capacity() > 0) {
    try {
      blocks.clear();
      spare_lists_.push_back(std::move(blocks));
    } catch (...) {
      // No room to keep it: it is freed with the batch, as before.
    }
  }
}

detail::block* reuse_policy::take_in_stream_order(stream_ref stream, std::size_t size)
{
  // legacy_stream is "no stream named": no order to rely on; an unidentified stream may be a
  // new one under a dead one's handle.
  if (stream.handle == legacy_stream || !stream.identified()) { return nullptr; }
  // The newest frees of that stream first (its open batch, then its latest closed one), and
  // only a few of each: a loop that frees and allocates the same sizes finds its block at once,
  // and a miss costs a handful of comparisons.
  auto take_from = [&](batch& b) -> detail::block* {
    constexpr std::size_t window = 8;
    auto& blocks                 = b.blocks;
    std::size_t const end        = blocks.size() > window ? blocks.size() - window : 0;
    for (std::size_t i = blocks.size(); i-- > end;) {
      auto* blk = blocks[i];
      if (!blk->also_fence.is_none() || blk->size < size || blk->size - size > size / 8) {
        continue;
      }
      blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
      b.bytes -= blk->size;
      waiting_bytes_ -= blk->size;
      --waiting_blocks_;
      ++stream_order_reuses_;
      ++version_;
      return blk;
    }
    return nullptr;
  };
  for (auto b = open_.begin(); b != open_.end(); ++b) {
    if (b->stream != stream) { continue; }
    auto* blk = take_from(*b);
    if (blk == nullptr) { break; }
    open_bytes_ -= blk->size;
    if (b->blocks.empty()) {
      if (b->event != 0) { spare_events_.push_back(b->event); }
      recycle(std::move(b->blocks));
      open_.erase(b);
    }
    return blk;
  }
  // The latest closed batch of that stream, among the last few closed (a longer search would
  // cost every allocation on a stream that has none). One left empty stays until its event
  // completes: promote_completed() then recycles the event.
  constexpr std::size_t recent = 8;
  std::size_t seen             = 0;
  for (auto b = closed_.rbegin(); b != closed_.rend() && seen < recent; ++b, ++seen) {
    if (b->stream == stream) { return take_from(*b); }
  }
  return nullptr;
}

event_handle reuse_policy::take_event()
{
  if (!spare_events_.empty()) {
    auto e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return driver_->create_event(device_);
}

void reuse_policy::close(std::vector<batch>::iterator b)
{
  if (b->event == 0) { b->event = take_event(); }
  try {
    driver_->record_event(device_, b->event, b->stream.handle);
  } catch (cuda_error const&) {
    if (b->stream.handle == legacy_stream) { throw; }  // the batch stays open with its event
    driver_->synchronize_device(device_);             // all work done, that stream's included
    driver_->record_event(device_, b->event, legacy_stream);
  }
  open_bytes_ -= b->bytes;
  closed_.push_back(std::move(*b));
  open_.erase(b);
  ++batches_closed_;
  ++version_;
}

std::size_t reuse_policy::close_open_batches(stream_ref alive)
{
  // Only streams certain to be alive now: context streams, and `alive` (see "stream
  // lifetime" in the header). The rest stay open, dormant.
  std::size_t closed = 0;
  for (std::size_t i = open_.size(); i-- > 0;) {
    auto const& s = open_[i].stream;
    if (!s.is_context() && (s != alive || !s.identified())) { continue; }
    close(open_.begin() + static_cast<std::ptrdiff_t>(i));
    ++closed;
  }
  return closed;
}

void reuse_policy::close_now(stream_ref alive)
{
  if (!alive.identified()) { return; }  // its batch may hold a dead stream's frees: dormant
  for (auto b = open_.begin(); b != open_.end(); ++b) {
    if (b->stream == alive) {
      close(b);
      return;
    }
  }
}

std::vector<detail::block*> reuse_policy::abandon()
{
  ++version_;
  std::vector<detail::block*> blocks;
  blocks.reserve(waiting_blocks_);
  auto take = [&](batch& b) {
    for (auto* blk : b.blocks) { blk->also_fence = stream_ref::none(); }
    blocks.insert(blocks.end(), b.blocks.begin(), b.blocks.end());
    if (b.event != 0) { spare_events_.push_back(b.event); }
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

void reuse_policy::drop_events() noexcept
{
  for (auto& b : open_) { b.event = 0; }
  for (auto& b : closed_) { b.event = 0; }
  spare_events_.clear();
}

void reuse_policy::release_events() noexcept
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

}  // namespace emmpool
