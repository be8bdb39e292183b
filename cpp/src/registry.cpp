#include <emmpool/pool_observers.hpp>
#include <emmpool/error.hpp>
#include <emmpool/registry.hpp>

#include <string>

namespace emmpool {

namespace {

// The pool in `slots[device]`, made by `make()` under the registry's lock on first use. Pools
// live until the process ends (see registry.hpp).
template <class Pool, class Slots, class Make>
Pool& get_or_create(std::mutex& mutex, Slots& slots, driver& drv, int device, Make make)
{
  EMMPOOL_EXPECTS(device >= 0 && static_cast<std::size_t>(device) < slots.size(),
                  "device ordinal out of range");
  std::lock_guard lock{mutex};
  auto& slot = slots[static_cast<std::size_t>(device)];
  if (auto* p = slot.load()) { return *p; }
  int const count = drv.device_count();
  if (device >= count) {
    throw std::invalid_argument{"emmpool: device " + std::to_string(device) +
                                " does not exist (" + std::to_string(count) + " devices)"};
  }
  Pool* p = make();
  slot.store(p, std::memory_order_release);
  return *p;
}

template <class Pool, class Slots>
std::vector<Pool*> existing(Slots const& slots)
{
  std::vector<Pool*> out;
  for (auto const& p : slots) {
    if (auto* q = p.load()) { out.push_back(q); }
  }
  return out;
}

}  // namespace

pool_registry& pool_registry::instance()
{
  static auto* registry = new pool_registry{cuda_driver()};  // never destroyed (see header)
  return *registry;
}

void pool_registry::configure(pool_options options, std::size_t pinned_limit)
{
  options.check();  // refused now, not at the first pool
  std::lock_guard lock{mutex_};
  if (!existing<device_pool>(pools_).empty() || !existing<host_pool>(pinned_).empty()) {
    throw std::logic_error{
      "emmpool: the pool is already in use; configure it before the first allocation"};
  }
  options_      = options;
  pinned_limit_ = pinned_limit;
}

void pool_registry::use_driver(driver& drv)
{
  std::lock_guard lock{mutex_};
  if (!existing<device_pool>(pools_).empty() || !existing<host_pool>(pinned_).empty()) {
    throw std::logic_error{"emmpool: pools exist already; choose the driver before the first"};
  }
  driver_ = &drv;
}

pool_options pool_registry::options() const
{
  std::lock_guard lock{mutex_};
  return options_;
}

std::size_t pool_registry::pinned_limit() const
{
  std::lock_guard lock{mutex_};
  return pinned_limit_;
}


device_pool& pool_registry::create(int device)
{
  return get_or_create<device_pool>(mutex_, pools_, *driver_, device, [&] {
    return new device_pool{*driver_, device, options_};
  });
}

host_pool& pool_registry::create_pinned(int device)
{
  return get_or_create<host_pool>(mutex_, pinned_, *driver_, device, [&] {
    return new host_pool{*driver_, device, pinned_limit_};
  });
}

void pool_registry::set_tracing(bool on)
{
  std::lock_guard lock{mutex_};
  options_.trace = on;
  for (auto const& p : pools_) {
    if (auto* q = p.load()) { pool_observers{*q}.set_tracing(on); }
  }
}

void pool_registry::set_segment_events(bool on)
{
  std::lock_guard lock{mutex_};
  options_.segment_events = on;
  for (auto const& p : pools_) {
    if (auto* q = p.load()) { pool_observers{*q}.set_segment_events(on); }
  }
}

private_pools& pool_registry::privates()
{
  if (auto* p = privates_.load(std::memory_order_acquire)) { return *p; }
  std::lock_guard lock{mutex_};
  if (auto* p = privates_.load(std::memory_order_acquire)) { return *p; }
  // Never destroyed, as the pools (see the header).
  auto* made =
    new private_pools{*driver_, [this](int device) -> device_pool& { return pool(device); }};
  privates_.store(made, std::memory_order_release);
  return *made;
}

ipc_imports& pool_registry::imports()
{
  if (auto* p = imports_.load(std::memory_order_acquire)) { return *p; }
  std::lock_guard lock{mutex_};
  if (auto* p = imports_.load(std::memory_order_acquire)) { return *p; }
  auto* made = new ipc_imports{*driver_};  // never destroyed, as the pools
  imports_.store(made, std::memory_order_release);
  return *made;
}

ipc_service& pool_registry::service()
{
  if (auto* p = service_.load(std::memory_order_acquire)) { return *p; }
  std::lock_guard lock{mutex_};
  if (auto* p = service_.load(std::memory_order_acquire)) { return *p; }
  // Never destroyed, as the pools: its thread may serve until the process ends.
  auto* made = new ipc_service{[this](int device) { return existing_pool(device); }};
  service_.store(made, std::memory_order_release);
  return *made;
}

std::vector<host_pool*> pool_registry::pinned_pools() const
{
  return existing<host_pool>(pinned_);
}

std::vector<device_pool*> pool_registry::pools() const { return existing<device_pool>(pools_); }

}  // namespace emmpool
