#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <mutex>
#include <utility>

namespace emmpool {

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t large_granularity = 2 * mib;  // the driver's own allocation granularity

constexpr std::size_t round_up(std::size_t n, std::size_t a) noexcept { return (n + a - 1) / a * a; }

// The null stream and the legacy one are the same CUDA stream: one fence serves both. (No
// stream_ref holds the per-thread handle: ref_of() makes it the legacy one.)
constexpr bool same_fence(detail::stream_ref a, detail::stream_ref b) noexcept
{
  return a == b || (a.is_context() && b.is_context());
}

std::string human(std::size_t bytes)
{
  char buf[32];
  double const v = static_cast<double>(bytes);
  if (bytes >= (std::size_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1 << 30));
  } else if (bytes >= mib) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", v / mib);
  } else if (bytes >= 1024) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", v / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  }
  return buf;
}

}  // namespace


bool device_pool::forked() const
{
  std::lock_guard lock{mutex_};
  return forked_;
}

device_pool::device_pool(driver& drv, int device, pool_options options)
  : driver_{&drv}, device_{device}, options_{options}, queue_{drv, device}
{
  EMMPOOL_EXPECTS(device >= 0, "device must be a non-negative ordinal");
  EMMPOOL_EXPECTS(options_.maximum_fraction >= 0.0 && options_.maximum_fraction <= 1.0,
                  "maximum_fraction must lie in [0, 1]");
  EMMPOOL_EXPECTS(options_.small_request % alignment == 0 && options_.small_request > 0,
                  "small_request must be a positive multiple of 256");
  EMMPOOL_EXPECTS(options_.small_segment % alignment == 0 &&
                    options_.small_segment >= options_.small_request,
                  "small_segment must be a multiple of 256 and at least small_request");
  EMMPOOL_EXPECTS(options_.large_segment % alignment == 0 &&
                    options_.large_segment > options_.small_request,
                  "large_segment must be a multiple of 256 larger than small_request");

  max_reserved_ = options_.maximum_size != 0 ? options_.maximum_size
                                             : std::numeric_limits<std::size_t>::max();
  if (options_.maximum_fraction > 0.0) {
    auto const total = driver_->memory_info_of(device_).total;
    max_reserved_ =
      std::min(max_reserved_, static_cast<std::size_t>(options_.maximum_fraction * total));
  }
  EMMPOOL_EXPECTS(options_.initial_size <= max_reserved_,
                  "initial_size exceeds the maximum pool size");
  live_.reserve(4096);
  tracing_ = options_.trace;
  if (options_.segments == segment_kind::growable && options_.mode == pool_mode::pool) {
    try {
      vmm_page_ = driver_->vmm_page_size(device_);  // 0: unsupported, fixed segments
    } catch (cuda_error const&) {
      vmm_page_ = 0;
    }
  }
  if (options_.initial_size > 0 && options_.mode == pool_mode::pool) {
    std::lock_guard lock{mutex_};
    auto* blk = grow(round_up(options_.initial_size, large_granularity), true);
    if (blk == nullptr) {
      throw out_of_memory{"emmpool: cannot reserve the initial pool of " +
                          human(options_.initial_size) + " on device " +
                          std::to_string(device_)};
    }
    insert_free(blk);
  }
  detail::register_for_fork(&mutex_, &forked_);
}

device_pool::~device_pool()
{
  detail::unregister_for_fork(&mutex_);
  std::lock_guard lock{mutex_};
  // Whatever is left goes back to the driver, without waiting: the pool is going away, so
  // nobody can be handed these blocks again. At process exit the driver may be gone: leak.
  if (process_is_exiting() || forked_) {
    queue_.drop_events();  // no CUDA call: the driver may be gone, or belong to the parent
    return;
  }
  for (auto& [base, seg] : segments_) {
    try {
      if (seg->growable) {
        pages_->release();
      } else {
        driver_->deallocate(device_, base);
      }
    } catch (...) {
    }
  }
  for (auto& seg : retired_segments_) {
    try {
      if (!seg->growable && driver_->buffer_id(device_, seg->base) == seg->buffer_id) {
        driver_->deallocate(device_, seg->base);
      }
    } catch (...) {
    }
  }
  (void)queue_.abandon();
}

// ---- allocation ---------------------------------------------------------------------------

device_pool::free_set& device_pool::free_list_for(std::size_t rounded) noexcept
{
  return rounded <= options_.small_request ? small_free_ : large_free_;
}

