#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>

#include <algorithm>
#include <limits>
#include <mutex>
#include <utility>

namespace emmpool {

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t large_granularity = 2 * mib;  // the driver's own allocation granularity

using detail::human_bytes;

constexpr std::size_t round_up(std::size_t n, std::size_t a) noexcept { return (n + a - 1) / a * a; }

std::size_t checked_rounded_size(std::size_t bytes, alloc_tag tag)
{
  EMMPOOL_EXPECTS(bytes <= std::numeric_limits<std::size_t>::max() / 2,
                  "allocation size is too large");
  EMMPOOL_EXPECTS(static_cast<std::size_t>(tag) < alloc_tag_count, "unknown allocation tag");
  return std::max(round_up(bytes, device_pool::alignment), device_pool::alignment);
}

}  // namespace

// ---- lifecycle ------------------------------------------------------------------------------

device_pool::device_pool(driver& drv, int device, pool_options options)
  : driver_{&drv},
    device_{device},
    options_{options}
{
  EMMPOOL_EXPECTS(device >= 0, "device must be a non-negative ordinal");
  options_.check();

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
  trace_.set(options_.trace);
  growable_.configure(options_, max_reserved_);
  if (options_.initial_size > 0 && options_.mode == pool_mode::pool) {
    std::lock_guard lock{mutex_};
    auto* blk = grow(round_up(options_.initial_size, large_granularity), true);
    if (blk == nullptr) {
      throw out_of_memory{"emmpool: cannot reserve the initial pool of " +
                          human_bytes(options_.initial_size) + " on device " +
                          std::to_string(device_)};
    }
    free_.insert(blk);
  }
}

device_pool::~device_pool()
{
  std::lock_guard lock{mutex_};
  // Whatever is left goes back to the driver, without waiting: the pool is going away, so
  // nobody can be handed these blocks again. At process exit the driver may be gone: leak.
  if (!may_call_driver_at_teardown()) {
    fences_.drop_events();  // no CUDA call: the driver may be gone, or belong to the parent
    return;
  }
  for (auto& [base, seg] : segments_) {
    try {
      if (!seg->growable) { driver_->deallocate(device_, base); }
    } catch (...) {
    }
  }
  growable_.release_at_teardown();
  retired_.release_all();
  (void)fences_.abandon();
  lanes_.clear();
}

// ---- allocation: stream order, then best fit, then the out-of-memory ladder -------------------

device_pool::block* device_pool::take_best_fit(std::size_t rounded, bool growable, bool may_map)
{
  if (growable) { return take_growable(rounded, may_map); }
  return free_.take(rounded, rounded <= options_.small_request, alignment);
}

device_pool::block* device_pool::take_growable(std::size_t rounded, bool may_map)
{
  // The growable segment's best fit, off its free list; if mapping its pages makes a new peak
  // (or meets the cap), wholly free memory goes back to the driver first, as before growing a
  // fixed segment; then its pages are mapped (detail/growable_space.hpp).
  auto const claim = growable_.claim_best_fit(rounded, may_map);
  if (claim.blk == nullptr) { return nullptr; }
  if (auto const room = growable_.room_for(claim)) {
    try {
      release_free_segments(true, room);
    } catch (...) {
      growable_.give_back(claim);  // a failed cuMemFree: the claimed block is not lost
      throw;
    }
  }
  return growable_.finish(claim);
}

detail::block_kind device_pool::kind_of(std::size_t rounded, bool growable) const noexcept
{
  if (growable) { return detail::block_kind::growable; }
  return rounded <= options_.small_request ? detail::block_kind::small : detail::block_kind::large;
}

// Stream order first: a block this stream freed needs no fence for this stream's work (whole
// if at most 1/8 larger, else cut), unless a free block fits tighter; else a free block. A
// growable request cuts a pending block only at the ladder's first step (allocate()): what
// completed since may fit better, coalesced.
device_pool::block* device_pool::take_without_cuda(std::size_t rounded, stream_ref stream)
{
  if (options_.mode != pool_mode::pool) { return nullptr; }
  auto* blk = lanes_.take(stream, rounded, kind_of(rounded, false));
  return blk != nullptr ? blk : take_best_fit(rounded);
}

device_pool::block* device_pool::take_growable_without_cuda(std::size_t rounded, stream_ref stream)
{
  // Pool mode: serves() said so. take_growable(.., false) maps no page here.
  auto* blk = lanes_.take(stream, rounded, detail::block_kind::growable);
  return blk != nullptr ? blk : take_growable(rounded, false);
}

