#include <emmpool/error.hpp>
#include <emmpool/pool_controls.hpp>
#include <emmpool/private_pools.hpp>
#include <emmpool/round_up.hpp>

#include <algorithm>
#include <string>
#include <unordered_set>

namespace emmpool {

namespace {

std::string name_of(private_pool_id id)
{
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

constexpr std::size_t rounded(std::size_t size) noexcept { return round_up(size, block_alignment); }

}  // namespace

private_pools::private_pools(driver& drv, std::function<device_pool&(int)> pool_of)
  : driver_{&drv}, pool_of_{std::move(pool_of)}
{
}

// ---- a pool's life --------------------------------------------------------------------------

private_pools::pool& private_pools::incref(int device, private_pool_id id)
{
  auto& p     = pools_[id];
  p.device    = device;
  p.use_count += 1;
  p.released  = false;
  return p;
}

private_pools::pool& private_pools::known(private_pool_id id)
{
  auto it = pools_.find(id);
  if (it == pools_.end()) { throw pool_error{"emmpool: no private pool " + name_of(id)}; }
  return it->second;
}

void private_pools::create_or_incref(int device, private_pool_id id)
{
  std::lock_guard lock{mutex_};
  (void)incref(device, id);
}

int private_pools::use_count(private_pool_id id) const
{
  std::lock_guard lock{mutex_};
  auto it = pools_.find(id);
  return it == pools_.end() ? 0 : it->second.use_count;
}

void private_pools::set_use_on_oom(private_pool_id id, bool on)
{
  std::lock_guard lock{mutex_};
  known(id).use_on_oom = on;
}

void private_pools::set_no_split(private_pool_id id)
{
  std::lock_guard lock{mutex_};
  (void)known(id);
}

void private_pools::release(private_pool_id id)
{
  std::vector<private_block> back;
  {
    std::lock_guard lock{mutex_};
    auto it = pools_.find(id);
    if (it == pools_.end() || it->second.use_count == 0) { return; }
    if (--it->second.use_count > 0) { return; }
    it->second.released = true;
    collect_free(it, back);
  }
  give_back(std::move(back));
}

void private_pools::empty_cache(private_pool_id id)
{
  std::vector<private_block> back;
  {
    std::lock_guard lock{mutex_};
    for (auto it = pools_.begin(); it != pools_.end();) {
      auto next = std::next(it);
      if ((id == private_pool_id{} || it->first == id) && it->second.use_count == 0) {
        collect_free(it, back);
      }
      it = next;
    }
  }
  give_back(std::move(back));
}

// ---- allocating to a pool -------------------------------------------------------------------

void private_pools::begin(int device, private_pool_id id)
{
  {
    std::lock_guard lock{mutex_};
    for (auto const& [d, a] : allocating_) {
      if (d == device && a == id) {
        throw pool_error{"emmpool: already allocating to private pool " + name_of(id) +
                         " on device " + std::to_string(device)};
      }
    }
    (void)incref(device, id);
    allocating_.emplace_back(device, id);
    active_.store(static_cast<int>(allocating_.size()), std::memory_order_release);
  }
  // Before the capture begins (PyTorch calls this first): the device pool makes no call a
  // capture forbids until the matching end.
  pool_controls{pool_of_(device)}.capture_begin();
}

void private_pools::end(int device, private_pool_id id)
{
  bool found = false;
  {
    std::lock_guard lock{mutex_};
    auto it = std::find(allocating_.begin(), allocating_.end(), std::make_pair(device, id));
    if (it != allocating_.end()) {
      allocating_.erase(it);
      found = true;
    }
    active_.store(static_cast<int>(allocating_.size()), std::memory_order_release);
  }
  if (found) { pool_controls{pool_of_(device)}.capture_end(); }
}

// ---- blocks ---------------------------------------------------------------------------------

std::optional<private_pools::taken> private_pools::take_free(pool& p, std::size_t size,
                                                             stream_handle stream)
{
  for (auto it = p.free_blocks.lower_bound(size);
       it != p.free_blocks.end() && it->first <= 2 * size; ++it) {
    auto& b = blocks_.at(it->second);
    if (b.stream != stream) { continue; }
    auto const ptr = it->second;
    p.free_blocks.erase(it);
    b.live = true;
    return taken{ptr, b.size};
  }
  return std::nullopt;
}

std::optional<private_pools::taken> private_pools::take(private_pool_id id, std::size_t size,
                                                        stream_handle stream)
{
  std::lock_guard lock{mutex_};
  auto it = pools_.find(id);
  if (it == pools_.end()) { return std::nullopt; }
  return take_free(it->second, rounded(size), stream);
}

std::optional<private_pools::taken> private_pools::take_on_oom(std::size_t size, int device,
                                                               stream_handle stream)
{
  std::lock_guard lock{mutex_};
  for (auto& [id, p] : pools_) {
    if (!p.use_on_oom || p.device != device) { continue; }
    if (auto ptr = take_free(p, rounded(size), stream)) { return ptr; }
  }
  return std::nullopt;
}

void private_pools::adopt(private_pool_id id, device_ptr ptr, std::size_t size, int device,
                          stream_handle stream, bool foreign)
{
  // A null block (another allocator's that had no memory) or one already held would corrupt
  // the pool's count and, once freed, hand the same memory out twice.
  EMMPOOL_EXPECTS(ptr != 0, "a private pool adopts no null block");
  std::lock_guard lock{mutex_};
  EMMPOOL_EXPECTS(blocks_.find(ptr) == blocks_.end(),
                  "a private pool adopts a block it holds already");
  auto [it, made] = pools_.try_emplace(id);
  if (made) { it->second.device = device; }
  blocks_[ptr] = block{id, rounded(size), device, stream, true, false, foreign};
  it->second.blocks += 1;
  held_.fetch_add(1, std::memory_order_release);
}

void private_pools::record_stream(device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  if (auto it = blocks_.find(ptr); it != blocks_.end()) { it->second.shared = true; }
}

void private_pools::free(device_ptr ptr)
{
  std::vector<private_block> back;
  {
    std::lock_guard lock{mutex_};
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) { return; }
    auto p          = pools_.find(it->second.pool);
    it->second.live = false;
    if (p != pools_.end() && !p->second.released) {
      if (!it->second.shared) { p->second.free_blocks.emplace(it->second.size, ptr); }
      return;
    }
    // A block of a released pool: its last users may be a replay of the destroyed graph.
    back.push_back(unlink(it, p));
  }
  give_back(std::move(back));
}

bool private_pools::owns(device_ptr ptr) const
{
  if (held_.load(std::memory_order_acquire) == 0) { return false; }
  std::lock_guard lock{mutex_};
  return blocks_.count(ptr) != 0;
}

std::optional<int> private_pools::device_of(device_ptr ptr) const
{
  std::lock_guard lock{mutex_};
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) { return std::nullopt; }
  return it->second.device;
}