void device_pool::insert_free(block* blk)
{
  blk->state = detail::block_state::free;
  list_of(blk->seg).insert(blk);
  if (!blk->seg->growable) { stats_.bytes_free += blk->size; }  // growable: stats() counts
}

void device_pool::erase_free(block* blk)
{
  list_of(blk->seg).erase(blk);
  if (!blk->seg->growable) { stats_.bytes_free -= blk->size; }
}

device_pool::block* device_pool::split(block* blk, std::size_t rounded)
{
  if (options_.mode == pool_mode::pool && blk->size - rounded >= alignment) {
    auto* rest = blocks_.make();
    rest->ptr  = blk->ptr + rounded;
    rest->size = blk->size - rounded;
    rest->seg  = blk->seg;
    rest->prev = blk;
    rest->next = blk->next;
    if (blk->next != nullptr) { blk->next->prev = rest; }
    blk->next = rest;
    blk->size = rounded;
    insert_free(rest);
  }
  return blk;
}

device_pool::block* device_pool::take_best_fit(std::size_t rounded)
{
  auto& list = free_list_for(rounded);
  block probe;
  probe.size = rounded;
  auto it    = list.lower_bound(&probe);
  if (it == list.end()) { return nullptr; }
  auto* blk = *it;
  list.erase(it);
  stats_.bytes_free -= blk->size;
  return split(blk, rounded);
}

device_pool::block* device_pool::grow(std::size_t rounded, bool exact, bool growable)
{
  if (growable) {
    if (auto* blk = grow_growable(rounded)) { return blk; }
    // No address space left, or no memory: a fixed segment, as without growable segments.
  }
  bool const small = options_.mode == pool_mode::pool && rounded <= options_.small_request;
  std::size_t size = rounded;
  if (options_.mode == pool_mode::pool) {
    if (small) {
      size = options_.small_segment;
    } else if (!exact && rounded <= options_.large_segment / 2) {
      size = options_.large_segment;  // several mid-sized requests share a segment
    } else {
      size = round_up(rounded, large_granularity);
    }
  }
  auto const fits = [&](std::size_t n) {
    return n <= max_reserved_ && stats_.bytes_reserved <= max_reserved_ - n;
  };
  // Near the cap, a segment just as big as the request may still fit where the usual one
  // (2 MiB small segment, 2 MiB rounding) does not: a cap never refuses what it could hold.
  if (!fits(size) && size > rounded) { size = rounded; }
  if (!fits(size)) { return nullptr; }
  if (options_.mode == pool_mode::pool && !small &&
      stats_.bytes_reserved + size > stats_.peak_bytes_reserved) {
    // About to reach a new peak: first give back large segments that are wholly free (and so
    // could not serve this request). Keeps reserved memory close to what is live on shifting
    // size mixes (replay: peak reserved / peak live 1.40 -> 1.24) at the cost of a cuMemFree,
    // which synchronizes the device, only on growth past the peak. Small segments stay: they
    // are cheap and soon reused.
    release_free_segments(true);
  }

  device_ptr base{};
  try {
    base = driver_->allocate(device_, size);
  } catch (out_of_memory const&) {
    return nullptr;
  }
  auto seg       = std::make_unique<segment>();
  seg->base      = base;
  seg->size      = size;
  seg->small     = small;
  try {
    seg->buffer_id = driver_->buffer_id(device_, base);
  } catch (...) {
    driver_->deallocate(device_, base);
    throw;
  }
  if (segments_.count(base) != 0) {
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
  seg->first = blk;
  segments_.emplace(base, std::move(seg));

  stats_.bytes_reserved += size;
  stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_reserved);
  ++stats_.segment_allocations;
  ++stats_.segments;
  return blk;
}

device_ptr device_pool::hand_out(block* blk, stream_ref stream, alloc_tag tag)
{
  // A pending block (same-stream reuse) still counts in its segment's live blocks.
  if (blk->state != detail::block_state::pending) { ++blk->seg->live_blocks; }
  blk->state        = detail::block_state::allocated;
  blk->tag          = static_cast<std::uint8_t>(tag);
  blk->also_fence   = stream_ref::none();
  blk->alloc_stream = stream;
  live_.emplace(blk->ptr, blk);

  stats_.bytes_in_use += blk->size;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  ++stats_.blocks_in_use;
  ++stats_.allocations;
  stats_.bytes_in_use_by_tag[blk->tag] += blk->size;
  ++stats_.allocations_by_tag[blk->tag];
  return blk->ptr;
}