std::optional<device_ptr> device_pool::try_allocate(std::size_t bytes, stream_handle stream,
                                                    alloc_tag tag, std::uint64_t* generation_out)
{
  std::size_t const rounded = checked_rounded_size(bytes, tag);
  std::unique_lock lock{mutex_, std::try_to_lock};
  if (!lock.owns_lock() || forked_) { return std::nullopt; }
  auto const key = keys_.of_allocation(stream);
  if (fences_.fence_due()) { return std::nullopt; }  // allocate() fences them (CUDA calls)
  if (auto* blk = growable_.serves(rounded, tag) ? take_growable_without_cuda(rounded, key)
                                                 : take_without_cuda(rounded, key)) {
    if (generation_out != nullptr) { *generation_out = generation_; }
    return hand_out(blk, bytes, key, tag);
  }
  missed_ = missed_request{bytes, stream, tag, rounded, key, free_.insertions(), fences_.version()};
  return std::nullopt;
}

device_ptr device_pool::allocate(std::size_t bytes, stream_handle stream, alloc_tag tag,
                                 std::uint64_t* generation_out)
{
  std::lock_guard lock{mutex_};
  if (generation_out != nullptr) { *generation_out = generation_; }
  if (forked_) { detail::throw_forked(); }
  // try_allocate() missed this very request, and what it searched is as it was (missed_):
  // checked already, and a search would miss again. One check and one search per request.
  auto const* miss   = missed_ ? &*missed_ : nullptr;
  bool const checked = miss && miss->bytes == bytes && miss->stream == stream && miss->tag == tag;
  std::size_t const rounded = checked ? miss->rounded : checked_rounded_size(bytes, tag);
  auto const key = checked ? keys_.of_alive(stream) : keys_.of_allocation(stream);
  bool const searched = checked && miss->key == key && miss->insertions == free_.insertions() &&
                        miss->version == fences_.version();

  bool const pooled = options_.mode == pool_mode::pool;
  bool g            = false;  // a growable request (set at a miss): maps after step 1's fences
  block* blk        = nullptr;
  if (!pooled) {
    maintain(key);  // returns completed frees' segments to the driver
    blk = grow(rounded, true);
  } else {
    if (fences_.fence_due()) { maintain(key); }  // fence the waiting frees now, not at a miss
    if (!searched) {
      blk = growable_.serves(rounded, tag) ? take_growable_without_cuda(rounded, key)
                                           : take_without_cuda(rounded, key);
    }
    if (blk == nullptr) {
      // Ladder step 1: fence what was freed since the last miss, reuse what has completed,
      // else cut a larger block this stream freed (no fence needed), before any growth.
      g = growable_.serves(rounded, tag);
      auto const before = free_.insertions();
      maintain(key);
      if (g || free_.insertions() != before) { blk = take_best_fit(rounded, g, false); }
      if (blk == nullptr) {
        blk = lanes_.split(key, rounded, kind_of(rounded, g));
      }
      if (blk == nullptr && g) { blk = take_best_fit(rounded, true); }  // may map pages
    }
    if (blk == nullptr && (blk = grow(rounded, false, g)) != nullptr) {  // step 2: grow
      blk = free_.split(blk, rounded, alignment);
    }
  }
  if (blk == nullptr && fences_.has_waiting() && captures_ == 0) {
    // Step 3: wait for every pending free (not during a capture: a synchronization).
    drain();
    blk = pooled ? take_best_fit(rounded, g) : grow(rounded, true);
  }
  // Step 4: give wholly free segments (and free pages) back (unless cleanup is deferred),
  // then grow with an exact-size segment.
  if (blk == nullptr && (release_free_segments() > 0 || pooled) &&
      (blk = grow(rounded, true, g)) != nullptr) {
    blk = free_.split(blk, rounded, alignment);
  }
  if (blk == nullptr) {
    ++stats_.out_of_memory;
    throw out_of_memory{"emmpool: out of memory allocating " + human_bytes(bytes) + "; " +
                        describe_locked()};
  }
  return hand_out(blk, bytes, key, tag);
}

device_ptr device_pool::hand_out(block* blk, std::size_t bytes, stream_ref stream, alloc_tag tag)
{
  // A pending block (same-stream reuse) still counts in its segment's live blocks.
  if (blk->state != detail::block_state::pending) { ++blk->seg->live_blocks; }
  blk->state        = detail::block_state::allocated;
  blk->tag          = static_cast<std::uint8_t>(tag);
  blk->also_fence   = stream_ref::none();
  blk->alloc_stream = stream;
  live_.emplace(blk->ptr, blk);

  stats_.count_allocation(blk->size, blk->tag);
  if (trace_.on()) { trace_.record('a', blk->ptr, bytes, stream.handle, blk->tag); }
  return blk->ptr;
}

