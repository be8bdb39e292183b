#include <emmpool/detail/descriptors.hpp>
#include <emmpool/error.hpp>
#include <emmpool/ipc_imports.hpp>

#include <limits>
#include <string>

namespace emmpool {

void ipc_imports::check_device(int device) const
{
  // Another process named it: an ordinal this process lacks is an error of the handle's.
  auto const count = driver_->device_count();
  if (device < 0 || device >= count) {
    throw std::invalid_argument{"emmpool: device " + std::to_string(device) +
                                " does not exist in this process (" + std::to_string(count) +
                                " devices): pass the sender's device as this process numbers it"};
  }
}

device_ptr ipc_imports::open_pages(int device, std::vector<int> const& fds, std::size_t page_size)
{
  EMMPOOL_EXPECTS(!fds.empty() && page_size > 0, "an import needs pages");
  check_device(device);
  // The page count and size come from another process (PyTorch's header): checked, not trusted.
  EMMPOOL_EXPECTS(fds.size() <= std::numeric_limits<std::size_t>::max() / page_size,
                  "an import's pages pass the address space");
  auto const base = driver_->reserve_address(device, fds.size() * page_size);
  opened o{device, true, page_size, {}};
  std::size_t mapped = 0;
  try {
    for (auto fd : fds) {
      o.handles.push_back(driver_->import_physical(device, fd));
      driver_->map_physical(device, base + mapped * page_size, page_size, o.handles.back());
      ++mapped;
    }
  } catch (...) {
    // As if never opened: what was mapped goes, every handle is released, the range freed.
    try {
      for (std::size_t i = 0; i < mapped; ++i) {
        driver_->unmap_physical(device, base + i * page_size, page_size);
      }
      for (auto h : o.handles) { driver_->release_physical(device, h); }
      driver_->free_address(device, base, fds.size() * page_size);
    } catch (...) {
    }
    throw;
  }
  std::lock_guard lock{mutex_};
  open_.emplace(base, std::move(o));
  return base;
}

device_ptr ipc_imports::open_offer(int device, page_offer const& offer)
{
  check_device(device);  // before any descriptor arrives
  auto const fds = ipc_service::fetch(offer);
  try {
    auto const base = open_pages(device, fds, offer.page_size);
    detail::close_descriptors(fds);  // imported: the driver holds the memory now
    return base;
  } catch (...) {
    detail::close_descriptors(fds);
    throw;
  }
}

device_ptr ipc_imports::open_handle(int device, ipc_bytes const& handle)
{
  check_device(device);
  auto const base = driver_->ipc_open(device, handle);
  std::lock_guard lock{mutex_};
  auto const [it, fresh] = open_.try_emplace(base, opened{device, false, 0, {}});
  if (!fresh) { ++it->second.opens; }
  return base;
}

void ipc_imports::close(device_ptr base)
{
  auto const find = [&] {
    auto it = open_.find(base);
    if (it == open_.end()) {
      throw pool_error{"emmpool: address " + std::to_string(base) +
                       " is not memory imported from another process (closed twice?)"};
    }
    return it;
  };
  int device = 0;
  {
    std::lock_guard lock{mutex_};
    device = find()->second.device;
  }
  // Work issued here may still read or write it, on any stream. If this throws, the import
  // stays open, for a later close.
  driver_->synchronize_device(device);
  opened o;
  {
    std::lock_guard lock{mutex_};
    auto it = find();
    if (it->second.opens > 1) {
      --it->second.opens;
      o = opened{it->second.device, false, 0, {}};  // one of its opens closed
    } else {
      o = std::move(it->second);
      open_.erase(it);
    }
  }
  unmap(base, o);
}

void ipc_imports::unmap(device_ptr base, opened const& o) noexcept
{
  try {
    if (!o.pages) {
      driver_->ipc_close(o.device, base);
      return;
    }
    for (std::size_t i = 0; i < o.handles.size(); ++i) {
      driver_->unmap_physical(o.device, base + i * o.page_size, o.page_size);
      driver_->release_physical(o.device, o.handles[i]);
    }
    driver_->free_address(o.device, base, o.handles.size() * o.page_size);
  } catch (...) {
    // A context already gone took the mappings with it.
  }
}

std::size_t ipc_imports::open_count() const
{
  std::lock_guard lock{mutex_};
  return open_.size();
}

}  // namespace emmpool
