#include <emmpool/detail/growable_segment.hpp>
#include <emmpool/error.hpp>

#include <algorithm>

namespace emmpool {

// The seam's defaults: no virtual memory management (fixed segments only).
std::size_t driver::vmm_page_size(int) { return 0; }

device_ptr driver::reserve_address(int, std::size_t)
{
  throw cuda_error{"cuMemAddressReserve", 801, "CUDA_ERROR_NOT_SUPPORTED", EMMPOOL_WHERE};
}

void driver::free_address(int, device_ptr, std::size_t)
{
  throw cuda_error{"cuMemAddressFree", 801, "CUDA_ERROR_NOT_SUPPORTED", EMMPOOL_WHERE};
}

physical_handle driver::map_physical(int, device_ptr, std::size_t)
{
  throw cuda_error{"cuMemMap", 801, "CUDA_ERROR_NOT_SUPPORTED", EMMPOOL_WHERE};
}

void driver::unmap_physical(int, device_ptr, std::size_t, physical_handle)
{
  throw cuda_error{"cuMemUnmap", 801, "CUDA_ERROR_NOT_SUPPORTED", EMMPOOL_WHERE};
}

namespace detail {

growable_pages::growable_pages(driver& drv, int device, std::size_t page_size, std::size_t bytes)
  : driver_{&drv}, device_{device}, page_{page_size}, size_{(bytes + page_size - 1) / page_size * page_size}
{
  EMMPOOL_EXPECTS(page_size > 0 && size_ > 0, "a growable segment needs pages");
  base_ = driver_->reserve_address(device_, size_);
}

std::size_t growable_pages::unmapped_in(device_ptr ptr, std::size_t bytes) const noexcept
{
  std::size_t const first = (ptr - base_) / page_;
  std::size_t const last  = (ptr - base_ + bytes - 1) / page_;
  if (first >= mapped_.size()) { return (last - first + 1) * page_; }
  std::size_t missing = 0;
  for (std::size_t p = first; p <= last; ++p) {
    if (!mapped(p)) { missing += page_; }
  }
  return missing;
}

std::size_t growable_pages::mapped_overlap(device_ptr ptr, std::size_t bytes) const noexcept
{
  if (bytes == 0) { return 0; }
  std::size_t const lo    = ptr - base_;
  std::size_t const hi    = lo + bytes;
  std::size_t const first = lo / page_;
  std::size_t const last  = std::min((hi - 1) / page_ + 1, mapped_.size());  // exclusive
  std::size_t n = 0;
  for (std::size_t p = first; p < last; ++p) {
    if (!mapped_[p]) { continue; }
    std::size_t const a = std::max(lo, p * page_);
    std::size_t const b = std::min(hi, (p + 1) * page_);
    n += b - a;
  }
  return n;
}

std::size_t growable_pages::map(device_ptr ptr, std::size_t bytes)
{
  std::size_t const first = (ptr - base_) / page_;
  std::size_t const last  = (ptr - base_ + bytes - 1) / page_;
  EMMPOOL_EXPECTS(ptr >= base_ && last < size_ / page_, "range outside the growable segment");
  if (mapped_.size() <= last) {
    mapped_.resize(last + 1, false);
    handles_.resize(last + 1, 0);
  }
  std::vector<std::size_t> done;
  try {
    for (std::size_t p = first; p <= last; ++p) {
      if (mapped_[p]) { continue; }
      handles_[p] = driver_->map_physical(device_, base_ + p * page_, page_);
      mapped_[p]  = true;
      ++mapped_pages_;
      ++maps_;
      done.push_back(p);
    }
  } catch (...) {
    for (auto p : done) {
      try {
        unmap_page(p);
      } catch (...) {
        // Stays mapped, and counted: a later trim tries again.
      }
    }
    throw;
  }
  return done.size() * page_;
}

void growable_pages::unmap_page(std::size_t p)
{
  driver_->unmap_physical(device_, base_ + p * page_, page_, handles_[p]);
  mapped_[p]  = false;
  handles_[p] = 0;
  --mapped_pages_;
  ++unmaps_;
}

std::size_t growable_pages::unmap_inside(device_ptr ptr, std::size_t bytes, std::size_t limit)
{
  std::size_t const lo    = ptr - base_;
  std::size_t const first = (lo + page_ - 1) / page_;                      // first whole page
  std::size_t const end   = std::min((lo + bytes) / page_, mapped_.size());  // exclusive
  std::size_t n = 0;
  for (std::size_t p = end; p > first && n + page_ <= limit; --p) {  // from the top down
    if (!mapped_[p - 1]) { continue; }
    unmap_page(p - 1);
    n += page_;
  }
  return n;
}

void growable_pages::release()
{
  (void)unmap_inside(base_, size_, size_);
  driver_->free_address(device_, base_, size_);
  mapped_.clear();
  handles_.clear();
}

}  // namespace detail
}  // namespace emmpool