// ---- growth and giving memory back ----------------------------------------------------------

device_pool::block* device_pool::grow(std::size_t rounded, bool exact, bool growable)
{
  if (growable && growable_.ensure_segment(rounded, segments_)) {
    if (auto* blk = take_growable(rounded, true)) { return blk; }
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
  // Near the cap, a segment just as big as the request may still fit where the usual one
  // (2 MiB small segment, 2 MiB rounding) does not: a cap never refuses what it could hold.
  if (!fits_cap(size) && size > rounded) { size = rounded; }
  if (!fits_cap(size)) { return nullptr; }
  if (options_.mode == pool_mode::pool && !small &&
      stats_.bytes_reserved + size > stats_.peak_bytes_reserved) {
    // About to reach a new peak: first give back large segments that are wholly free (and so
    // could not serve this request). Keeps reserved memory close to what is live on shifting
    // size mixes (replay: peak reserved / peak live 1.40 -> 1.24) at the cost of a cuMemFree,
    // which synchronizes the device, only on growth past the peak. Small segments stay: they
    // are cheap and soon reused.
    release_free_segments(true, size);
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
  blk->kind  = seg->kind();
  seg->first = blk;
  segments_.emplace(base, std::move(seg));

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
  segments_.erase(seg->base);
}

std::size_t device_pool::release_free_segments(bool at_peak, std::size_t need)
{
  if (cleanup_deferred() || forked_) { return 0; }
  std::vector<segment*> idle;
  for (auto& [base, seg] : segments_) {
    if (seg->live_blocks == 0 && !(at_peak && seg->small) && !seg->growable) {
      idle.push_back(seg.get());
    }
  }
  std::size_t released = at_peak ? 0 : growable_.unmap_free(~std::size_t{0});
  for (auto* seg : idle) {
    released += seg->size;
    release_segment(seg);
  }
  if (at_peak) { released += growable_.unmap_for_peak(need); }  // what the peak needs
  return released;
}

std::size_t device_pool::trim()
{
  std::lock_guard lock{mutex_};
  if (forked_ || captures_ > 0) { return 0; }
  drain();
  return release_free_segments();
}

void device_pool::defer_cleanup_begin()
{
  std::lock_guard lock{mutex_};
  begin_deferral();
}

void device_pool::defer_cleanup_end()
{
  std::lock_guard lock{mutex_};
  if (end_deferral()) { release_held_back(); }
}

void device_pool::release_held_back()
{
  if (options_.mode == pool_mode::passthrough) {
    release_free_segments();  // segments whose release a deferral held back
  }
}

// ---- frees: a block comes back once the reuse rule allows (reuse_rule.hpp) -------------------

void device_pool::free_live(device_ptr ptr, stream_handle stream, int tag)
{
  auto it = live_.find(ptr);
  if (it == live_.end() || (tag >= 0 && it->second->tag != tag)) {
    auto const what =
      tag >= 0 ? std::string{" is not a live allocation of this library in this pool"}
               : " on device " + std::to_string(device_) +
                   " is not a live allocation of this pool (freed twice, or never allocated here)";
    throw pool_error{"emmpool: pointer " + std::to_string(ptr) + what};
  }
  auto* blk     = it->second;
  auto const key = keys_.of_free(blk->alloc_stream, stream);  // may throw: before any change
  off_books(it, key);
  settle_freed(blk, key);
}

void device_pool::off_books(live_map::iterator it, stream_ref key)
{
  auto* blk = it->second;
  live_.erase(it);
  if (trace_.on()) { trace_.record('f', blk->ptr, blk->size, key.handle, blk->tag); }
  stats_.count_free(blk->size, blk->tag);
}

void device_pool::deallocate(device_ptr ptr, stream_handle stream)
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }  // the parent's memory: nothing to do here
  free_live(ptr, stream);
}

