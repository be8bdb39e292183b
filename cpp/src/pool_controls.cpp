// pool_controls: the cap (detail/pool_cap.hpp), deferred cleanup and CUDA graph captures
// (detail/capture_mode.hpp), reset (detail/retired_segments.hpp), over a device_pool's state and
// lock.
#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/pool_controls.hpp>

#include <mutex>

namespace emmpool {

using detail::human_bytes;

// ---- the cap --------------------------------------------------------------------------------

void pool_controls::set_maximum_size(std::size_t bytes)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_) { detail::throw_forked(); }
  std::size_t const cap = bytes != 0 ? bytes : detail::pool_cap::none;
  auto const held_now = [&p] {
    return p.stats_.bytes_in_use + p.lanes_.fences().waiting_bytes() + p.cap_.outside();
  };
  if (held_now() > cap && p.lanes_.fences().has_waiting() && p.capture_.may_fence()) {
    p.drain();  // frees waiting for their fence do not count against the new cap
  }
  std::size_t const held = held_now();
  if (held > cap) {
    throw pool_error{"emmpool: cannot cap device " + std::to_string(p.device_) + "'s pool at " +
                     human_bytes(cap) + ": " + human_bytes(held) +
                     " is in use (allocated, or freed and waiting for its fence" +
                     (p.cap_.outside() != 0 ? ", or reserved by another allocator)" : ")")};
  }
  p.cap_.set_maximum(cap);
  if (p.ledger_.reserved() > p.cap_.for_growth() && p.capture_.may_fence() &&
      p.capture_.may_give_back()) {
    p.drain();
    p.release_free_segments(device_pool::give_back::all);
  }
}

std::size_t pool_controls::maximum_size() const
{
  auto const& p = *pool_;
  std::lock_guard lock{p.mutex_};
  return p.cap_.maximum();
}

bool pool_controls::reserve_outside(std::ptrdiff_t delta)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (delta < 0) {
    p.cap_.remove_outside(static_cast<std::size_t>(-delta));
    return true;
  }
  auto const n = static_cast<std::size_t>(delta);
  if (!p.cap_.fits(p.ledger_.reserved(), n) && !p.forked_ && p.capture_.may_fence() &&
      p.capture_.may_give_back()) {
    p.drain();  // frees waiting for their fence may empty whole segments
    p.release_free_segments(device_pool::give_back::all);
  }
  if (!p.cap_.fits(p.ledger_.reserved(), n)) { return false; }
  p.cap_.add_outside(n);
  return true;
}

std::size_t pool_controls::reserved_outside() const
{
  auto const& p = *pool_;
  std::lock_guard lock{p.mutex_};
  return p.cap_.outside();
}

// ---- when not to give memory back -----------------------------------------------------------

void pool_controls::defer_cleanup_begin()
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  p.capture_.defer_cleanup_begin();
}

void pool_controls::defer_cleanup_end()
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.capture_.defer_cleanup_end()) { p.release_held_back(); }
}

void pool_controls::capture_begin()
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  p.capture_.capture_begin();
}

void pool_controls::capture_end()
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  auto const ended = p.capture_.capture_end(p.device_);
  if (ended.last_capture) { p.settle_held_for_capture(); }
  if (ended.last_deferral) { p.release_held_back(); }
}

bool pool_controls::capturing() const
{
  auto const& p = *pool_;
  std::lock_guard lock{p.mutex_};
  return p.capture_.capturing();
}

// ---- reset: live segments retired -----------------------------------------------------------

void pool_controls::reset()
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_) { return; }
  if (p.capture_.capturing()) {
    throw pool_error{"emmpool: cannot reset device " + std::to_string(p.device_) +
                     "'s pool while a CUDA graph is captured on it (end the capture first)"};
  }
  p.settle_held_for_capture();
  p.release_holds();  // the context goes: what another process imported is its own now
  p.shares_.clear();  // and no handle of before reaches a block of after
  p.lanes_.drain_or_abandon(p.released_);
  p.settle_released();
  // Free what can be, regardless of deferrals (errors ignored: the context is going anyway).
  p.capture_.deferrals().lifted([&p] { p.release_free_segments(device_pool::give_back::all); });
  auto& segments           = p.index_.segments();
  auto const growable_held = p.growable_.drop(segments);  // wholly free: released; else its
                                                          // pages stay mapped, retired

  // What is left holds live blocks: retire it, so that it is never handed out again.
  for (auto& [base, seg] : segments) {
    if (!seg->growable) { p.free_.erase_all_of(*seg); }  // growable: drop() did
    p.ledger_.retired(seg->growable ? growable_held : seg->size);
  }
  for (auto& [ptr, blk] : p.index_.live()) { p.stats_.count_out_of_use(blk->size, blk->tag); }
  p.retired_.retire(segments, p.index_.live(), p.generation_);
  p.lanes_.release_events();
  try {
    p.driver_->release_context(p.device_);
  } catch (...) {
    // Already gone: nothing is held.
  }
  ++p.generation_;
}

void pool_controls::reset_peaks()
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  p.stats_.peak_bytes_in_use = p.stats_.bytes_in_use;
  p.ledger_.reset_peak();
}

}  // namespace emmpool
