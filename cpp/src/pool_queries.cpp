// pool_queries: questions asked of a device_pool's segment index, under the pool's lock.
#include <emmpool/device_pool.hpp>
#include <emmpool/pool_queries.hpp>

#include <mutex>

namespace emmpool {

bool pool_queries::owns(device_ptr ptr) const
{
  std::lock_guard lock{pool_->mutex_};
  return pool_->index_.owns(ptr);
}

std::optional<std::pair<device_ptr, std::size_t>> pool_queries::live_extent(device_ptr ptr) const
{
  std::lock_guard lock{pool_->mutex_};
  return pool_->index_.live_extent(ptr);
}

std::vector<layout_block> pool_queries::layout() const
{
  std::lock_guard lock{pool_->mutex_};
  return pool_->index_.layout();
}

std::string pool_queries::describe() const
{
  std::lock_guard lock{pool_->mutex_};
  return pool_->describe_locked();
}

}  // namespace emmpool