bool device_pool::try_free(device_ptr ptr, stream_handle stream, std::uint64_t const* generation,
                           int tag)
{
  std::unique_lock lock{mutex_, std::try_to_lock};
  if (!lock.owns_lock()) { return false; }
  if (forked_) { return true; }  // as deallocate(): nothing to do
  // A retired block's free may call CUDA; a tagged free looks among them first.
  if (generation != nullptr ? *generation != generation_ : retired_.holds_any()) { return false; }
  auto it = live_.find(ptr);
  // A bad pointer gets its error from deallocate().
  if (it == live_.end() || (tag >= 0 && it->second->tag != tag) ||
      !reuse_rule::free_is_local(*it->second, stream)) {
    return false;
  }
  auto* blk     = it->second;
  auto const key = keys_.of_free(blk->alloc_stream, stream);  // no CUDA: free_is_local
  off_books(it, key);
  settle_freed(blk, key);
  return true;
}

void device_pool::deallocate(device_ptr ptr, stream_handle stream, std::uint64_t generation)
{
  // One lock for the generation check and the free: a reset() in between could otherwise let
  // this free a block of the next generation at the same address.
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  if (generation == generation_) {
    free_live(ptr, stream);
    return;
  }
  if (!retired_.free(generation, ptr)) {
    throw pool_error{"emmpool: pointer " + std::to_string(ptr) +
                     " from before a reset is not live (freed twice?)"};
  }
  ++stats_.frees;
}

void device_pool::deallocate_tagged(device_ptr ptr, stream_handle stream, alloc_tag tag)
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  auto const t = static_cast<std::uint8_t>(tag);
  // A block of this library retired by a reset comes first (newest generation first): the
  // caller's free cannot say which generation it belongs to, and taking a live block at a
  // reused address for an old one would free memory still in use.
  if (retired_.free_tagged(ptr, t)) {
    ++stats_.frees;
    return;
  }
  free_live(ptr, stream, t);
}

void device_pool::record_stream(device_ptr ptr, stream_handle stream)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw pool_error{"emmpool: record_stream of pointer " + std::to_string(ptr) +
                     ", which is not a live allocation of this pool"};
  }
  // One extra stream per block: the most recent, the one a caller most likely still uses.
  it->second->also_fence = keys_.of_recorded(stream);
}

void device_pool::release_block(block* blk)
{
  auto* seg = blk->seg;
  --seg->live_blocks;
  if (options_.mode == pool_mode::pool) {
    (seg->growable ? growable_.free_list() : free_).coalesce(blk);
    return;
  }
  free_.insert(blk);  // passthrough: the segment, wholly free, goes back to the driver
  if (!cleanup_deferred()) {
    try {
      release_segment(seg);
    } catch (cuda_error const&) {
      // cuMemFree failed (a sticky error, say): the segment stays, wholly free, for a
      // later trim; the block is never handed out again in passthrough mode.
    }
  }
}

void device_pool::settle_freed(block* blk, stream_ref key)
{
  if (!blk->also_fence.is_none()) {
    if (captures_ > 0) {  // its fence would be an event recorded now: after the capture
      held_for_capture_.emplace_back(blk, key);
      return;
    }
    // record_stream: never merged or joined; fenced on the recorded stream first, unless that
    // is key's (one fence: then it waits in key's batch like any other block freed there).
    if (fences_.push_recorded(blk, key) && lanes_.orders(key)) { lanes_.index(key, blk); }
    return;
  }
  if (lanes_.joins_open(key)) {  // no stream order (Numba's frees): one record per neighbours
    if (!lanes_.join_open(blk, key)) { fences_.push(blk, key); }
  } else if (!lanes_.may_merge(blk, key)) {
    pend(blk, key);
  } else if (auto* merged = lanes_.merge_neighbours(blk, key)) {
    pend(merged, key);
  }
}

void device_pool::pend(block* blk, stream_ref key)
{
  fences_.push(blk, key);
  if (lanes_.orders(key)) { lanes_.index(key, blk); }
}

void device_pool::settle_fenced()
{
  // First the lanes, in the order reported (a block requeued for its second fence may be
  // released later in the same list): no block stays takeable once out of its batch, even if
  // a release below throws. Then the releases; what an exception leaves unreleased stays for
  // the next call.
  for (auto const& f : fenced_) {
    if (!f.requeued) {
      lanes_.forget(f.blk, f.stream);
    } else if (lanes_.orders(f.stream)) {  // now in the batch of the stream of its free
      lanes_.index(f.stream, f.blk);
    }
  }
  std::size_t i = 0;
  try {
    for (; i < fenced_.size(); ++i) {
      if (!fenced_[i].requeued) { release_block(fenced_[i].blk); }
    }
  } catch (...) {
    // Keep the releases not done yet, nothing else (the lanes are settled).
    std::vector<detail::fenced_block> rest;
    for (std::size_t j = i + 1; j < fenced_.size(); ++j) {
      if (!fenced_[j].requeued) { rest.push_back(fenced_[j]); }
    }
    fenced_.swap(rest);
    throw;
  }
  fenced_.clear();
}

