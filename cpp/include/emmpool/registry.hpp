/**
 * @file registry.hpp
 * @brief The process-wide pools: one per device, shared by Numba, CuPy and PyTorch.
 *
 * Pools are created on first use, with the options configured before that (configure()), and
 * live until the process ends: they are deliberately never destroyed, since finalizers may free
 * into them during interpreter exit, after static destructors would have run.
 */
#pragma once

#include <emmpool/device_pool.hpp>
#include <emmpool/host_pool.hpp>
#include <emmpool/ipc_imports.hpp>
#include <emmpool/ipc_service.hpp>
#include <emmpool/private_pools.hpp>

#include <array>
#include <atomic>
#include <mutex>
#include <vector>

namespace emmpool {

class pool_registry {
 public:
  static constexpr int max_devices = 64;

  /// @brief The registry, over the CUDA driver.
  static pool_registry& instance();

  /// @brief Set the options of pools created from now on: the device pools', and the cap on
  /// the pinned bytes each host pool holds (0: a quarter of physical memory).
  /// @throws std::logic_error if a pool already exists (its options can no longer change)
  void configure(pool_options options, std::size_t pinned_limit = 0);
  [[nodiscard]] pool_options options() const;
  [[nodiscard]] std::size_t pinned_limit() const;

  /// @brief The pool of a device, created on first use. @throws std::invalid_argument
  device_pool& pool(int device)
  {
    if (device >= 0 && device < max_devices) {
      if (auto* p = pools_[static_cast<std::size_t>(device)].load(std::memory_order_acquire)) {
        return *p;
      }
    }
    return create(device);
  }

  /// @brief The pinned-host pool of a device's context, created on first use.
  host_pool& pinned(int device)
  {
    if (device >= 0 && device < max_devices) {
      if (auto* p = pinned_[static_cast<std::size_t>(device)].load(std::memory_order_acquire)) {
        return *p;
      }
    }
    return create_pinned(device);
  }
  [[nodiscard]] std::vector<host_pool*> pinned_pools() const;

  /// @brief Trace every pool, those that exist and those created later.
  void set_tracing(bool on);
  /// @brief Record segment events in every pool, those that exist and those created later.
  void set_segment_events(bool on);

  /// @brief PyTorch's private pools, over these device pools (made on first use).
  private_pools& privates();
  /// @brief Memory other processes share with this one, mapped here (made on first use).
  ipc_imports& imports();
  /// @brief What this process shares with others: pages' descriptors and leases (made on
  /// first use; its thread starts with its first offer).
  ipc_service& service();
  /// @brief The pool of a device if it exists (null otherwise: none is made).
  [[nodiscard]] device_pool* existing_pool(int device) const noexcept
  {
    return device >= 0 && device < max_devices
             ? pools_[static_cast<std::size_t>(device)].load(std::memory_order_acquire)
             : nullptr;
  }

  /// @brief Pools created so far.
  [[nodiscard]] std::vector<device_pool*> pools() const;

  [[nodiscard]] driver& get_driver() const noexcept { return *driver_; }

  /// @brief For tests without a GPU: make every pool from now on use `drv` (a host_driver),
  /// so that the C entry points of CuPy and PyTorch run over it. `drv` must outlive the
  /// process's use of the pools. @throws std::logic_error if a pool already exists
  void use_driver(driver& drv);

 private:
  explicit pool_registry(driver& drv) : driver_{&drv} {}
  device_pool& create(int device);
  host_pool& create_pinned(int device);

  driver* driver_;
  mutable std::mutex mutex_;
  pool_options options_{};
  std::size_t pinned_limit_{};
  std::array<std::atomic<device_pool*>, max_devices> pools_{};
  std::array<std::atomic<host_pool*>, max_devices> pinned_{};
  std::atomic<private_pools*> privates_{};
  std::atomic<ipc_imports*> imports_{};
  std::atomic<ipc_service*> service_{};
};

}  // namespace emmpool
