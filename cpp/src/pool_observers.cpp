// pool_observers: a device_pool's trace and segment events, under the pool's lock.
#include <emmpool/device_pool.hpp>
#include <emmpool/pool_observers.hpp>

#include <mutex>

namespace emmpool {

void pool_observers::set_tracing(bool on)
{
  std::lock_guard lock{pool_->mutex_};
  pool_->trace_.set(on);
}

std::vector<trace_record> pool_observers::take_trace()
{
  std::lock_guard lock{pool_->mutex_};
  return pool_->trace_.take();
}

void pool_observers::set_segment_events(bool on)
{
  std::lock_guard lock{pool_->mutex_};
  pool_->segment_log_.set(on);
}

std::vector<segment_event> pool_observers::take_segment_events(std::size_t max)
{
  std::lock_guard lock{pool_->mutex_};
  return pool_->segment_log_.take(max);
}

}  // namespace emmpool
