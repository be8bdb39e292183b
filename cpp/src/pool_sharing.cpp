// pool_sharing: a device_pool's blocks as another process reaches them (legacy handles, pages,
// holds), under the pool's lock.
#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/pool_sharing.hpp>

#include <mutex>
#include <string>

namespace emmpool {

std::optional<ipc_info> pool_sharing::ipc_handle(device_ptr ptr)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_) { detail::throw_forked(); }
  return p.index_.ipc(ptr, *p.driver_, p.device_);
}

std::optional<shared_pages> pool_sharing::share_pages(device_ptr ptr)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_) { detail::throw_forked(); }
  auto* const seg = p.index_.holding_live(ptr);
  if (seg == nullptr || !p.growable_.holds(seg)) { return std::nullopt; }
  auto const* blk = p.index_.block_at(*seg, ptr);
  if (blk == nullptr || blk->state != detail::block_state::allocated) { return std::nullopt; }
  return p.growable_.share(*blk, ptr);
}

std::optional<std::vector<int>> pool_sharing::duplicate_shared_pages(device_ptr first_page,
                                                                    std::size_t page_size,
                                                                    std::vector<int> const& fds)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};  // the pages' descriptors close only under it
  if (p.forked_) { return std::nullopt; }
  return p.growable_.duplicate_shared(first_page, page_size, fds);
}

device_ptr pool_sharing::hold(device_ptr ptr)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_) { detail::throw_forked(); }
  auto* const seg = p.index_.holding_live(ptr);
  auto* const blk =
    seg != nullptr ? const_cast<detail::block*>(p.index_.block_at(*seg, ptr)) : nullptr;
  if (blk == nullptr || blk->state != detail::block_state::allocated ||
      (!blk->held && !p.index_.owns(blk->ptr))) {
    throw pool_error{"emmpool: address " + std::to_string(ptr) +
                     " is no live allocation of this pool to hold"};
  }
  auto& h = p.holds_[blk->ptr];
  if (h.freed_on) {  // freed while held: nothing live to hold any more
    throw pool_error{"emmpool: address " + std::to_string(ptr) +
                     " is no live allocation of this pool to hold (freed)"};
  }
  h.blk     = blk;
  blk->held = true;
  ++h.count;
  return blk->ptr;
}

void pool_sharing::release_hold(device_ptr at)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  auto it = p.holds_.find(at);
  if (p.forked_ || it == p.holds_.end() || --it->second.count != 0) { return; }
  auto const h = it->second;
  p.holds_.erase(it);
  p.settle_unheld(h);
}

std::size_t pool_sharing::held_blocks() const
{
  auto const& p = *pool_;
  std::lock_guard lock{p.mutex_};
  return p.holds_.size();
}

}  // namespace emmpool
