// device_pool's tracing and statistics (device_pool.hpp), beside device_pool.cpp so that the
// allocation paths stay in one file within issue #19's line limit.
#include <emmpool/device_pool.hpp>

namespace emmpool {

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

pool_stats device_pool::stats() const
{
  std::lock_guard lock{mutex_};
  return stats_locked();
}

pool_stats device_pool::stats_locked() const
{
  pool_stats s         = stats_;
  // A growable segment's free blocks are address space: only their mapped pages count.
  s.bytes_free         = free_.bytes() + growable_.free_mapped_bytes();
  s.largest_free_block = free_.largest();
  s.bytes_waiting      = policy_.waiting_bytes();
  s.blocks_waiting     = policy_.waiting_blocks();
  s.batches_closed     = policy_.batches_closed();
  s.fence_queries      = policy_.fence_queries();
  s.dormant_fences     = policy_.dormant_fences();
  s.same_stream_reuses = policy_.stream_order_reuses();
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
  return emmpool::describe(stats_locked(), device_, max_reserved_);
}

}  // namespace emmpool
