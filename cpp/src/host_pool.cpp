#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/error.hpp>
#include <emmpool/host_pool.hpp>
#include <emmpool/round_up.hpp>

#include <unistd.h>

#include <algorithm>
#include <string>

namespace emmpool {

namespace {

constexpr std::size_t page = 4096;

std::size_t default_limit() noexcept
{
  long const pages = ::sysconf(_SC_PHYS_PAGES);
  long const size  = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || size <= 0) { return std::size_t{4} << 30; }
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(size) / 4;
}

}  // namespace

host_pool::host_pool(driver& drv, int device, std::size_t limit)
  : driver_{&drv}, device_{device}
{
  EMMPOOL_EXPECTS(device >= 0, "device must be a non-negative ordinal");
  stats_.limit = limit != 0 ? limit : default_limit();
}

host_pool::~host_pool()
{
  std::lock_guard lock{mutex_};
  if (!may_call_driver_at_teardown()) {
    fences_.drop_events();
    return;
  }
  // Cached blocks go back; live and waiting ones belong to callers still: left alone.
  for (auto& [key, blocks] : cached_) {
    for (auto* b : blocks) {
      try {
        driver_->host_deallocate(device_, reinterpret_cast<void*>(b->ptr));
      } catch (...) {
      }
    }
  }
  (void)fences_.abandon();
}

std::size_t host_pool::size_class(std::size_t bytes) noexcept
{
  if (bytes <= page) { return page; }
  std::size_t p = page;
  while (p * 2 <= bytes && p * 2 > p) { p *= 2; }  // largest power of two <= bytes
  std::size_t const step = p / 4;
  return round_up(bytes, step);
}

host_pool::block* host_pool::take_cached(std::size_t cls, unsigned flags)
{
  auto it = cached_.find({flags, cls});
  if (it == cached_.end() || it->second.empty()) { return nullptr; }
  auto* b = it->second.back();  // the most recently returned: likeliest still in cache
  it->second.pop_back();
  stats_.bytes_cached -= b->size;
  return b;
}

void host_pool::free_to_driver(block* b)
{
  driver_->host_deallocate(device_, reinterpret_cast<void*>(b->ptr));
  stats_.bytes_held -= b->size;
  ++stats_.driver_frees;
  blocks_.recycle(b);
}

void host_pool::release_cached(std::size_t needed)
{
  // Largest blocks first: fewest driver calls to make room.
  for (auto it = cached_.rbegin(); it != cached_.rend(); ++it) {
    auto& blocks = it->second;
    while (!blocks.empty() && stats_.bytes_held + needed > stats_.limit) {
      auto* b = blocks.back();
      blocks.pop_back();
      stats_.bytes_cached -= b->size;
      free_to_driver(b);
    }
  }
}

void host_pool::on_fenced(block* b)
{
  b->state = detail::block_state::free;
  cached_[{b->tag, b->size}].push_back(b);
  stats_.bytes_cached += b->size;
}

void host_pool::settle_fenced()
{
  // A block requeued for its second fence waits in its batch: only released ones move.
  for (auto const& f : fenced_) {
    if (!f.requeued) { on_fenced(f.blk); }
  }
  fenced_.clear();
}

void host_pool::maintain()
{
  fences_.poll({}, fenced_);
  settle_fenced();
}

void* host_pool::allocate(std::size_t bytes, unsigned flags, std::uint64_t* generation_out)
{
  EMMPOOL_EXPECTS(bytes <= (std::size_t{1} << 46), "pinned allocation size is too large");
  EMMPOOL_EXPECTS(flags <= (host_portable | host_mapped | host_writecombined),
                  "unknown pinned-memory flags");
  std::size_t const cls = size_class(bytes);
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  if (generation_out != nullptr) { *generation_out = generation_; }

  block* b = take_cached(cls, flags);
  if (b == nullptr && fences_.has_waiting()) {
    maintain();
    b = take_cached(cls, flags);
  }
  if (b != nullptr) {
    ++stats_.cache_hits;
  } else {
    // Room under the limit: cached blocks of other classes go first, then pending frees are
    // waited for and their blocks go too.
    if (stats_.bytes_held + cls > stats_.limit && !deferrals_.active()) {
      release_cached(cls);
      if (stats_.bytes_held + cls > stats_.limit) {
        fences_.drain(fenced_);
        settle_fenced();
        if ((b = take_cached(cls, flags)) == nullptr) { release_cached(cls); }
      }
    }
    if (b == nullptr) {
      if (stats_.bytes_held + cls > stats_.limit) {
        throw out_of_memory{"emmpool: pinned memory limit reached: " +
                            std::to_string(stats_.bytes_held) + " bytes held of a limit of " +
                            std::to_string(stats_.limit) + " (EMMPOOL_PINNED_LIMIT)"};
      }
      void* p = nullptr;
      try {
        p = driver_->host_allocate(device_, cls, flags);
      } catch (out_of_memory const&) {
        if (deferrals_.active()) { throw; }
        fences_.drain(fenced_);
        settle_fenced();
        release_cached(stats_.limit);  // everything cached goes back
        p = driver_->host_allocate(device_, cls, flags);
      }
      b       = blocks_.make();
      b->ptr  = reinterpret_cast<std::uintptr_t>(p);
      b->size = cls;
      b->tag  = static_cast<std::uint8_t>(flags);
      stats_.bytes_held += cls;
      stats_.peak_bytes_held = std::max(stats_.peak_bytes_held, stats_.bytes_held);
      ++stats_.driver_allocations;
    }
  }
  b->state = detail::block_state::allocated;
  live_.emplace(b->ptr, b);
  stats_.bytes_in_use += b->size;
  ++stats_.allocations;
  return reinterpret_cast<void*>(b->ptr);
}

