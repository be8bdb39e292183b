#include <emmpool/error.hpp>
#include <emmpool/registry.hpp>

#include <string>

namespace emmpool {

pool_registry& pool_registry::instance()
{
  static auto* registry = new pool_registry{cuda_driver()};  // never destroyed (see header)
  return *registry;
}

void pool_registry::configure(pool_options options)
{
  std::lock_guard lock{mutex_};
  for (auto const& p : pools_) {
    if (p.load() != nullptr || pinned_[static_cast<std::size_t>(&p - pools_.data())].load()) {
      throw std::logic_error{
        "emmpool: the pool is already in use; configure it before the first allocation"};
    }
  }
  options_ = options;
}

pool_options pool_registry::options() const
{
  std::lock_guard lock{mutex_};
  return options_;
}

device_pool& pool_registry::create(int device)
{
  EMMPOOL_EXPECTS(device >= 0 && device < max_devices, "device ordinal out of range");
  std::lock_guard lock{mutex_};
  auto& slot = pools_[static_cast<std::size_t>(device)];
  if (auto* p = slot.load()) { return *p; }
  int const count = driver_->device_count();
  if (device >= count) {
    throw std::invalid_argument{"emmpool: device " + std::to_string(device) +
                                " does not exist (" + std::to_string(count) + " devices)"};
  }
  auto* p = new device_pool{*driver_, device, options_};  // lives until the process ends
  slot.store(p, std::memory_order_release);
  return *p;
}

void pool_registry::set_tracing(bool on)
{
  std::lock_guard lock{mutex_};
  options_.trace = on;
  for (auto const& p : pools_) {
    if (auto* q = p.load()) { q->set_tracing(on); }
  }
}

host_pool& pool_registry::create_pinned(int device)
{
  EMMPOOL_EXPECTS(device >= 0 && device < max_devices, "device ordinal out of range");
  std::lock_guard lock{mutex_};
  auto& slot = pinned_[static_cast<std::size_t>(device)];
  if (auto* p = slot.load()) { return *p; }
  int const count = driver_->device_count();
  if (device >= count) {
    throw std::invalid_argument{"emmpool: device " + std::to_string(device) +
                                " does not exist (" + std::to_string(count) + " devices)"};
  }
  auto* p = new host_pool{*driver_, device, options_.pinned_limit};  // lives until exit
  slot.store(p, std::memory_order_release);
  return *p;
}

std::vector<host_pool*> pool_registry::pinned_pools() const
{
  std::vector<host_pool*> out;
  for (auto const& p : pinned_) {
    if (auto* q = p.load()) { out.push_back(q); }
  }
  return out;
}

std::vector<device_pool*> pool_registry::pools() const
{
  std::vector<device_pool*> out;
  for (auto const& p : pools_) {
    if (auto* q = p.load()) { out.push_back(q); }
  }
  return out;
}

}  // namespace emmpool