namespace {

std::size_t checked_rounded_size(std::size_t bytes, stream_handle stream, alloc_tag tag)
{
  EMMPOOL_EXPECTS(bytes <= std::numeric_limits<std::size_t>::max() / 2,
                  "allocation size is too large");
  EMMPOOL_EXPECTS(static_cast<std::size_t>(tag) < alloc_tag_count, "unknown allocation tag");
  EMMPOOL_EXPECTS(stream != allocation_stream, "allocation_stream names no stream to allocate on");
  return std::max(round_up(bytes, device_pool::alignment), device_pool::alignment);
}

}  // namespace

device_pool::block* device_pool::take_without_cuda(std::size_t rounded, stream_ref stream,
                                                   bool growable)
{
  if (options_.mode != pool_mode::pool) { return nullptr; }
  // Stream order: a block this stream freed lately needs no fence for this stream's work.
  if (auto* blk = queue_.take_same_stream(stream, rounded)) {
    ++stats_.same_stream_reuses;
    return blk;
  }
  return growable ? take_growable(rounded, false) : take_best_fit(rounded);
}

std::optional<device_ptr> device_pool::try_allocate(std::size_t bytes, stream_handle stream,
                                                    alloc_tag tag)
{
  std::size_t const rounded = checked_rounded_size(bytes, stream, tag);
  std::unique_lock lock{mutex_, std::try_to_lock};
  if (!lock.owns_lock() || forked_) { return std::nullopt; }
  auto const ref = queue_.ref_of(stream);  // alive: we allocate on it (cuStreamGetId never waits)
  if (fence_due()) { return std::nullopt; }  // allocate() fences them (CUDA calls)
  auto* blk = take_without_cuda(rounded, ref, uses_growable(rounded, tag));
  if (blk == nullptr) { return std::nullopt; }
  if (tracing_) { record('a', blk->ptr, bytes, ref.handle, static_cast<std::uint8_t>(tag)); }
  return hand_out(blk, ref, tag);
}

device_ptr device_pool::allocate(std::size_t bytes, stream_handle stream, alloc_tag tag)
{
  std::size_t const rounded = checked_rounded_size(bytes, stream, tag);
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  auto const ref = queue_.ref_of(stream);  // alive: we allocate on it (cuStreamGetId never waits)

  block* blk   = nullptr;
  bool const g = uses_growable(rounded, tag);  // mapping pages is a CUDA call: after step 1
  if (options_.mode == pool_mode::pool && fence_due()) {
    maintain(ref);  // fence the waiting frees now, not at the next miss
  }
  if (options_.mode == pool_mode::passthrough) {
    maintain(ref);  // returns completed frees' segments to the driver
    blk = grow(rounded, true);
  } else {
    blk = take_without_cuda(rounded, ref, g);  // stream order, then the free lists
    if (blk == nullptr) {
      // Ladder step 1: fence what was freed since the last miss, reuse what has completed.
      maintain(ref);
      blk = g ? take_growable(rounded, true) : take_best_fit(rounded);
    }
    if (blk == nullptr) {
      // Step 2: grow.
      blk = grow(rounded, false, g);
      if (blk != nullptr) { blk = split(blk, rounded); }
    }
  }
  if (blk == nullptr && (queue_.has_open() || queue_.has_closed())) {
    // Step 3: wait for every pending free.
    queue_.drain([this](block* b) { release_block(b); });
    blk = options_.mode != pool_mode::pool ? grow(rounded, true)
          : g                              ? take_growable(rounded, true)
                                           : take_best_fit(rounded);
  }
  if (blk == nullptr) {
    // Step 4: give wholly free segments (and growable segments' wholly free pages) back
    // (unless cleanup is deferred), then grow with an exact-size segment.
    if (release_free_segments() > 0 || options_.mode == pool_mode::pool) {
      blk = grow(rounded, true, g);
      if (blk != nullptr) { blk = split(blk, rounded); }
    }
  }
  if (blk == nullptr) {
    ++stats_.out_of_memory;
    throw out_of_memory{"emmpool: out of memory allocating " + human(bytes) + "; " +
                        describe_locked()};
  }
  if (tracing_) { record('a', blk->ptr, bytes, ref.handle, static_cast<std::uint8_t>(tag)); }
  return hand_out(blk, ref, tag);
}

