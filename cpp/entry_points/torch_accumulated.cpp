#include "torch_accumulated.hpp"

#include <emmpool/pool_options.hpp>
#include <emmpool/registry.hpp>

#include <array>
#include <atomic>
#include <mutex>

namespace emmpool::torch_accumulated {
namespace {

// A cache line each: the allocations of one device do not slow another's.
struct alignas(64) device_counts {
  std::atomic<std::uint64_t> bytes{0};
  std::atomic<std::uint64_t> requested{0};
  std::mutex mutex;  // the baseline's
  emmpool_torch_accumulated baseline{};
};

std::array<device_counts, pool_registry::max_devices> devices;

bool valid(int device) noexcept { return device >= 0 && device < pool_registry::max_devices; }

std::uint64_t less(std::uint64_t now, std::uint64_t then) noexcept
{
  return now > then ? now - then : 0;
}

}  // namespace

void count(int device, std::size_t requested, std::size_t bytes) noexcept
{
  if (!valid(device)) { return; }
  auto& d = devices[static_cast<std::size_t>(device)];
  d.bytes.fetch_add(bytes, std::memory_order_relaxed);
  d.requested.fetch_add(requested, std::memory_order_relaxed);
}

handed handed_on(int device) noexcept
{
  if (!valid(device)) { return {}; }
  auto const& d = devices[static_cast<std::size_t>(device)];
  return {d.bytes.load(std::memory_order_relaxed), d.requested.load(std::memory_order_relaxed)};
}

emmpool_torch_accumulated since_reset(int device, emmpool_torch_accumulated const& ever)
{
  if (!valid(device)) { return ever; }
  auto& d = devices[static_cast<std::size_t>(device)];
  std::lock_guard<std::mutex> lock{d.mutex};
  auto const& b = d.baseline;
  return {less(ever.allocated_bytes, b.allocated_bytes),
          less(ever.freed_bytes, b.freed_bytes),
          less(ever.requested_bytes, b.requested_bytes),
          less(ever.requested_freed_bytes, b.requested_freed_bytes),
          less(ever.allocations, b.allocations),
          less(ever.frees, b.frees),
          less(ever.segment_allocations, b.segment_allocations),
          less(ever.segment_releases, b.segment_releases),
          less(ever.out_of_memory, b.out_of_memory),
          less(ever.dormant_fences, b.dormant_fences)};
}

void reset(int device, emmpool_torch_accumulated const& ever)
{
  if (!valid(device)) { return; }
  auto& d = devices[static_cast<std::size_t>(device)];
  std::lock_guard<std::mutex> lock{d.mutex};
  d.baseline = ever;
}

}  // namespace emmpool::torch_accumulated
