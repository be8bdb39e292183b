// device_pool: an allocation's ladder, growth, a free, giving memory back, statistics. What the
// pool's views (pool_controls, pool_queries, pool_sharing, pool_observers) do is in their files.
#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/round_up.hpp>

#include <algorithm>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace emmpool {

namespace {

using detail::human_bytes;

std::size_t checked_rounded_size(std::size_t bytes, alloc_tag tag)
{
  EMMPOOL_EXPECTS(bytes <= std::numeric_limits<std::size_t>::max() / 2,
                  "allocation size is too large");
  EMMPOOL_EXPECTS(static_cast<std::size_t>(tag) < alloc_tag_count, "unknown allocation tag");
  return block_bytes(bytes);
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

  std::size_t cap = options_.maximum_size != 0 ? options_.maximum_size : detail::pool_cap::none;
  if (options_.maximum_fraction > 0.0) {
    auto const total = driver_->memory_info_of(device_).total;
    cap = std::min(cap, static_cast<std::size_t>(options_.maximum_fraction * total));
  }
  cap_.set_maximum(cap);
  EMMPOOL_EXPECTS(options_.initial_size <= cap, "initial_size exceeds the maximum pool size");
  trace_.set(options_.trace);
  segment_log_.set(options_.segment_events);
  growable_.configure(options_);
  if (options_.initial_size > 0 && options_.mode == pool_mode::pool) {
    std::lock_guard lock{mutex_};
    auto const size = round_up(options_.initial_size, segment_granularity);
    auto* blk       = grow(request{size, size, {}, alloc_tag::other, false}, growth::exact);
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
    lanes_.drop_events();  // no CUDA call: the driver may be gone, or belong to the parent
    return;
  }
  for (auto& [base, seg] : index_.segments()) {
    try {
      if (!seg->growable) { driver_->deallocate(device_, base); }
    } catch (...) {
    }
  }
  growable_.release_at_teardown();
  retired_.release_all();
  lanes_.abandon();
}

// ---- an allocation: stream order, then best fit, then the out-of-memory ladder ----------------

detail::block_kind device_pool::kind_of(request const& r) const noexcept
{
  if (r.growable) { return detail::block_kind::growable; }
  return r.rounded <= options_.small_request ? detail::block_kind::small : detail::block_kind::large;
}

device_pool::block* device_pool::take_free(request const& r, detail::mapping m)
{
  if (!r.growable) {
    return free_.take(r.rounded, kind_of(r), alignment);
  }
  // A large fixed segment first (initial_pool_size's, or one made where pages could not be):
  // memory held already, which the growable segment would otherwise map beside. Asked first
  // whether there is any, in place: most pools have none, and the call showed in the
  // allocate/free pair.
  if (free_.any_large()) {
    if (auto* blk = free_.take(r.rounded, detail::block_kind::large, alignment)) { return blk; }
  }
  if (auto* blk = growable_.take_mapped(r.rounded)) { return blk; }  // the usual case
  return m == detail::mapping::allowed ? claim_and_map(r) : nullptr;
}

device_pool::block* device_pool::claim_and_map(request const& r)
{
  // The growable segment's free block where the request lacks the fewest pages, off its free
  // list; its missing pages moved from free blocks beyond the limit; for what new pages it
  // still needs, wholly free memory goes back to the driver first if they would pass the cap;
  // then its pages are mapped (detail/growable_space.hpp). New pages past the peak while the
  // request's own stream's frees could cover them are not mapped: the ladder's next step waits
  // for those (detail/page_policy.hpp). A function of its own, so that take_free()'s usual
  // case sets up no exception handler.
  auto claim = growable_.claim_placed(r.rounded, r.tag, detail::mapping::allowed);
  if (claim.blk == nullptr) { return nullptr; }
  try {
    auto const fresh = growable_.prepare(claim, unmapping());
    // Only a stream the fence queue can wait for (one with an id), and only once: the retake
    // after the wait maps what it still lacks.
    if (r.key.identified() && r.at_peak == peak_wait::none && capture_.may_fence() &&
        detail::page_policy::waits_at_new_peak(fresh, ledger_.past_peak(fresh),
                                               lanes_.fences().waiting_bytes_of(r.key))) {
      growable_.give_back(claim);
      r.at_peak = peak_wait::due;
      return nullptr;
    }
    if (fresh != 0 && !cap_.fits(ledger_.reserved(), fresh)) {
      // A new peak alone gives no fixed segment back: those hold small requests, which would
      // make them again at their next one, and each side's cache would evict the other's
      // every step of a program that mixes them (detail/page_policy.hpp).
      release_free_segments(give_back::all);
    }
  } catch (...) {
    growable_.give_back(claim);  // a failed cuMemFree or cuMemUnmap: not lost
    throw;
  }
  return growable_.finish(claim, unmapping());
}

detail::unmapping device_pool::unmapping() const noexcept
{
  return capture_.may_give_back() ? detail::unmapping::allowed : detail::unmapping::forbidden;
}

// The ladder's steps, in order (allocate()); each returns the block or null, and none runs
// another.

// 1. Stream order first: a block this stream freed needs no fence for this stream's work (whole
// if at most 1/8 larger, else cut), unless a free block fits tighter; else a free block whose
// memory is held already. No CUDA call (try_allocate() is this step alone).
device_pool::block* device_pool::take_cached(request const& r)
{
  auto* blk = lanes_.take(r.key, r.rounded, kind_of(r), free_);
  return blk != nullptr ? blk : take_free(r, detail::mapping::none);
}

// 2. Fence what was freed since the last miss and reuse what has completed, else cut a larger
// block this stream freed (no fence needed), before any growth.
device_pool::block* device_pool::fence_and_retake(request const& r)
{
  auto const before = free_.insertions();
  maintain(r.key);
  block* blk = nullptr;
  if (r.growable || free_.insertions() != before) { blk = take_free(r, detail::mapping::none); }
  return blk != nullptr ? blk : lanes_.split(r.key, r.rounded, kind_of(r));
}

// 3. The growable segment's pages: mapped under its best free block (its reservation made by
// the first request).
device_pool::block* device_pool::map_pages(request const& r)
{
  if (!r.growable || !growable_.ensure_segment(r.rounded, index_.segments())) { return nullptr; }
  return claim_and_map(r);
}

// 4. New pages would pass the peak while this stream's own frees, still waiting for their fence,
// could cover them: wait for those (the newest fence of the stream), then take what completed,
// mapping what is missing.
device_pool::block* device_pool::wait_for_own_frees(request const& r)
{
  if (r.at_peak != peak_wait::due) { return nullptr; }
  ++stats_.fence_waits;
  drain(r.key);
  r.at_peak = peak_wait::done;
  return take_free(r, detail::mapping::allowed);
}

// 5. A fixed segment: the request's kind, or, for a growable request whose pages could not be
// mapped (no address space, or no memory for a page where a segment still fits), a large one.
device_pool::block* device_pool::grow_for(request const& r)
{
  auto* blk = grow(r, growth::shared);
  return blk != nullptr ? free_.split(blk, r.rounded, alignment) : nullptr;
}

// 6. Wait for every pending free (not during a capture: a synchronization), then take what
// completed.
device_pool::block* device_pool::wait_and_retake(request const& r)
{
  if (!lanes_.fences().has_waiting() || !capture_.may_fence()) { return nullptr; }
  ++stats_.fence_waits;
  drain();
  if (options_.mode != pool_mode::pool) { return grow(r, growth::exact); }
  return take_free(r, detail::mapping::allowed);
}

// 7. Give wholly free segments and pages back (unless cleanup is deferred), then grow by what
// the request needs alone: pages (under the growable segment's best free block, as in step 3,
// now with what was given back), else an exact-size segment.
device_pool::block* device_pool::give_back_and_grow(request const& r)
{
  bool const pooled = options_.mode == pool_mode::pool;
  if (release_free_segments(give_back::all) == 0 && !pooled) { return nullptr; }
  if (r.growable && growable_.ensure_segment(r.rounded, index_.segments())) {
    if (auto* blk = claim_and_map(r)) { return blk; }
  }
  auto* blk = grow(r, growth::exact);
  return blk != nullptr ? free_.split(blk, r.rounded, alignment) : nullptr;
}

// Passthrough: completed frees' segments go back first; each allocation a segment of its own.
device_pool::block* device_pool::passthrough_allocate(request const& r)
{
  maintain(r.key);
  return grow(r, growth::exact);
}

void device_pool::fail(request const& r)
{
  ++stats_.out_of_memory;
  throw out_of_memory{"emmpool: out of memory allocating " + human_bytes(r.bytes) + "; " +
                      describe_locked()};
}

std::optional<device_ptr> device_pool::try_allocate(std::size_t bytes, stream_handle stream,
                                                    alloc_tag tag, std::uint64_t* generation_out)
{
  std::size_t const rounded = checked_rounded_size(bytes, tag);
  std::unique_lock lock{mutex_, std::try_to_lock};
  if (!lock.owns_lock() || forked_ || options_.mode != pool_mode::pool) { return std::nullopt; }
  auto const key = keys_.of_allocation(stream);
  if (lanes_.fences().fence_due()) { return std::nullopt; }  // allocate() fences them (CUDA calls)
  request const r{bytes, rounded, key, tag, growable_.serves(rounded)};
  auto* blk = take_cached(r);
  if (blk == nullptr) { return std::nullopt; }
  if (generation_out != nullptr) { *generation_out = generation_; }
  return hand_out(blk, bytes, key, tag);
}

device_ptr device_pool::allocate(std::size_t bytes, stream_handle stream, alloc_tag tag,
                                 std::uint64_t* generation_out)
{
  std::size_t const rounded = checked_rounded_size(bytes, tag);
  std::lock_guard lock{mutex_};
  if (generation_out != nullptr) { *generation_out = generation_; }
  if (forked_) { detail::throw_forked(); }
  auto const key = keys_.of_allocation(stream);
  request const r{bytes, rounded, key, tag,
                  options_.mode == pool_mode::pool && growable_.serves(rounded)};

  // The ladder (PyTorch's allocator reads the same way): each step runs only if those before
  // it found nothing.
  block* blk = nullptr;
  if (options_.mode == pool_mode::pool) {
    if (lanes_.fences().fence_due()) { maintain(key); }  // fence waiting frees now, not at a miss
    (void)((blk = take_cached(r)) ||         //
           (blk = fence_and_retake(r)) ||    //
           (blk = map_pages(r)) ||           //
           (blk = wait_for_own_frees(r)) ||  //
           (blk = grow_for(r)) ||            //
           (blk = wait_and_retake(r)) ||     //
           (blk = give_back_and_grow(r)));
  } else {
    (void)((blk = passthrough_allocate(r)) ||  //
           (blk = wait_and_retake(r)) ||       //
           (blk = give_back_and_grow(r)));
  }
  if (blk == nullptr) { fail(r); }
  return hand_out(blk, bytes, key, tag);
}

// ---- growth and giving memory back ----------------------------------------------------------

device_pool::block* device_pool::grow(request const& r, growth g)
{
  bool const small = options_.small(r.rounded);
  std::size_t size = options_.segment_size(r.rounded, g == growth::exact);
  // Near the cap, a segment just as big as the request may still fit where the usual one
  // (2 MiB small segment, 2 MiB rounding) does not: a cap never refuses what it could hold.
  if (!cap_.fits(ledger_.reserved(), size) && size > r.rounded) { size = r.rounded; }
  if (!cap_.fits(ledger_.reserved(), size)) { return nullptr; }
  if (options_.mode == pool_mode::pool && !small && ledger_.past_peak(size)) {
    // About to reach a new peak: first give back large segments that are wholly free (and so
    // could not serve this request). Keeps reserved memory close to what is live on shifting
    // size mixes (the fragmentation replay: benchmarks/replay.py) at the cost of a cuMemFree,
    // which synchronizes the device, only on growth past the peak. Small segments stay: they
    // are cheap and soon reused.
    release_free_segments(give_back::large_at_peak);
  }
  return make_segment(size, small, r.tag);
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
  ledger_.segment_made(size);
  return blk;
}

void device_pool::release_segment(segment* seg)
{
  // The driver first: if cuMemFree fails, the segment stays in the pool, consistent.
  driver_->deallocate(device_, seg->base);
  auto* blk = seg->first;  // wholly free: one block spanning the segment
  free_.erase(blk);
  blocks_.recycle(blk);
  ledger_.segment_released(seg->size);
  segment_log_.record(segment_event::kind::released, static_cast<segment_type>(seg->kind()), 0,
                      seg->base, seg->size);
  index_.segments().erase(seg->base);
}

std::size_t device_pool::release_free_segments(give_back what)
{
  if (!capture_.may_give_back() || forked_) { return 0; }
  bool const at_peak = what == give_back::large_at_peak;
  std::vector<segment*> idle;
  for (auto& [base, seg] : index_.segments()) {
    if (seg->live_blocks == 0 && !(at_peak && seg->small) && !seg->growable) {
      idle.push_back(seg.get());
    }
  }
  // At a fixed segment's new peak the growable segment's free pages stay: beyond its limit
  // they move under its own requests instead (detail/page_policy.hpp).
  std::size_t released =
    at_peak ? 0
            : growable_.unmap_free(detail::growable_space::all_free,
                                   detail::unmapped_pages::release);
  for (auto* seg : idle) {
    released += seg->size;
    release_segment(seg);
  }
  return released;
}

device_ptr device_pool::hand_out(block* blk, std::size_t bytes, stream_ref stream, alloc_tag tag)
{
  // A pending block (same-stream reuse) still counts in its segment's live blocks.
  if (blk->state != detail::block_state::pending) { ++blk->seg->live_blocks; }
  blk->state        = detail::block_state::allocated;
  blk->tag          = static_cast<std::uint8_t>(tag);
  blk->also_fence   = stream_ref::none();
  blk->alloc_stream = stream;
  index_.live().emplace(blk->ptr, blk);

  stats_.count_allocation(blk->size, blk->tag);
  if (trace_.on()) { trace_.record('a', blk->ptr, bytes, stream.handle, blk->tag); }
  return blk->ptr;
}

// ---- frees: a block comes back once the reuse rule allows (reuse_rule.hpp) -------------------

detail::live_map::iterator device_pool::live_block_of(device_ptr ptr, block_owner owner)
{
  auto& live = index_.live();
  auto it    = live.find(ptr);
  if (it == live.end() || (owner.has_library() && it->second->tag != owner.library())) {
    auto const what =
      owner.has_library()
        ? std::string{" is not a live allocation of this library in this pool"}
        : " on device " + std::to_string(device_) +
            " is not a live allocation of this pool (freed twice, or never allocated here)";
    throw pool_error{"emmpool: pointer " + std::to_string(ptr) + what};
  }
  return it;
}

void device_pool::off_books(detail::live_map::iterator it, stream_ref key)
{
  auto* blk = it->second;
  index_.live().erase(it);
  if (trace_.on()) { trace_.record('f', blk->ptr, blk->size, key.handle, blk->tag); }
  stats_.count_free(blk->size, blk->tag);
  forget_share(blk->ptr);
}

void device_pool::deallocate(device_ptr ptr, stream_handle stream, block_owner owner)
{
  // One lock for the owner's checks and the free: a reset() in between could otherwise let
  // this free a block of the next generation at the same address.
  std::lock_guard lock{mutex_};
  if (forked_) { return; }  // the parent's memory: nothing to do here
  if (owner.has_generation() && owner.generation() != generation_) {
    if (!retired_.free(owner.generation(), ptr)) {
      throw pool_error{"emmpool: pointer " + std::to_string(ptr) +
                       " from before a reset is not live (freed twice?)"};
    }
    ++stats_.frees;
    return;
  }
  // A block of this library retired by a reset comes first (newest generation first): the
  // caller's free cannot say which generation it belongs to, and taking a live block at a
  // reused address for an old one would free memory still in use.
  if (owner.has_library() && retired_.free_tagged(ptr, owner.library())) {
    ++stats_.frees;
    return;
  }
  auto it        = live_block_of(ptr, owner);
  auto const key = keys_.of_free(it->second->alloc_stream, stream);  // may throw: before any change
  auto* blk      = it->second;
  if (blk->held) {
    // Another process may still use it (hold()): the caller's pointer is no longer live, but
    // the block stays in use, unfenced, until the last release_hold() settles this free.
    auto& h = holds_.at(blk->ptr);  // throws before any change if the books disagree
    index_.live().erase(it);
    if (trace_.on()) { trace_.record('f', blk->ptr, blk->size, key.handle, blk->tag); }
    h.freed_on = key;
    return;
  }
  off_books(it, key);
  settle_freed(blk, key);
}

bool device_pool::try_deallocate(device_ptr ptr, stream_handle stream, block_owner owner)
{
  std::unique_lock lock{mutex_, std::try_to_lock};
  if (!lock.owns_lock()) { return false; }
  if (forked_) { return true; }  // as deallocate(): nothing to do
  // A retired block's free may call CUDA; a library's free looks among them first.
  if (owner.has_generation() ? owner.generation() != generation_ : retired_.holds_any()) {
    return false;
  }
  auto& live = index_.live();
  auto it    = live.find(ptr);
  // A bad pointer gets its error from deallocate().
  if (it == live.end() || (owner.has_library() && it->second->tag != owner.library()) ||
      !reuse_rule::free_is_local(*it->second, stream) || it->second->held) {
    return false;
  }
  auto* blk      = it->second;
  auto const key = keys_.of_free(blk->alloc_stream, stream);  // no CUDA: free_is_local
  off_books(it, key);
  settle_freed(blk, key);
  return true;
}

void device_pool::record_stream(device_ptr ptr, stream_handle stream)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  auto& live = index_.live();
  auto it    = live.find(ptr);
  if (it == live.end()) {
    throw pool_error{"emmpool: record_stream of pointer " + std::to_string(ptr) +
                     ", which is not a live allocation of this pool"};
  }
  // One extra stream per block: the most recent, the one a caller most likely still uses.
  it->second->also_fence = keys_.of_recorded(stream);
}