// ---- free ---------------------------------------------------------------------------------

std::optional<detail::stream_ref> device_pool::free_stream(stream_handle stream) const
{
  // allocation_stream: the block's own stream_ref, from its allocation; the stream itself may
  // be gone by now and is never asked. Any other stream is named by the caller, who vouches
  // for it during the call: its id is taken now, once the free is known to be a live block's
  // (a block retired by a reset, or a forked child's, never needs one: its stream may be gone
  // with the context).
  if (stream == allocation_stream) { return std::nullopt; }
  return queue_.ref_of(stream);
}

device_pool::block* device_pool::take_live_locked(device_ptr ptr)
{
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw pool_error{"emmpool: pointer " + std::to_string(ptr) + " on device " +
                     std::to_string(device_) +
                     " is not a live allocation of this pool (freed twice, or never allocated "
                     "here)"};
  }
  auto* blk = it->second;
  live_.erase(it);
  return blk;
}

void device_pool::free_live_locked(device_ptr ptr, stream_handle stream)
{
  auto const ref = free_stream(stream);  // first: if it throws, the block stays live
  deallocate_locked(take_live_locked(ptr), ref);
}

void device_pool::deallocate(device_ptr ptr, stream_handle stream)
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }  // the parent's memory: nothing to do here
  free_live_locked(ptr, stream);
}

bool device_pool::try_deallocate(device_ptr ptr, stream_handle stream, std::uint64_t generation)
{
  if (!is_context_stream(stream) && stream != allocation_stream) { return false; }  // an id to ask
  std::unique_lock lock{mutex_, std::try_to_lock};
  if (!lock.owns_lock()) { return false; }
  if (forked_) { return true; }                    // as deallocate(): nothing to do
  if (generation != generation_) { return false; }  // a retired block: its free may call CUDA
  auto it = live_.find(ptr);
  // A record_stream fence is recorded in the free (a CUDA call); a bad pointer gets its error
  // from deallocate().
  if (it == live_.end() || !it->second->also_fence.is_none()) { return false; }
  auto* blk = it->second;
  live_.erase(it);
  deallocate_locked(blk, free_stream(stream));  // a context stream or allocation_stream: no call
  return true;
}

void device_pool::deallocate(device_ptr ptr, stream_handle stream, std::uint64_t generation)
{
  // One lock for the generation check and the free: a reset() in between could otherwise let
  // this free a block of the next generation at the same address.
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  if (generation == generation_) {
    free_live_locked(ptr, stream);
    return;
  }
  auto it = retired_live_.find({generation, ptr});
  if (it == retired_live_.end()) {
    throw pool_error{"emmpool: pointer " + std::to_string(ptr) +
                     " from before a reset is not live (freed twice?)"};
  }
  auto* blk = it->second;
  retired_live_.erase(it);
  free_retired(blk);
}

void device_pool::deallocate_tagged(device_ptr ptr, stream_handle stream, alloc_tag tag)
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  auto const t = static_cast<std::uint8_t>(tag);
  // A block of this library retired by a reset comes first (newest generation first): the
  // caller's free cannot say which generation it belongs to, and taking a live block at a
  // reused address for an old one would free memory still in use.
  for (auto it = retired_live_.rbegin(); it != retired_live_.rend(); ++it) {
    if (it->first.second == ptr && it->second->tag == t) {
      auto* blk = it->second;
      retired_live_.erase(std::next(it).base());
      free_retired(blk);
      return;
    }
  }
  auto it = live_.find(ptr);
  if (it == live_.end() || it->second->tag != t) {
    throw pool_error{"emmpool: pointer " + std::to_string(ptr) +
                     " is not a live allocation of this library in this pool"};
  }
  auto const ref = free_stream(stream);  // before the block leaves live_: it may throw
  auto* blk      = it->second;
  live_.erase(it);
  deallocate_locked(blk, ref);
}