std::vector<private_block> private_pools::take_returned_foreign(std::size_t max)
{
  std::lock_guard lock{mutex_};
  if (max >= foreign_.size()) { return std::exchange(foreign_, {}); }
  auto const end = foreign_.begin() + static_cast<std::ptrdiff_t>(max);
  std::vector<private_block> out(foreign_.begin(), end);
  foreign_.erase(foreign_.begin(), end);
  return out;
}

private_block private_pools::view(device_ptr ptr, block const& b)
{
  return private_block{ptr, b.size, b.device, b.stream, b.pool, b.live, b.foreign};
}

private_block private_pools::unlink(block_map::iterator it, pool_map::iterator p)
{
  auto const out = view(it->first, it->second);
  blocks_.erase(it);
  if (p != pools_.end() && --p->second.blocks == 0 && p->second.released) { pools_.erase(p); }
  return out;
}

void private_pools::collect_free(pool_map::iterator p, std::vector<private_block>& out)
{
  auto const id = p->first;
  p->second.free_blocks.clear();
  for (auto b = blocks_.begin(); b != blocks_.end();) {
    if (b->second.pool == id && !b->second.live) {
      out.push_back(view(b->first, b->second));
      b = blocks_.erase(b);
      --p->second.blocks;
    } else {
      ++b;
    }
  }
  if (p->second.blocks == 0 && p->second.released) { pools_.erase(p); }
}