void device_pool::maintain(stream_ref alive)
{
  if (!fenced_.empty()) { settle_fenced(); }  // what an exception left behind, first
  if (captures_ > 0) { return; }  // polling records and queries events
  try {
    fences_.poll(alive, fenced_);
  } catch (...) {
    settle_fenced();  // what completed before the failure is reusable all the same
    throw;
  }
  if (!fenced_.empty()) { settle_fenced(); }
}

void device_pool::drain()
{
  if (!fenced_.empty()) { settle_fenced(); }
  try {
    fences_.drain(fenced_);
  } catch (...) {
    settle_fenced();
    throw;
  }
  settle_fenced();
}

void device_pool::synchronize()
{
  std::lock_guard lock{mutex_};
  if (forked_ || captures_ > 0) { return; }
  drain();
}

// ---- CUDA graph capture: no CUDA call that a capture forbids ---------------------------------

void device_pool::capture_begin()
{
  std::lock_guard lock{mutex_};
  ++captures_;
  begin_deferral();  // nothing given back to the driver: cuMemFree synchronizes
}

void device_pool::capture_end()
{
  std::lock_guard lock{mutex_};
  if (captures_ == 0) {
    throw pool_error{"emmpool: capture_end without capture_begin on device " +
                     std::to_string(device_)};
  }
  --captures_;
  bool const last_deferral = end_deferral();
  if (captures_ == 0) { settle_held_for_capture(); }
  if (last_deferral) { release_held_back(); }
}

bool device_pool::capturing() const
{
  std::lock_guard lock{mutex_};
  return captures_ > 0;
}

void device_pool::settle_held_for_capture()
{
  while (!held_for_capture_.empty()) {
    auto const [blk, key] = held_for_capture_.back();
    settle_freed(blk, key);  // may throw (an event): the rest stay held for the next call
    held_for_capture_.pop_back();
  }
}

// ---- the cap, and the pool's layout ---------------------------------------------------------

void device_pool::set_maximum_size(std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  std::size_t const cap = bytes != 0 ? bytes : std::numeric_limits<std::size_t>::max();
  auto const held_now = [this] {
    return stats_.bytes_in_use + fences_.waiting_bytes() + reserved_outside_;
  };
  if (held_now() > cap && fences_.has_waiting() && captures_ == 0) {
    drain();  // frees waiting for their fence do not count against the new cap
  }
  std::size_t const held = held_now();
  if (held > cap) {
    throw pool_error{"emmpool: cannot cap device " + std::to_string(device_) + "'s pool at " +
                     human_bytes(cap) + ": " + human_bytes(held) +
                     " is in use (allocated, or freed and waiting for its fence" +
                     (reserved_outside_ != 0 ? ", or reserved by another allocator)" : ")")};
  }
  max_reserved_ = cap;
  growable_.set_cap(growth_cap());
  if (stats_.bytes_reserved > growth_cap() && captures_ == 0 && !cleanup_deferred()) {
    drain();
    release_free_segments();
  }
}

std::size_t device_pool::maximum_size() const
{
  std::lock_guard lock{mutex_};
  return max_reserved_;
}

bool device_pool::reserve_outside(std::ptrdiff_t delta)
{
  std::lock_guard lock{mutex_};
  if (delta < 0) {
    reserved_outside_ -= std::min(reserved_outside_, static_cast<std::size_t>(-delta));
  } else {
    auto const n = static_cast<std::size_t>(delta);
    if (!fits_cap(n) && !forked_ && captures_ == 0 && !cleanup_deferred()) {
      drain();  // frees waiting for their fence may empty whole segments
      release_free_segments();
    }
    if (!fits_cap(n)) { return false; }
    reserved_outside_ += n;
  }
  growable_.set_cap(growth_cap());
  return true;
}

std::size_t device_pool::reserved_outside() const
{
  std::lock_guard lock{mutex_};
  return reserved_outside_;
}

std::vector<layout_block> device_pool::layout() const
{
  std::lock_guard lock{mutex_};
  std::vector<layout_block> out;
  for (auto const& [base, seg] : segments_) {
    auto const kind = static_cast<std::uint8_t>(seg->kind());
    for (auto const* b = seg->first; b != nullptr; b = b->next) {
      bool const free = b->state == detail::block_state::free;
      out.push_back(layout_block{seg->base, seg->size, b->ptr, b->size,
                                 static_cast<std::uint8_t>(b->state), free ? std::uint8_t{0} : b->tag,
                                 kind, free ? legacy_stream : b->alloc_stream.handle});
    }
  }
  return out;
}