void device_pool::deallocate_locked(block* blk, std::optional<stream_ref> stream)
{
  auto const freed_on = stream ? *stream : blk->alloc_stream;
  if (tracing_) { record('f', blk->ptr, blk->size, freed_on.handle, blk->tag); }
  stats_.bytes_in_use -= blk->size;
  --stats_.blocks_in_use;
  ++stats_.frees;
  stats_.bytes_in_use_by_tag[blk->tag] -= blk->size;
  if (!blk->also_fence.is_none() && !same_fence(blk->also_fence, freed_on)) {
    // Fence 1, on the recorded stream, now: record_stream's caller keeps that stream alive
    // until the free, not after it (deferred_free_queue.hpp, "stream lifetime").
    blk->freed_on = freed_on;
    queue_.push(blk, blk->also_fence);
    queue_.close_now(blk->also_fence);
  } else {
    blk->also_fence = stream_ref::none();
    queue_.push(blk, freed_on);
  }
}

void device_pool::record_stream(device_ptr ptr, stream_handle stream)
{
  EMMPOOL_EXPECTS(stream != allocation_stream, "allocation_stream names no stream to record");
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  // 0, the CUDA runtime's name for the default stream, means the legacy stream here.
  auto const ref = queue_.ref_of(stream == 0 ? legacy_stream : stream);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw pool_error{"emmpool: record_stream of pointer " + std::to_string(ptr) +
                     ", which is not a live allocation of this pool"};
  }
  // One extra stream per block: a second, different one is fenced by the legacy stream only
  // if it is blocking. Keep the most recent, as the one a caller is most likely still using.
  it->second->also_fence = ref;
}

void device_pool::release_block(block* blk)
{
  if (!blk->also_fence.is_none()) {
    // First fence (the recorded stream) done; now fence on the stream of the free.
    blk->also_fence = stream_ref::none();
    queue_.push(blk, blk->freed_on);
    return;
  }
  auto* seg = blk->seg;
  --seg->live_blocks;
  if (seg->live_blocks == 0) { seg->exported = 0; }
  if (options_.mode == pool_mode::passthrough) {
    insert_free(blk);
    if (cleanup_deferrals_ == 0) {
      try {
        release_segment(seg);
      } catch (cuda_error const&) {
        // cuMemFree failed (a sticky error, say): the segment stays, wholly free, for a
        // later trim; the block is never handed out again in passthrough mode.
      }
    }
    return;
  }
  // Coalesce with free neighbours (same segment only: segments are separate driver allocations).
  if (auto* prev = blk->prev; prev != nullptr && prev->state == detail::block_state::free) {
    erase_free(prev);
    prev->size += blk->size;
    prev->next = blk->next;
    if (blk->next != nullptr) { blk->next->prev = prev; }
    blocks_.recycle(blk);
    blk = prev;
  }
  if (auto* next = blk->next; next != nullptr && next->state == detail::block_state::free) {
    erase_free(next);
    blk->size += next->size;
    blk->next = next->next;
    if (next->next != nullptr) { next->next->prev = blk; }
    blocks_.recycle(next);
  }
  insert_free(blk);
}

void device_pool::maintain(stream_ref alive)
{
  auto release = [this](block* b) { release_block(b); };
  queue_.close_open_batches(alive);
  // What is left open belongs to streams that may be gone: past the limit, one device
  // synchronization fences them all (deferred_free_queue.hpp, "stream lifetime").
  if (queue_.dormant_due(options_.open_batch_limit)) { queue_.fence_dormant(release); }
  queue_.promote_completed(release);
}

// ---- growable segments (detail/growable_segment.hpp) ----------------------------------------

device_pool::block* device_pool::take_growable(std::size_t rounded, bool may_map)
{
  block probe;
  probe.size = rounded;
  auto it    = growable_free_.lower_bound(&probe);
  if (it == growable_free_.end()) { return nullptr; }
  auto* blk = *it;
  bool unmapped = pages_->unmapped_in(blk->ptr, rounded) != 0;
  if (unmapped) {
    // The best fit needs new pages: a slightly larger free block whose pages are mapped
    // serves without a driver call (and without unmapping others at a new peak).
    constexpr int candidates = 8;
    auto alt = std::next(it);
    for (int i = 0; i < candidates && alt != growable_free_.end(); ++i, ++alt) {
      if (pages_->unmapped_in((*alt)->ptr, rounded) == 0) {
        it       = alt;
        blk      = *alt;
        unmapped = false;
        break;
      }
    }
  }
  if (unmapped && !may_map) { return nullptr; }  // a CUDA call: allocate() maps
  growable_free_.erase(it);                       // off the list: unmapping spares it
  if (unmapped && !map_for(blk->ptr, rounded, blk->size)) {
    growable_free_.insert(blk);
    return nullptr;
  }
  return split(blk, rounded);
}