void device_pool::settle_unheld(hold_state const& h)
{
  h.blk->held = false;
  if (!h.freed_on) { return; }
  forget_share(h.blk->ptr);
  stats_.count_free(h.blk->size, h.blk->tag);
  // Fenced as any free on its stream; but a record_stream stream may be gone by now (it was
  // the caller's only until the free): never recorded on, the block waits for a device
  // synchronization, which covers that stream's work and the free's (a stream with no id is
  // never named again: reuse_rule.hpp, stream lifetime).
  auto key = *h.freed_on;
  if (!h.blk->also_fence.is_none() && !h.blk->also_fence.is_context()) {
    key               = stream_ref{h.blk->also_fence.handle, 0};
    h.blk->also_fence = stream_ref::none();
  }
  settle_freed(h.blk, key);
}

void device_pool::release_holds()
{
  // One at a time, each settle's failure ignored (the context is going: reset()), so that
  // none is left held with no hold. A settle whose fence could not be recorded leaves its
  // block pending, fenced by a later call, as any free that failed.
  while (!holds_.empty()) {
    auto const h = holds_.extract(holds_.begin()).mapped();
    try {
      settle_unheld(h);
    } catch (...) {
    }
  }
}

void device_pool::settle_freed(block* blk, stream_ref key)
{
  if (!blk->also_fence.is_none()) {
    if (capture_.capturing()) {  // its fence would be an event recorded now: after the capture
      capture_.hold(blk, key);
      return;
    }
    // record_stream: never merged or joined; fenced on the recorded stream first, unless that
    // is key's (one fence: then it waits in key's batch like any other block freed there).
    lanes_.pend_recorded(blk, key);
    return;
  }
  if (lanes_.joins_open(key)) {  // no stream order (Numba's frees): one record per neighbours
    if (!lanes_.join_open(blk, key)) { lanes_.pend(blk, key); }
  } else if (!lanes_.may_merge(blk, key)) {
    lanes_.pend(blk, key);
  } else {
    if (lanes_.absorbs_free(blk, key)) { absorb_free_neighbours(blk); }
    if (auto* merged = lanes_.merge_neighbours(blk, key)) { lanes_.pend(merged, key); }
  }
}

