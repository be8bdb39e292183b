// device_pool: growing (a segment from the driver, or the growable segment's pages) and giving
// memory back. How big a segment is: pool_options::segment_size; the cap: detail/pool_cap.hpp.
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>

#include <algorithm>
#include <vector>

namespace emmpool {

device_pool::block* device_pool::grow(std::size_t rounded, bool exact, bool growable, alloc_tag tag)
{
  if (growable && growable_.ensure_segment(rounded, index_.segments())) {
    if (auto* blk = take_growable(rounded, tag, true, stream_ref::none())) { return blk; }
    // No address space left, or no memory: a fixed segment, as without growable segments.
  }
  bool const small = options_.small(rounded);
  std::size_t size = options_.segment_size(rounded, exact);
  // Near the cap, a segment just as big as the request may still fit where the usual one
  // (2 MiB small segment, 2 MiB rounding) does not: a cap never refuses what it could hold.
  if (!cap_.fits(stats_.bytes_reserved, size) && size > rounded) { size = rounded; }
  if (!cap_.fits(stats_.bytes_reserved, size)) { return nullptr; }
  if (options_.mode == pool_mode::pool && !small &&
      stats_.bytes_reserved + size > stats_.peak_bytes_reserved) {
    // About to reach a new peak: first give back large segments that are wholly free (and so
    // could not serve this request). Keeps reserved memory close to what is live on shifting
    // size mixes (the fragmentation replay's peak reserved / peak live falls from about 1.4 to
    // 1.2-1.25) at the cost of a cuMemFree,
    // which synchronizes the device, only on growth past the peak. Small segments stay: they
    // are cheap and soon reused.
    release_free_segments(true);
  }
  return make_segment(size, small, tag);
}

device_pool::block* device_pool::make_segment(std::size_t size, bool small, alloc_tag tag)
{
  device_ptr base{};
  try {
    base = driver_->allocate(device_, size);
  } catch (out_of_memory const&) {
    return nullptr;
  }
  auto seg   = std::make_unique<segment>();
  seg->base  = base;
  seg->size  = size;
  seg->small = small;
  try {
    seg->buffer_id = driver_->buffer_id(device_, base);
  } catch (...) {
    driver_->deallocate(device_, base);
    throw;
  }
  auto& segments = index_.segments();
  if (segments.count(base) != 0) {
    // The driver handed out an address this pool still tracks: its context was reset
    // behind the pool's back (not through reset()). Refuse rather than alias two segments.
    driver_->deallocate(device_, base);
    throw pool_error{"emmpool: the CUDA context of device " + std::to_string(device_) +
                     " was reset without the pool's reset(); its old allocations are gone"};
  }
  auto* blk  = blocks_.make();
  blk->ptr   = base;
  blk->size  = size;
  blk->seg   = seg.get();
  blk->kind  = seg->kind();
  seg->first = blk;
  segment_log_.record(segment_event::kind::made, static_cast<segment_type>(seg->kind()),
                      static_cast<std::uint8_t>(tag), base, size);
  segments.emplace(base, std::move(seg));

  stats_.bytes_reserved += size;
  stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_reserved);
  ++stats_.segment_allocations;
  ++stats_.segments;
  return blk;
}

void device_pool::release_segment(segment* seg)
{
  // The driver first: if cuMemFree fails, the segment stays in the pool, consistent.
  driver_->deallocate(device_, seg->base);
  auto* blk = seg->first;  // wholly free: one block spanning the segment
  free_.erase(blk);
  blocks_.recycle(blk);
  stats_.bytes_reserved -= seg->size;
  --stats_.segments;
  ++stats_.segment_releases;
  segment_log_.record(segment_event::kind::released, static_cast<segment_type>(seg->kind()), 0,
                      seg->base, seg->size);
  index_.segments().erase(seg->base);
}

std::size_t device_pool::release_free_segments(bool at_peak)
{
  if (!capture_.may_give_back() || forked_) { return 0; }
  std::vector<segment*> idle;
  for (auto& [base, seg] : index_.segments()) {
    if (seg->live_blocks == 0 && !(at_peak && seg->small) && !seg->growable) {
      idle.push_back(seg.get());
    }
  }
  std::size_t released =
    at_peak ? 0 : growable_.unmap_free(detail::growable_space::all_free, false);
  for (auto* seg : idle) {
    released += seg->size;
    release_segment(seg);
  }
  return released;
}

}  // namespace emmpool