bool device_pool::map_for(device_ptr ptr, std::size_t rounded, std::size_t available)
{
  auto const fits = [&](std::size_t n) {
    return n <= max_reserved_ && stats_.bytes_reserved <= max_reserved_ - n;
  };
  std::size_t need = pages_->unmapped_in(ptr, rounded);
  if (!fits(need) || stats_.bytes_reserved + need > stats_.peak_bytes_reserved) {
    // About to pass the cap or reach a new peak: first give back what no block uses, the
    // wholly free pages of the growable segment (and wholly free large fixed segments), as
    // grow() does for fixed segments. Reserved memory then peaks at what the live and pending
    // blocks' pages need, and the driver is called only on growth past the peak.
    release_free_segments(true);
    need = pages_->unmapped_in(ptr, rounded);
  }
  if (!fits(need)) { return false; }
  try {
    auto const n = pages_->map(ptr, rounded);
    stats_.bytes_reserved += n;
    stats_.page_maps += n / pages_->page_size();
  } catch (out_of_memory const&) {
    return false;  // the ladder goes on: wait for frees, give pages back, try again
  }
  // Room for the next few requests of this size (best effort, within the cap): without it a
  // caller that frees and allocates mid-sized blocks on no stream would miss on every request
  // (its freed block is still pending), where a fixed segment has up to large_segment to spare.
  // It costs at most growable_room above the peak of what blocks need.
  std::size_t const room = std::min(available, std::max(rounded, options_.growable_room));
  if (room > rounded) {
    std::size_t const extra = pages_->unmapped_in(ptr, room);
    if (fits(extra)) {
      try {
        auto const n = pages_->map(ptr, room);
        stats_.bytes_reserved += n;
        stats_.page_maps += n / pages_->page_size();
      } catch (cuda_error const&) {
      } catch (out_of_memory const&) {
      }
    }
  }
  stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_reserved);
  return true;
}

device_pool::block* device_pool::grow_growable(std::size_t rounded)
{
  if (growable_seg_ == nullptr) {
    // The address space of all the device's memory (at most the cap): growth never runs out
    // of addresses before it runs out of memory. Addresses cost no memory.
    std::size_t bytes = options_.growable_reserve;
    if (bytes == 0) {
      bytes = std::min(max_reserved_, driver_->memory_info_of(device_).total);
    }
    bytes = std::max(round_up(bytes, vmm_page_), round_up(rounded, vmm_page_));
    try {
      pages_ = std::make_unique<detail::growable_pages>(*driver_, device_, vmm_page_, bytes);
    } catch (cuda_error const&) {
      vmm_page_ = 0;  // the driver refuses reservations: fixed segments from now on
      return nullptr;
    }
    auto seg      = std::make_unique<segment>();
    seg->base     = pages_->base();
    seg->size     = pages_->size();
    seg->growable = true;
    auto* blk     = blocks_.make();
    blk->ptr      = seg->base;
    blk->size     = seg->size;
    blk->seg      = seg.get();
    seg->first    = blk;
    growable_seg_ = seg.get();
    segments_.emplace(seg->base, std::move(seg));
    insert_free(blk);
    ++stats_.segment_allocations;
    ++stats_.segments;
  }
  return take_growable(rounded, true);
}

std::size_t device_pool::unmap_free_pages()
{
  if (pages_ == nullptr || cleanup_deferrals_ > 0 || forked_) { return 0; }
  auto const before = pages_->mapped_bytes();
  try {
    for (auto* b : growable_free_) { (void)pages_->unmap_inside(b->ptr, b->size); }
  } catch (cuda_error const&) {
    // cuMemUnmap failed (a sticky error, say): the page stays mapped and counted, for a later
    // trim, as a segment whose cuMemFree failed.
  }
  auto const n = before - pages_->mapped_bytes();
  stats_.bytes_reserved -= n;
  stats_.page_unmaps += n / pages_->page_size();
  return n;
}

