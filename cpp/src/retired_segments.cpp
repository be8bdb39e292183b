#include <emmpool/detail/retired_segments.hpp>
#include <emmpool/error.hpp>

#include <algorithm>
#include <iterator>

namespace emmpool::detail {

void retired_segments::retire(std::map<device_ptr, std::unique_ptr<segment>>& segments,
                              live_map& live,
                              std::uint64_t generation)
{
  for (auto& [base, seg] : segments) { segments_.push_back(std::move(seg)); }
  segments.clear();
  for (auto& [ptr, blk] : live) { live_.emplace(std::make_pair(generation, ptr), blk); }
  live.clear();
}

bool retired_segments::free(std::uint64_t generation, device_ptr ptr)
{
  auto it = live_.find({generation, ptr});
  if (it == live_.end()) { return false; }
  auto* blk = it->second;
  live_.erase(it);
  free(blk);
  return true;
}

bool retired_segments::free_newest(device_ptr ptr, std::uint8_t tag)
{
  for (auto it = live_.rbegin(); it != live_.rend(); ++it) {
    if (it->first.second == ptr && it->second->tag == tag) {
      auto* blk = it->second;
      live_.erase(std::next(it).base());
      free(blk);
      return true;
    }
  }
  return false;
}

void retired_segments::free(block* blk)
{
  auto* seg = blk->seg;
  if (--seg->live_blocks > 0) { return; }
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
    arena_->recycle(b);
    b = next;
  }
  auto it = std::find_if(segments_.begin(), segments_.end(),
                         [seg](auto const& s) { return s.get() == seg; });
  segments_.erase(it);
}

void retired_segments::release_all() noexcept
{
  for (auto& seg : segments_) {
    try {
      if (!seg->growable && driver_->buffer_id(device_, seg->base) == seg->buffer_id) {
        driver_->deallocate(device_, seg->base);
      }
    } catch (...) {
    }
  }
}

}  // namespace emmpool::detail
