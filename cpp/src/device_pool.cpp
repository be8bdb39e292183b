// device_pool: an allocation's ladder, a free, statistics. Growth and giving memory back:
// pool_growth.cpp; trim, the cap, captures, reset, IPC and the layout: pool_controls.cpp.
#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>

#include <algorithm>
#include <limits>
#include <mutex>
#include <utility>

namespace emmpool {

namespace {

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
    auto* blk = grow(round_up(options_.initial_size, segment_granularity), true,
                     false, alloc_tag::other);
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

device_pool::block* device_pool::take_free(request const& r, bool may_map)
{
  if (r.growable) {
    // A large fixed segment first (initial_pool_size's, or one made where pages could not
    // be): memory held already, which the growable segment would otherwise map beside.
    // Asked first whether there is any, in place: most pools have none, and the call showed
    // in the allocate/free pair.
    if (free_.any_large()) {
      if (auto* blk = free_.take(r.rounded, false, alignment)) { return blk; }
    }
    return take_growable(r.rounded, r.tag, may_map, r.key);
  }
  return free_.take(r.rounded, r.rounded <= options_.small_request, alignment);
}

device_pool::block* device_pool::take_growable(std::size_t rounded, alloc_tag tag, bool may_map,
                                              stream_ref key)
{
  if (auto* blk = growable_.take_mapped(rounded)) { return blk; }  // the usual case
  return claim_and_map(rounded, tag, may_map, key);
}

device_pool::block* device_pool::claim_and_map(std::size_t rounded, alloc_tag tag, bool may_map,
                                              stream_ref key)
{
  // The growable segment's best fit, off its free list; its missing pages moved from free
  // blocks beyond the limit; for what new pages it still needs, wholly free memory goes back
  // to the driver first if they would pass the cap; then its pages are mapped
  // (detail/growable_space.hpp). A new peak alone gives no fixed segment back: those hold
  // small requests, which would make them again at their next one, and each side's cache
  // would evict the other's every step of a program that mixes them. A function of its own,
  // so that take_growable()'s usual case sets up no exception handler.
  auto claim = growable_.claim_best_fit(rounded, tag, may_map);
  if (claim.blk == nullptr) { return nullptr; }
  try {
    auto const fresh = growable_.prepare(claim, capture_.may_give_back());
    if (fresh != 0 && stats_.bytes_reserved + fresh > stats_.peak_bytes_reserved &&
        !key.is_none() && capture_.may_fence() && lanes_.fences().waiting_bytes_of(key) >= fresh) {
      // A new peak while frees of this stream that could cover it wait for the GPU: wait for
      // them first (then none of them waits). Else a program whose frees run ahead of the GPU
      // (PyTorch's, CuPy's) makes again, in pages that stay, the memory in flight: on the
      // mixed programs' traces with frees completing 2 ms late, the peak reserved grew 10-25%
      // over what the same pool reaches when they complete at once. The stream's own frees
      // only: what it asks for next runs after its earlier work anyway, so the wait costs the
      // CPU's lead, never another stream's concurrency (a fixed segment's new peak gives idle
      // segments back with a cuMemFree, which synchronizes the device).
      growable_.give_back(claim);
      claim = {};
      ++stats_.fence_waits;
      drain(key);
      // The request again, from the start, over what completed: no stream named, no second wait.
      return take_growable(rounded, tag, may_map, stream_ref::none());
    }
    if (fresh != 0 && !cap_.fits(stats_.bytes_reserved, fresh)) { release_free_segments(); }
  } catch (...) {
    if (claim.blk != nullptr) { growable_.give_back(claim); }  // a failed cuMemFree or
    throw;                                                     // cuMemUnmap: not lost
  }
  return growable_.finish(claim, capture_.may_give_back());
}

detail::block_kind device_pool::kind_of(std::size_t rounded, bool growable) const noexcept
{
  if (growable) { return detail::block_kind::growable; }
  return rounded <= options_.small_request ? detail::block_kind::small : detail::block_kind::large;
}

// Ladder step 1, and try_allocate(): stream order first: a block this stream freed needs no
// fence for this stream's work (whole if at most 1/8 larger, else cut), unless a free block
// fits tighter; else a free block. A growable request cuts a pending block only at step 2:
// what completed since may fit better, coalesced. Maps no page.
device_pool::block* device_pool::take_cached(request const& r)
{
  if (options_.mode != pool_mode::pool) { return nullptr; }
  auto* blk = lanes_.take(r.key, r.rounded, kind_of(r.rounded, r.growable), free_);
  return blk != nullptr ? blk : take_free(r, false);
}

// Step 2: fence what was freed since the last miss and reuse what has completed, else cut a
// larger block this stream freed (no fence needed), before any growth; a growable request may
// then map pages of a free block.
device_pool::block* device_pool::fence_and_retake(request const& r)
{
  auto const before = free_.insertions();
  maintain(r.key);
  block* blk = nullptr;
  if (r.growable || free_.insertions() != before) { blk = take_free(r, false); }
  if (blk == nullptr) { blk = lanes_.split(r.key, r.rounded, kind_of(r.rounded, r.growable)); }
  if (blk == nullptr && r.growable) { blk = take_free(r, true); }
  return blk;
}

// Step 3: a new segment, or the growable segment's pages.
device_pool::block* device_pool::grow_for(request const& r)
{
  auto* blk = grow(r.rounded, false, r.growable, r.tag);
  return blk != nullptr ? free_.split(blk, r.rounded, alignment) : nullptr;
}

// Step 4: wait for every pending free (not during a capture: a synchronization).
device_pool::block* device_pool::wait_and_retake(request const& r)
{
  if (!lanes_.fences().has_waiting() || !capture_.may_fence()) { return nullptr; }
  ++stats_.fence_waits;
  drain();
  return options_.mode == pool_mode::pool ? take_free(r, true)
                                          : grow(r.rounded, true, false, r.tag);
}

// Step 5: give wholly free segments (and free pages) back (unless cleanup is deferred), then
// grow with an exact-size segment.
device_pool::block* device_pool::give_back_and_grow(request const& r)
{
  bool const pooled = options_.mode == pool_mode::pool;
  if (release_free_segments() == 0 && !pooled) { return nullptr; }
  auto* blk = grow(r.rounded, true, r.growable, r.tag);
  return blk != nullptr ? free_.split(blk, r.rounded, alignment) : nullptr;
}

// Passthrough: completed frees' segments go back first; each allocation a segment of its own.
device_pool::block* device_pool::passthrough_allocate(request const& r)
{
  maintain(r.key);
  return grow(r.rounded, true, false, r.tag);
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
  if (!lock.owns_lock() || forked_) { return std::nullopt; }
  auto const key = keys_.of_allocation(stream);
  if (lanes_.fences().fence_due()) { return std::nullopt; }  // allocate() fences them (CUDA calls)
  request const r{bytes, rounded, key, tag, growable_.serves(rounded)};
  if (auto* blk = take_cached(r)) {
    if (generation_out != nullptr) { *generation_out = generation_; }
    return hand_out(blk, bytes, key, tag);
  }
  missed_ = missed_request{bytes, stream, tag, rounded, key, free_.insertions(),
                           lanes_.fences().version()};
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
                        miss->version == lanes_.fences().version();
  request const r{bytes, rounded, key, tag,
                  options_.mode == pool_mode::pool && growable_.serves(rounded)};

  // The ladder (PyTorch's allocator reads the same way): each step runs only if those before
  // it found nothing.
  block* blk = nullptr;
  if (options_.mode == pool_mode::pool) {
    if (lanes_.fences().fence_due()) { maintain(key); }  // fence waiting frees now, not at a miss
    (void)((!searched && (blk = take_cached(r))) ||  //
           (blk = fence_and_retake(r)) ||            //
           (blk = grow_for(r)) ||                    //
           (blk = wait_and_retake(r)) ||             //
           (blk = give_back_and_grow(r)));
  } else {
    (void)((blk = passthrough_allocate(r)) ||  //
           (blk = wait_and_retake(r)) ||       //
           (blk = give_back_and_grow(r)));
  }
  if (blk == nullptr) { fail(r); }
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
    index_.live().erase(it);
    if (trace_.on()) { trace_.record('f', blk->ptr, blk->size, key.handle, blk->tag); }
    holds_.at(blk->ptr).freed_on = key;
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

device_ptr device_pool::hold(device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  auto* const seg = index_.holding_live(ptr);
  auto* const blk = seg != nullptr ? const_cast<block*>(index_.block_at(*seg, ptr)) : nullptr;
  if (blk == nullptr || blk->state != detail::block_state::allocated ||
      (!blk->held && !index_.owns(blk->ptr))) {
    throw pool_error{"emmpool: address " + std::to_string(ptr) +
                     " is no live allocation of this pool to hold"};
  }
  auto& h = holds_[blk->ptr];
  if (h.freed_on) {  // freed while held: nothing live to hold any more
    throw pool_error{"emmpool: address " + std::to_string(ptr) +
                     " is no live allocation of this pool to hold (freed)"};
  }
  h.blk     = blk;
  blk->held = true;
  ++h.count;
  return blk->ptr;
}

void device_pool::release_hold(device_ptr at)
{
  std::lock_guard lock{mutex_};
  auto it = holds_.find(at);
  if (forked_ || it == holds_.end()) { return; }
  if (--it->second.count != 0) { return; }
  auto const h = it->second;
  holds_.erase(it);
  h.blk->held = false;
  if (!h.freed_on) { return; }
  stats_.count_free(h.blk->size, h.blk->tag);
  // Fenced as any free on its stream; but a record_stream stream may be gone by now (it was
  // the caller's only until the free): never recorded on, the block waits for a device
  // synchronization, which covers that stream's work and the free's (a stream with no id is
  // never named again: reuse_rule.hpp, stream lifetime).
  auto key = *h.freed_on;
  if (!h.blk->also_fence.is_none() && !h.blk->also_fence.is_context()) {
    key                  = stream_ref{h.blk->also_fence.handle, 0};
    h.blk->also_fence    = stream_ref::none();
  }
  settle_freed(h.blk, key);
}

std::size_t device_pool::held_blocks() const
{
  std::lock_guard lock{mutex_};
  return holds_.size();
}

void device_pool::release_holds()
{
  auto holds = std::move(holds_);
  holds_.clear();
  for (auto& [at, h] : holds) {
    h.blk->held = false;
    if (h.freed_on) {
      stats_.count_free(h.blk->size, h.blk->tag);
      if (!h.blk->also_fence.is_none() && !h.blk->also_fence.is_context()) {
        h.blk->also_fence = stream_ref::none();  // the reset's drain waits for the device
      }
      settle_freed(h.blk, *h.freed_on);
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
    (seg->growable ? growable_.free_list() : free_).coalesce(blk);
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

void device_pool::set_segment_events(bool on)
{
  std::lock_guard lock{mutex_};
  segment_log_.set(on);
}

std::vector<segment_event> device_pool::take_segment_events(std::size_t max)
{
  std::lock_guard lock{mutex_};
  return segment_log_.take(max);
}

pool_stats device_pool::stats() const
{
  std::lock_guard lock{mutex_};
  return stats_locked();
}

pool_stats device_pool::stats_locked() const
{
  auto const& fences   = lanes_.fences();
  pool_stats s         = stats_;
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
  auto text = emmpool::describe(stats_locked(), device_, cap_.maximum());
  if (cap_.outside() != 0) {
    text += "; " + human_bytes(cap_.outside()) + " of the cap is reserved by another allocator";
  }
  return text;
}

}  // namespace emmpool