void private_pools::give_back(std::vector<private_block> blocks)
{
  {
    std::lock_guard lock{mutex_};
    held_.fetch_sub(static_cast<int>(blocks.size()), std::memory_order_release);
    if (active() || (blocks.empty() && deferred_.empty())) {
      deferred_.insert(deferred_.end(), blocks.begin(), blocks.end());
      return;
    }
    blocks.insert(blocks.end(), deferred_.begin(), deferred_.end());
    deferred_.clear();
  }
  std::vector<int> synced;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    auto const& b = blocks[i];
    if (std::find(synced.begin(), synced.end(), b.device) == synced.end()) {
      synced.push_back(b.device);
      try {
        driver_->synchronize_device(b.device);
      } catch (...) {
        // Called from destructors (a graph's reset, a tensor's deleter): never throw. A
        // capture that began since the check above refuses the synchronization: a replay may
        // still use these blocks, so they wait for the next give_back. Otherwise a failed
        // synchronization means a dead context, whose work is gone too.
        std::lock_guard lock{mutex_};
        if (active()) {
          deferred_.insert(deferred_.end(), blocks.begin() + static_cast<std::ptrdiff_t>(i),
                           blocks.end());
          return;
        }
      }
    }
    if (b.foreign) {
      std::lock_guard lock{mutex_};
      foreign_.push_back(b);
      continue;
    }
    try {
      pool_of_(b.device).deallocate(b.ptr, allocation_stream,
                                    block_owner::of_library(alloc_tag::torch));
    } catch (...) {
    }
  }
}

// ---- checkpoints ----------------------------------------------------------------------------

bool private_pools::live_blocks_are(private_pool_id id, std::vector<device_ptr> expected) const
{
  std::unordered_set<device_ptr> const want(expected.begin(), expected.end());
  std::lock_guard lock{mutex_};
  std::size_t live = 0;
  for (auto const& [ptr, b] : blocks_) {
    if (b.pool == id && b.live) {
      if (want.count(ptr) == 0) { return false; }
      ++live;
    }
  }
  return live == want.size();
}

std::vector<device_ptr> private_pools::live_blocks(private_pool_id id) const
{
  std::vector<device_ptr> out;
  std::lock_guard lock{mutex_};
  for (auto const& [ptr, b] : blocks_) {
    if (b.pool == id && b.live) { out.push_back(ptr); }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void private_pools::restore(private_pool_id id, std::vector<device_ptr> const& live)
{
  std::lock_guard lock{mutex_};
  auto p = pools_.find(id);
  if (p == pools_.end() || p->second.released) {
    throw pool_error{"emmpool: private pool " + name_of(id) + " is no longer alive"};
  }
  for (auto ptr : live) {
    auto it = blocks_.find(ptr);
    if (it == blocks_.end() || it->second.pool != id) {
      throw pool_error{"emmpool: a block of the checkpoint left private pool " + name_of(id)};
    }
  }
  p->second.free_blocks.clear();
  for (auto& [ptr, b] : blocks_) {
    if (b.pool == id) { b.live = false; }
  }
  for (auto ptr : live) { blocks_.at(ptr).live = true; }
  for (auto& [ptr, b] : blocks_) {
    if (b.pool == id && !b.live && !b.shared) { p->second.free_blocks.emplace(b.size, ptr); }
  }
}

// ---- statistics and snapshots ---------------------------------------------------------------

private_pools::device_totals private_pools::totals(int device) const
{
  device_totals t;
  if (held_.load(std::memory_order_acquire) == 0) { return t; }
  std::lock_guard lock{mutex_};
  for (auto const& [ptr, b] : blocks_) {
    if (b.device != device) { continue; }
    if (b.foreign) {
      t.foreign_bytes += b.size;
      if (b.live) {
        t.foreign_live_bytes += b.size;
        t.foreign_live_blocks += 1;
      }
    } else if (!b.live) {
      t.cached_bytes += b.size;
      t.cached_blocks += 1;
    }
  }
  return t;
}

std::vector<private_block> private_pools::blocks_of(int device) const
{
  std::vector<private_block> out;
  std::lock_guard lock{mutex_};
  for (auto const& [ptr, b] : blocks_) {
    if (b.device == device) { out.push_back(view(ptr, b)); }
  }
  return out;
}

}  // namespace emmpool