// ---- reset: live segments retired (detail/retired_segments.hpp) -----------------------------

void device_pool::reset()
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  settle_held_for_capture();
  fences_.drain_or_abandon(fenced_);
  settle_fenced();
  regardless_of_deferrals([this] { release_free_segments(); });  // errors ignored
  auto const growable_mapped = growable_.mapped_bytes();
  growable_.drop(segments_);  // wholly free: released; else its pages stay mapped, retired

  // What is left holds live blocks: retire it, so that it is never handed out again.
  for (auto& [base, seg] : segments_) {
    if (!seg->growable) { free_.erase_all_of(*seg); }  // growable: drop() did
    stats_.bytes_reserved -= seg->growable ? growable_mapped : seg->size;
    --stats_.segments;
  }
  for (auto& [ptr, blk] : live_) { stats_.count_out_of_use(blk->size, blk->tag); }
  retired_.retire(segments_, live_, generation_);
  fences_.release_events();
  try {
    driver_->release_context(device_);
  } catch (...) {
    // Already gone: nothing is held.
  }
  ++generation_;
}

// ---- IPC ------------------------------------------------------------------------------------

device_pool::segment* device_pool::segment_with_live_blocks(device_ptr ptr) const
{
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin()) { return nullptr; }
  --it;
  auto* const seg = it->second.get();
  return ptr < seg->base + seg->size && seg->live_blocks != 0 ? seg : nullptr;
}

bool device_pool::owns(device_ptr ptr) const
{
  std::lock_guard lock{mutex_};
  return live_.count(ptr) != 0;
}

std::optional<std::pair<device_ptr, std::size_t>> device_pool::live_extent(device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  if (auto const it = live_.find(ptr); it != live_.end()) {  // the array's start: the usual ask
    return std::pair{ptr, it->second->size};
  }
  auto const* seg = segment_with_live_blocks(ptr);
  if (seg == nullptr) { return std::nullopt; }
  // A view inside an array: walk the segment's blocks in address order (a rare ask; a small
  // segment holds at most a few thousand blocks).
  for (auto const* b = seg->first; b != nullptr && b->ptr <= ptr; b = b->next) {
    if (ptr < b->ptr + b->size) {
      if (b->state != detail::block_state::allocated) { return std::nullopt; }
      return std::pair{b->ptr, b->size};
    }
  }
  return std::nullopt;
}

std::optional<ipc_info> device_pool::ipc_handle(device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  auto* const found = segment_with_live_blocks(ptr);
  if (found == nullptr) { return std::nullopt; }
  auto& seg = *found;
  if (seg.growable) { detail::growable_space::throw_no_ipc(); }
  if (!seg.ipc) { seg.ipc = driver_->ipc_handle(device_, seg.base); }
  return ipc_info{*seg.ipc, seg.base, seg.size, static_cast<std::size_t>(ptr - seg.base)};
}

// ---- tracing and statistics -----------------------------------------------------------------

void device_pool::set_tracing(bool on)
{
  std::lock_guard lock{mutex_};
  trace_.set(on);
}

std::vector<trace_record> device_pool::take_trace()
{
  std::lock_guard lock{mutex_};
  return trace_.take();
}

pool_stats device_pool::stats() const
{
  std::lock_guard lock{mutex_};
  return stats_locked();
}

pool_stats device_pool::stats_locked() const
{
  pool_stats s         = stats_;
  // A growable segment's free blocks are address space: only their mapped pages count.
  s.bytes_free         = free_.bytes() + growable_.free_mapped_bytes();
  s.largest_free_block = free_.largest();
  s.bytes_waiting      = fences_.waiting_bytes();
  s.blocks_waiting     = fences_.waiting_blocks();
  s.batches_closed     = fences_.batches_closed();
  s.fence_queries      = fences_.fence_queries();
  s.dormant_fences     = fences_.dormant_fences();
  s.same_stream_reuses = lanes_.reuses();
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
  auto text = emmpool::describe(stats_locked(), device_, max_reserved_);
  if (reserved_outside_ != 0) {
    text += "; " + human_bytes(reserved_outside_) + " of the cap is reserved by another allocator";
  }
  return text;
}

}  // namespace emmpool