void device_pool::drop_growable(bool release)
{
  if (release) {
    // Wholly free (reset): unmap everything, free the reservation, forget the segment.
    auto const mapped = pages_->mapped_bytes();
    try {
      pages_->release();
    } catch (cuda_error const&) {
      retired_pages_.push_back(std::move(pages_));  // left to the driver
    }
    stats_.bytes_reserved -= mapped;
    stats_.page_unmaps += mapped / vmm_page_;
    for (auto* b = growable_seg_->first; b != nullptr;) {
      auto* next = b->next;
      if (b->state == detail::block_state::free) { erase_free(b); }
      blocks_.recycle(b);
      b = next;
    }
    --stats_.segments;
    ++stats_.segment_releases;
    segments_.erase(growable_seg_->base);
  } else {
    // Retired with live blocks (reset): its pages stay mapped until the process ends.
    retired_pages_.push_back(std::move(pages_));
  }
  pages_.reset();
  growable_seg_ = nullptr;
}

// ---- giving memory back ---------------------------------------------------------------------

void device_pool::release_segment(segment* seg)
{
  // The driver first: if cuMemFree fails, the segment stays in the pool, consistent.
  driver_->deallocate(device_, seg->base);
  auto* blk = seg->first;  // wholly free: one block spanning the segment
  erase_free(blk);
  blocks_.recycle(blk);
  stats_.bytes_reserved -= seg->size;
  --stats_.segments;
  ++stats_.segment_releases;
  segments_.erase(seg->base);
}

std::size_t device_pool::release_free_segments(bool large_only)
{
  if (cleanup_deferrals_ > 0 || forked_) { return 0; }
  std::vector<segment*> idle;
  for (auto& [base, seg] : segments_) {
    if (seg->live_blocks == 0 && !(large_only && seg->small) && !seg->growable) {
      idle.push_back(seg.get());
    }
  }
  std::size_t released = unmap_free_pages();
  for (auto* seg : idle) {
    released += seg->size;
    release_segment(seg);
  }
  return released;
}

std::size_t device_pool::trim()
{
  std::lock_guard lock{mutex_};
  if (forked_) { return 0; }
  queue_.drain([this](block* b) { release_block(b); });
  return release_free_segments();
}

void device_pool::synchronize()
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  queue_.drain([this](block* b) { release_block(b); });
}

void device_pool::free_retired(block* blk)
{
  ++stats_.frees;
  auto* seg = blk->seg;
  if (--seg->live_blocks > 0) { return; }
  // Free the segment only if the driver still knows it as the same allocation: after a real
  // context reset its address may belong to someone else by now.
  try {
    // A growable segment's pages are left mapped (they may not be this process's any more
    // after a context reset; docs/limits.md).
    if (!seg->growable && !process_is_exiting() &&
        driver_->buffer_id(device_, seg->base) == seg->buffer_id) {
      driver_->deallocate(device_, seg->base);
    }
  } catch (...) {
  }
  for (auto* b = seg->first; b != nullptr;) {
    auto* next = b->next;
    blocks_.recycle(b);
    b = next;
  }
  auto it = std::find_if(retired_segments_.begin(), retired_segments_.end(),
                         [seg](auto const& s) { return s.get() == seg; });
  retired_segments_.erase(it);
}

void device_pool::reset()
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  try {
    queue_.drain([this](block* b) { release_block(b); });
  } catch (...) {
    // The context is already unusable: pending blocks can't be fenced; nothing uses them now.
    for (auto* b : queue_.abandon()) {
      b->also_fence = stream_ref::none();
      release_block(b);
    }
  }
  int const deferrals = cleanup_deferrals_;
  cleanup_deferrals_  = 0;  // a reset frees what it can regardless
  try {
    release_free_segments();
  } catch (...) {
  }
  cleanup_deferrals_ = deferrals;
  if (growable_seg_ != nullptr && growable_seg_->live_blocks == 0) { drop_growable(true); }

  // What is left holds live blocks: retire it, so that it is never handed out again.
  for (auto& [base, seg] : segments_) {
    seg->retired = true;
    for (auto* b = seg->first; b != nullptr; b = b->next) {
      if (b->state == detail::block_state::free) { erase_free(b); }
    }
    stats_.bytes_reserved -= seg->growable ? pages_->mapped_bytes() : seg->size;
    --stats_.segments;
    retired_segments_.push_back(std::move(seg));
  }
  segments_.clear();
  if (pages_ != nullptr) { drop_growable(false); }  // retired above: its pages stay mapped
  for (auto& [ptr, blk] : live_) {
    retired_live_.emplace(std::make_pair(generation_, ptr), blk);
    stats_.bytes_in_use -= blk->size;
    stats_.bytes_in_use_by_tag[blk->tag] -= blk->size;
    --stats_.blocks_in_use;
  }
  live_.clear();
  queue_.release_events();
  try {
    driver_->release_context(device_);
  } catch (...) {
    // Already gone: nothing is held.
  }
  ++generation_;
}

