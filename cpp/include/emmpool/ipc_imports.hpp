/**
 * @file ipc_imports.hpp
 * @brief Memory another process shares with this one, mapped here: a legacy CUDA IPC handle
 * (a fixed segment's, cuIpcOpenMemHandle) or the pages of a growable block (one file
 * descriptor per page, imported and mapped into an address range reserved for them).
 *
 * Not a pool: nothing here is allocated or reused. Each open is closed once, after the work
 * issued to the memory here has finished: close() synchronizes the device before it unmaps
 * (the memory names no stream, as PyTorch's imported expandable segments do not). The sender's
 * memory outlives every import (the driver counts the references): a receiver that dies holding
 * one takes nothing from the sender, and its own mappings go with its context.
 *
 * Thread-safe: one mutex, never held across a driver call that waits.
 */
#pragma once

#include <emmpool/driver.hpp>
#include <emmpool/ipc_service.hpp>

#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

namespace emmpool {

class ipc_imports {
 public:
  explicit ipc_imports(driver& drv) : driver_{&drv} {}
  ipc_imports(ipc_imports const&)            = delete;
  ipc_imports& operator=(ipc_imports const&) = delete;

  /// @brief Map the pages another process exported, `page_size` bytes each, one descriptor
  /// per page in address order (the caller's to close afterwards), on `device`: their base.
  /// @throws cuda_error (nothing stays mapped or imported)
  [[nodiscard]] device_ptr open_pages(int device, std::vector<int> const& fds,
                                      std::size_t page_size);
  /// @brief Map the pages of another process's offer (page_offer: their descriptors asked of
  /// its IPC service, closed here once imported) on `device`: their base.
  /// @throws pool_error, cuda_error (nothing stays mapped, imported or open)
  [[nodiscard]] device_ptr open_offer(int device, page_offer const& offer);
  /// @brief Map another process's legacy IPC handle on `device`. @throws cuda_error
  [[nodiscard]] device_ptr open_handle(int device, ipc_bytes const& handle);
  /// @brief Unmap what open_pages()/open_handle() returned, after a device synchronization.
  /// @throws pool_error if `base` is not open, cuda_error
  void close(device_ptr base);
  /// @brief Imports open now.
  [[nodiscard]] std::size_t open_count() const;

 private:
  struct opened {
    int device;
    bool pages;                             // else a legacy handle
    std::size_t page_size;
    std::vector<physical_handle> handles;   // the pages, in address order
    std::size_t opens{1};                   // a legacy handle opened again maps to the same
                                            // base (the driver counts opens): each close one
  };
  void unmap(device_ptr base, opened const& o) noexcept;  // best effort: the import goes
  void check_device(int device) const;  // @throws std::invalid_argument: no such device here

  driver* driver_;
  mutable std::mutex mutex_;
  std::map<device_ptr, opened> open_;
};

}  // namespace emmpool
