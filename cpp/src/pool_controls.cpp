// device_pool: what callers ask of the pool beside allocations and frees: trim, deferred
// cleanup and CUDA graph captures (detail/capture_mode.hpp), the cap (detail/pool_cap.hpp),
// reset (detail/retired_segments.hpp), and the questions of detail/segment_index.hpp.
#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>

#include <mutex>

namespace emmpool {

using detail::human_bytes;

// ---- giving memory back, and when not to ----------------------------------------------------

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

void device_pool::defer_cleanup_begin()
{
  std::lock_guard lock{mutex_};
  capture_.defer_cleanup_begin();
}

void device_pool::defer_cleanup_end()
{
  std::lock_guard lock{mutex_};
  if (capture_.defer_cleanup_end()) { release_held_back(); }
}

void device_pool::release_held_back()
{
  if (options_.mode == pool_mode::passthrough) {
    release_free_segments(give_back::all);  // segments whose release a deferral held back
  }
}

void device_pool::capture_begin()
{
  std::lock_guard lock{mutex_};
  capture_.capture_begin();
}

void device_pool::capture_end()
{
  std::lock_guard lock{mutex_};
  auto const ended = capture_.capture_end(device_);
  if (ended.last_capture) { settle_held_for_capture(); }
  if (ended.last_deferral) { release_held_back(); }
}

bool device_pool::capturing() const
{
  std::lock_guard lock{mutex_};
  return capture_.capturing();
}

void device_pool::settle_held_for_capture()
{
  while (capture_.holds_any()) {
    auto const [blk, key] = capture_.newest_held();
    settle_freed(blk, key);  // may throw (an event): the rest stay held for the next call
    capture_.pop_held();
  }
}

// ---- the cap --------------------------------------------------------------------------------

void device_pool::set_maximum_size(std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  std::size_t const cap = bytes != 0 ? bytes : detail::pool_cap::none;
  auto const held_now = [this] {
    return stats_.bytes_in_use + lanes_.fences().waiting_bytes() + cap_.outside();
  };
  if (held_now() > cap && lanes_.fences().has_waiting() && capture_.may_fence()) {
    drain();  // frees waiting for their fence do not count against the new cap
  }
  std::size_t const held = held_now();
  if (held > cap) {
    throw pool_error{"emmpool: cannot cap device " + std::to_string(device_) + "'s pool at " +
                     human_bytes(cap) + ": " + human_bytes(held) +
                     " is in use (allocated, or freed and waiting for its fence" +
                     (cap_.outside() != 0 ? ", or reserved by another allocator)" : ")")};
  }
  cap_.set_maximum(cap);
  if (ledger_.reserved() > cap_.for_growth() && capture_.may_fence() &&
      capture_.may_give_back()) {
    drain();
    release_free_segments(give_back::all);
  }
}

std::size_t device_pool::maximum_size() const
{
  std::lock_guard lock{mutex_};
  return cap_.maximum();
}

bool device_pool::reserve_outside(std::ptrdiff_t delta)
{
  std::lock_guard lock{mutex_};
  if (delta < 0) {
    cap_.remove_outside(static_cast<std::size_t>(-delta));
    return true;
  }
  auto const n = static_cast<std::size_t>(delta);
  if (!cap_.fits(ledger_.reserved(), n) && !forked_ && capture_.may_fence() &&
      capture_.may_give_back()) {
    drain();  // frees waiting for their fence may empty whole segments
    release_free_segments(give_back::all);
  }
  if (!cap_.fits(ledger_.reserved(), n)) { return false; }
  cap_.add_outside(n);
  return true;
}

std::size_t device_pool::reserved_outside() const
{
  std::lock_guard lock{mutex_};
  return cap_.outside();
}

// ---- reset: live segments retired (detail/retired_segments.hpp) -----------------------------

void device_pool::reset()
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  if (capture_.capturing()) {
    throw pool_error{"emmpool: cannot reset device " + std::to_string(device_) +
                     "'s pool while a CUDA graph is captured on it (end the capture first)"};
  }
  settle_held_for_capture();
  release_holds();  // the context goes: what another process imported is its own now
  lanes_.drain_or_abandon(released_);
  settle_released();
  // Free what can be, regardless of deferrals (errors ignored: the context is going anyway).
  capture_.deferrals().lifted([this] { release_free_segments(give_back::all); });
  auto& segments             = index_.segments();
  auto const growable_held   = growable_.drop(segments);  // wholly free: released; else its
                                                          // pages stay mapped, retired

  // What is left holds live blocks: retire it, so that it is never handed out again.
  for (auto& [base, seg] : segments) {
    if (!seg->growable) { free_.erase_all_of(*seg); }  // growable: drop() did
    ledger_.retired(seg->growable ? growable_held : seg->size);
  }
  for (auto& [ptr, blk] : index_.live()) { stats_.count_out_of_use(blk->size, blk->tag); }
  retired_.retire(segments, index_.live(), generation_);
  lanes_.release_events();
  try {
    driver_->release_context(device_);
  } catch (...) {
    // Already gone: nothing is held.
  }
  ++generation_;
}

// ---- what the pool holds (detail/segment_index.hpp) -----------------------------------------

bool device_pool::owns(device_ptr ptr) const
{
  std::lock_guard lock{mutex_};
  return index_.owns(ptr);
}

std::optional<std::pair<device_ptr, std::size_t>> device_pool::live_extent(device_ptr ptr) const
{
  std::lock_guard lock{mutex_};
  return index_.live_extent(ptr);
}

std::optional<ipc_info> device_pool::ipc_handle(device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  return index_.ipc(ptr, *driver_, device_);
}

std::optional<shared_pages> device_pool::share_pages(device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  auto* const seg = index_.holding_live(ptr);
  if (seg == nullptr || !growable_.holds(seg)) { return std::nullopt; }
  auto const* blk = index_.block_at(*seg, ptr);
  if (blk == nullptr || blk->state != detail::block_state::allocated) { return std::nullopt; }
  return growable_.share(*blk, ptr);
}

std::optional<std::vector<int>> device_pool::duplicate_shared_pages(device_ptr first_page,
                                                                   std::size_t page_size,
                                                                   std::vector<int> const& fds)
{
  std::lock_guard lock{mutex_};  // the pages' descriptors close only under it
  if (forked_) { return std::nullopt; }
  return growable_.duplicate_shared(first_page, page_size, fds);
}

std::vector<layout_block> device_pool::layout() const
{
  std::lock_guard lock{mutex_};
  return index_.layout();
}

}  // namespace emmpool