std::uint64_t device_pool::generation() const
{
  std::lock_guard lock{mutex_};
  return generation_;
}

void device_pool::defer_cleanup_begin()
{
  std::lock_guard lock{mutex_};
  ++cleanup_deferrals_;
}

void device_pool::defer_cleanup_end()
{
  std::lock_guard lock{mutex_};
  EMMPOOL_EXPECTS(cleanup_deferrals_ > 0, "defer_cleanup_end without defer_cleanup_begin");
  if (--cleanup_deferrals_ == 0 && options_.mode == pool_mode::passthrough) {
    release_free_segments();  // segments whose release was held back
  }
}

// ---- queries ------------------------------------------------------------------------------

bool device_pool::owns(device_ptr ptr) const
{
  std::lock_guard lock{mutex_};
  return live_.count(ptr) != 0;
}

std::optional<ipc_info> device_pool::ipc_handle(device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin()) { return std::nullopt; }
  --it;
  auto& seg = *it->second;
  if (ptr >= seg.base + seg.size || seg.live_blocks == 0) { return std::nullopt; }
  if (seg.growable) {
    throw pool_error{"emmpool: no IPC handle for a block of a growable segment (cuIpcGetMemHandle "
                     "cannot export memory mapped with cuMemMap). Numba's allocations never "
                     "come from one; for other libraries use EMMPOOL_SEGMENTS=fixed"};
  }
  if (!seg.ipc) { seg.ipc = driver_->ipc_handle(device_, seg.base); }
  ++seg.exported;
  return ipc_info{*seg.ipc, seg.base, seg.size, static_cast<std::size_t>(ptr - seg.base)};
}

void device_pool::record(char op, device_ptr ptr, std::size_t size, stream_handle stream,
                         std::uint8_t tag)
{
  auto const now = std::chrono::steady_clock::now().time_since_epoch();
  trace_.push_back(
    {static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()),
     ptr, size, stream, op, tag});
}

void device_pool::set_tracing(bool on)
{
  std::lock_guard lock{mutex_};
  tracing_ = on;
}

std::vector<trace_record> device_pool::take_trace()
{
  std::lock_guard lock{mutex_};
  return std::exchange(trace_, {});
}

pool_stats device_pool::stats() const
{
  std::lock_guard lock{mutex_};
  pool_stats s     = stats_;
  s.bytes_waiting  = queue_.waiting_bytes();
  s.batches_closed = queue_.batches_closed();
  s.dormant_fences = queue_.dormant_fences();
  if (pages_ != nullptr) {
    // A growable segment's free blocks are address space: only their mapped pages are memory.
    for (auto const* b : growable_free_) { s.bytes_free += pages_->mapped_overlap(b->ptr, b->size); }
  }
  std::size_t best = 0;
  if (!small_free_.empty()) { best = (*small_free_.rbegin())->size; }
  if (!large_free_.empty()) { best = std::max(best, (*large_free_.rbegin())->size); }
  s.largest_free_block = best;
  return s;
}

void device_pool::reset_peaks()
{
  std::lock_guard lock{mutex_};
  stats_.peak_bytes_in_use   = stats_.bytes_in_use;
  stats_.peak_bytes_reserved = stats_.bytes_reserved;
}

std::string device_pool::describe() const
{
  std::lock_guard lock{mutex_};
  return describe_locked();
}

std::string device_pool::describe_locked() const
{
  std::size_t best = 0;
  if (!small_free_.empty()) { best = (*small_free_.rbegin())->size; }
  if (!large_free_.empty()) { best = std::max(best, (*large_free_.rbegin())->size); }
  std::string s = "pool on device " + std::to_string(device_) + " holds " +
                  human(stats_.bytes_reserved) + " in " + std::to_string(stats_.segments) +
                  " segments: " + human(stats_.bytes_in_use) + " in use, " +
                  human(stats_.bytes_free) + " free (largest block " + human(best) + "), " +
                  human(queue_.waiting_bytes()) + " waiting for pending frees";
  if (max_reserved_ != std::numeric_limits<std::size_t>::max()) {
    s += "; cap " + human(max_reserved_);
  }
  return s;
}

}  // namespace emmpool