void device_pool::absorb_free_neighbours(block* blk)
{
  // The merge takes them in (stream_lanes::merge_neighbours): free bytes become pending ones.
  for (auto* n : {blk->prev, blk->next}) {
    if (n != nullptr && n->state == detail::block_state::free) { free_.erase(n); }
  }
}

void device_pool::release_block(block* blk)
{
  auto* seg = blk->seg;
  --seg->live_blocks;
  if (options_.mode == pool_mode::pool) {
    if (seg->growable) {
      growable_.release(blk);
    } else {
      (void)free_.coalesce(blk);
    }
    return;
  }
  free_.insert(blk);  // passthrough: the segment, wholly free, goes back to the driver
  if (capture_.may_give_back()) {
    try {
      release_segment(seg);
    } catch (cuda_error const&) {
      // cuMemFree failed (a sticky error, say): the segment stays, wholly free, for a later
      // trim; the block is never handed out again in passthrough mode.
    }
  }
}

void device_pool::settle_released()
{
  // What an exception leaves unreleased stays in released_ for the next call.
  std::size_t i = 0;
  try {
    for (; i < released_.size(); ++i) { release_block(released_[i]); }
  } catch (...) {
    released_.erase(released_.begin(), released_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    throw;
  }
  released_.clear();
}

void device_pool::maintain(stream_ref alive)
{
  if (!released_.empty()) { settle_released(); }  // what an exception left behind, first
  if (!capture_.may_fence()) { return; }           // polling records and queries events
  try {
    lanes_.poll(alive, released_);
  } catch (...) {
    settle_released();  // what completed before the failure is reusable all the same
    throw;
  }
  if (!released_.empty()) { settle_released(); }
}

void device_pool::drain(std::optional<stream_ref> only)
{
  if (!released_.empty()) { settle_released(); }
  try {
    lanes_.drain(released_, only);
  } catch (...) {
    settle_released();
    throw;
  }
  settle_released();
}

// ---- giving memory back ---------------------------------------------------------------------

std::size_t device_pool::trim()
{
  std::lock_guard lock{mutex_};
  if (forked_ || !capture_.may_fence()) { return 0; }
  drain();
  return release_free_segments(give_back::all);
}

void device_pool::synchronize()
{
  std::lock_guard lock{mutex_};
  if (forked_ || !capture_.may_fence()) { return; }
  drain();
}

void device_pool::release_held_back()
{
  if (options_.mode == pool_mode::passthrough) {
    release_free_segments(give_back::all);  // segments whose release a deferral held back
  }
}

void device_pool::settle_held_for_capture()
{
  while (capture_.holds_any()) {
    auto const [blk, key] = capture_.newest_held();
    settle_freed(blk, key);  // may throw (an event): the rest stay held for the next call
    capture_.pop_held();
  }
}

// ---- statistics ----------------------------------------------------------------------------

pool_stats device_pool::stats() const
{
  std::lock_guard lock{mutex_};
  return stats_locked();
}

pool_stats device_pool::stats_locked() const
{
  auto const& fences   = lanes_.fences();
  pool_stats s         = stats_;
  ledger_.copy_to(s);
  // A growable segment's free blocks are address space: only their mapped pages count, and
  // its spare pages.
  s.bytes_free         = free_.bytes() + growable_.free_bytes();
  s.largest_free_block = std::max(free_.largest(), growable_.largest_free());
  s.bytes_waiting      = fences.waiting_bytes();
  s.blocks_waiting     = fences.waiting_blocks();
  s.batches_closed     = fences.batches_closed();
  s.fence_queries      = fences.fence_queries();
  s.dormant_fences     = fences.dormant_fences();
  s.same_stream_reuses = lanes_.reuses();
  return s;
}

std::string device_pool::describe_locked() const
{
  auto text = emmpool::describe(stats_locked(), device_, cap_.maximum());
  if (cap_.outside() != 0) {
    text += "; " + human_bytes(cap_.outside()) + " of the cap is reserved by another allocator";
  }
  return text;
}

}  // namespace emmpool
