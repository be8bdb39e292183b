// pool_sharing: a device_pool's blocks as another process reaches them (legacy handles, pages,
// holds), under the pool's lock.
#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/detail/random_key.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/pool_sharing.hpp>

#include <map>
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

namespace {

// The block holding ptr (which may point inside it) if it is live: allocated and its
// caller's still (a block freed during a capture is parked, allocated, until the capture
// ends), or held for another process; else null. Under the pool's lock.
detail::block* live_block(detail::segment_index const& index, device_ptr ptr)
{
  auto* const seg = index.holding_live(ptr);
  auto* const blk =
    seg != nullptr ? const_cast<detail::block*>(detail::segment_index::block_at(*seg, ptr))
                   : nullptr;
  if (blk == nullptr || blk->state != detail::block_state::allocated ||
      (!blk->held && !index.owns(blk->ptr))) {
    return nullptr;
  }
  return blk;
}

// The shared block whose key is `key`, if it is still the one shared and the pages asked for
// are its own, as share_pages() gave them; else null. Under the pool's lock.
detail::block const* offered_block(detail::segment_index const& index,
                                   detail::growable_space const& growable,
                                   std::map<device_ptr, share_key> const& shares,
                                   unsigned char const* key, device_ptr first_page,
                                   std::size_t page_size, std::vector<int> const& fds)
{
  if (page_size == 0) { return nullptr; }
  // The block starts on the first page (share_pages() counts pages from the one holding the
  // block's start): every key there is compared, in constant time.
  device_ptr shared = 0;
  for (auto it = shares.lower_bound(first_page);
       it != shares.end() && it->first - first_page < page_size; ++it) {
    if (detail::same_key(key, it->second)) { shared = it->first; }
  }
  if (shared == 0) { return nullptr; }
  auto const* blk = live_block(index, shared);
  if (blk == nullptr || blk->ptr != shared || !growable.holds(blk->seg) ||
      !growable.describes_shared(*blk, first_page, page_size, fds)) {
    return nullptr;
  }
  return blk;
}

}  // namespace

std::optional<shared_pages> pool_sharing::share_pages(device_ptr ptr)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_) { detail::throw_forked(); }
  auto const* blk = live_block(p.index_, ptr);
  if (blk == nullptr || !p.growable_.holds(blk->seg)) { return std::nullopt; }
  auto out        = p.growable_.share(*blk, ptr);
  auto [it, made] = p.shares_.try_emplace(blk->ptr);
  if (made) {
    try {
      it->second = detail::random_key();
    } catch (...) {
      p.shares_.erase(it);
      throw;
    }
  }
  out.key = it->second;
  return out;
}

bool pool_sharing::offers(unsigned char const* key, device_ptr first_page,
                          std::size_t page_size, std::vector<int> const& fds) const
{
  auto const& p = *pool_;
  std::lock_guard lock{p.mutex_};
  return !p.forked_ && offered_block(p.index_, p.growable_, p.shares_, key, first_page,
                                     page_size, fds) != nullptr;
}

std::optional<std::vector<int>> pool_sharing::duplicate_shared_pages(
  unsigned char const* key, device_ptr first_page, std::size_t page_size,
  std::vector<int> const& fds)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};  // the pages' descriptors close only under it
  if (p.forked_) { return std::nullopt; }
  auto const* blk =
    offered_block(p.index_, p.growable_, p.shares_, key, first_page, page_size, fds);
  if (blk == nullptr) { return std::nullopt; }
  return p.growable_.duplicate_shared(*blk, first_page, page_size, fds);
}

device_ptr pool_sharing::hold(device_ptr ptr, std::uint64_t* generation_out)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_) { detail::throw_forked(); }
  auto* const blk = live_block(p.index_, ptr);
  if (blk == nullptr) {
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
  if (generation_out != nullptr) { *generation_out = p.generation_; }
  return blk->ptr;
}

void pool_sharing::release_hold(device_ptr at, std::optional<std::uint64_t> generation)
{
  auto& p = *pool_;
  std::lock_guard lock{p.mutex_};
  if (p.forked_ || (generation && *generation != p.generation_)) { return; }
  auto it = p.holds_.find(at);
  if (it == p.holds_.end() || --it->second.count != 0) { return; }
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