void host_pool::deallocate(void* ptr, stream_handle stream)
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  free_live_locked(ptr, stream);
}

void host_pool::free_live_locked(void* ptr, stream_handle stream)
{
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == live_.end()) {
    throw pool_error{"emmpool: pinned pointer " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                     " is not a live allocation of this pool (freed twice, or never allocated here)"};
  }
  auto* blk     = it->second;
  auto const key = keys_.of_free(blk->alloc_stream, stream);  // may throw: before any change
  stats_.bytes_in_use -= blk->size;
  live_.erase(it);
  bool const on_key = blk->also_fence.is_none() ? (fences_.push(blk, key), true)
                                                : fences_.push_recorded(blk, key);
  // No allocation here names a stream, so a named stream is never seen alive again: its fence
  // is recorded in the free, while the caller vouches for it ("stream lifetime").
  if (on_key && !key.is_context()) { fences_.close_now(key); }
}

void host_pool::deallocate(void* ptr, stream_handle stream, std::uint64_t generation)
{
  // One lock for the generation check and the free (see device_pool::deallocate).
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  if (generation == generation_) {
    free_live_locked(ptr, stream);
    return;
  }
  auto it = retired_.find({generation, reinterpret_cast<std::uintptr_t>(ptr)});
  if (it == retired_.end()) {
    throw pool_error{"emmpool: pinned pointer from before a reset is not live (freed twice?)"};
  }
  // Its pages went with the old context (or, if the context lived on, stay leaked): never
  // freed here, so a reused address is never touched.
  blocks_.recycle(it->second);
  retired_.erase(it);
}

void host_pool::register_memory(void* ptr, std::size_t bytes, unsigned flags)
{
  EMMPOOL_EXPECTS(ptr != nullptr && bytes > 0, "cannot pin an empty range");
  std::lock_guard lock{mutex_};
  if (forked_) { detail::throw_forked(); }
  driver_->host_register(device_, ptr, bytes, flags);
  registered_[reinterpret_cast<std::uintptr_t>(ptr)] = bytes;
  stats_.bytes_registered += bytes;
}

void host_pool::unregister_memory(void* ptr)
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  auto it = registered_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == registered_.end()) {
    throw pool_error{"emmpool: host memory at " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                     " was not pinned through this pool"};
  }
  driver_->host_unregister(device_, ptr);
  stats_.bytes_registered -= it->second;
  registered_.erase(it);
}

std::size_t host_pool::trim()
{
  std::lock_guard lock{mutex_};
  if (forked_ || deferrals_.active()) { return 0; }
  fences_.drain(fenced_);
  settle_fenced();
  std::size_t const before = stats_.bytes_held;
  auto const limit         = stats_.limit;
  stats_.limit             = 0;  // release_cached frees until nothing cached remains
  release_cached(1);
  stats_.limit = limit;
  cached_.clear();
  return before - stats_.bytes_held;
}

void host_pool::reset()
{
  std::lock_guard lock{mutex_};
  if (forked_) { return; }
  fences_.drain_or_abandon(fenced_);
  settle_fenced();
  for (auto& [key, blocks] : cached_) {
    for (auto* b : blocks) {
      try {
        free_to_driver(b);
      } catch (...) {
        stats_.bytes_held -= b->size;
      }
    }
  }
  cached_.clear();
  stats_.bytes_cached = 0;
  for (auto& [ptr, b] : live_) {
    retired_.emplace(std::make_pair(generation_, ptr), b);
    stats_.bytes_in_use -= b->size;
    stats_.bytes_held -= b->size;
  }
  live_.clear();
  fences_.release_events();
  ++generation_;
}

void host_pool::defer_cleanup_begin()
{
  std::lock_guard lock{mutex_};
  deferrals_.begin();
}

void host_pool::defer_cleanup_end()
{
  std::lock_guard lock{mutex_};
  (void)deferrals_.end();
}

host_pool_stats host_pool::stats() const
{
  std::lock_guard lock{mutex_};
  auto s          = stats_;
  s.bytes_waiting = fences_.waiting_bytes();
  return s;
}

}  // namespace emmpool
