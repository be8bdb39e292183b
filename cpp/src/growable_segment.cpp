#include <emmpool/detail/growable_segment.hpp>
#include <emmpool/error.hpp>
#include <emmpool/round_up.hpp>

#include <algorithm>

#include <unistd.h>

namespace emmpool {

// The seam's defaults: no virtual memory management (fixed segments only).
std::size_t driver::vmm_page_size(int) { return 0; }

namespace {
[[noreturn]] void unsupported(char const* call)
{
  throw cuda_error{call, 801, "CUDA_ERROR_NOT_SUPPORTED", EMMPOOL_WHERE};
}
}  // namespace

device_ptr driver::reserve_address(int, std::size_t) { unsupported("cuMemAddressReserve"); }
void driver::free_address(int, device_ptr, std::size_t) { unsupported("cuMemAddressFree"); }
physical_handle driver::create_physical(int, std::size_t) { unsupported("cuMemCreate"); }
void driver::release_physical(int, physical_handle) { unsupported("cuMemRelease"); }
void driver::map_physical(int, device_ptr, std::size_t, physical_handle) { unsupported("cuMemMap"); }
void driver::unmap_physical(int, device_ptr, std::size_t) { unsupported("cuMemUnmap"); }
int driver::export_physical(int, physical_handle)
{
  unsupported("cuMemExportToShareableHandle");
}
physical_handle driver::import_physical(int, int) { unsupported("cuMemImportFromShareableHandle"); }

namespace detail {

growable_pages::growable_pages(driver& drv, int device, std::size_t page_size, std::size_t bytes)
  : driver_{&drv}, device_{device}, page_{page_size}, size_{page_size == 0 ? 0 : round_up(bytes, page_size)}
{
  EMMPOOL_EXPECTS(page_size > 0 && size_ > 0, "a growable segment needs pages");
  base_      = driver_->reserve_address(device_, size_);
  solid_end_ = base_;
}

std::size_t growable_pages::unmapped_past_prefix(device_ptr ptr, std::size_t bytes) const noexcept
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

std::pair<device_ptr, std::size_t> growable_pages::fewest_unmapped(
  device_ptr ptr, std::size_t bytes, std::size_t want) const noexcept
{
  std::pair<device_ptr, std::size_t> best{ptr, unmapped_in(ptr, want)};
  std::size_t const hi = ptr - base_ + bytes;
  std::size_t const k  = multiples_covering(want, page_);  // pages under a range at a page start
  std::size_t q        = (ptr - base_) / page_ + 1;   // the first page start past ptr
  // Past the highest page ever mapped nothing is: no later start lacks fewer. One count per
  // page, sliding (a page enters the window, one leaves it).
  if (best.second == 0 || q * page_ + want > hi || q >= mapped_.size()) { return best; }
  std::size_t lacking = 0;
  for (std::size_t p = q; p < q + k; ++p) { lacking += mapped(p) ? 0 : 1; }
  for (;;) {
    if (lacking * page_ < best.second) { best = {base_ + q * page_, lacking * page_}; }
    if (best.second == 0 || (q + 1) * page_ + want > hi || q + 1 >= mapped_.size()) { break; }
    if (!mapped(q + k)) { ++lacking; }
    if (!mapped(q)) { --lacking; }  // counted when it entered
    ++q;
  }
  return best;
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

std::size_t growable_pages::longest_mapped_run(device_ptr ptr, std::size_t bytes) const noexcept
{
  if (bytes == 0) { return 0; }
  std::size_t const lo    = ptr - base_;
  std::size_t const hi    = lo + bytes;
  std::size_t const first = lo / page_;
  std::size_t const last  = std::min((hi - 1) / page_ + 1, mapped_.size());  // exclusive
  std::size_t best = 0, run_start = 0;
  bool in_run = false;
  for (std::size_t p = first; p < last; ++p) {
    if (!mapped_[p]) {
      in_run = false;
      continue;
    }
    if (!in_run) { run_start = std::max(lo, p * page_); }
    in_run = true;
    best   = std::max(best, std::min(hi, (p + 1) * page_) - run_start);
  }
  return best;
}

physical_handle growable_pages::take_page()
{
  if (!spare_.empty()) {
    auto const h = spare_.back();
    spare_.pop_back();
    return h;
  }
  auto const h = driver_->create_physical(device_, page_);
  ++creates_;
  return h;
}

void growable_pages::map(device_ptr ptr, std::size_t bytes, on_failure failure)
{
  std::size_t const first = (ptr - base_) / page_;
  std::size_t const last  = (ptr - base_ + bytes - 1) / page_;
  EMMPOOL_EXPECTS(ptr >= base_ && last < size_ / page_, "range outside the growable segment");
  if (mapped_.size() <= last) {
    mapped_.resize(last + 1, false);
    handles_.resize(last + 1, 0);
  }
  bool const undo = failure == on_failure::undo;
  std::vector<std::pair<std::size_t, bool>> done;  // (page, made by this call), for undo
  try {
    for (std::size_t p = first; p <= last; ++p) {
      if (mapped_[p]) { continue; }
      bool const made = spare_.empty();
      auto const h    = take_page();
      try {
        driver_->map_physical(device_, base_ + p * page_, page_, h);
      } catch (...) {
        spare_.push_back(h);  // held still: a later call maps or releases it
        if (undo && made) {  // or now: it was not held before
          try {
            (void)release_spares(page_);
          } catch (...) {
            // Stays spare, counted.
          }
        }
        throw;
      }
      handles_[p] = h;
      mapped_[p]  = true;
      ++mapped_pages_;
      ++maps_;
      if (undo) { done.emplace_back(p, made); }
    }
  } catch (...) {
    if (undo) { undo_map(done); }
    throw;
  }
  auto solid = static_cast<std::size_t>(solid_end_ - base_) / page_;
  while (solid < mapped_.size() && mapped_[solid]) { ++solid; }
  solid_end_ = base_ + solid * page_;
}

void growable_pages::undo_map(std::vector<std::pair<std::size_t, bool>> const& mapped) noexcept
{
  for (auto it = mapped.rbegin(); it != mapped.rend(); ++it) {
    try {
      // made here: released; spare before: spare again
      unmap_page(it->first, it->second ? unmapped_pages::release : unmapped_pages::keep_spare);
    } catch (...) {
      // cuMemUnmap or cuMemRelease failed (a sticky error, say): the page stays mapped, or
      // spare, and counted, for a later trim.
    }
  }
}

void growable_pages::unmap_page(std::size_t p, unmapped_pages what)
{
  driver_->unmap_physical(device_, base_ + p * page_, page_);
  auto const h = handles_[p];
  mapped_[p]   = false;
  handles_[p]  = 0;
  solid_end_   = std::min(solid_end_, base_ + p * page_);
  --mapped_pages_;
  ++unmaps_;
  spare_.push_back(h);
  if (what == unmapped_pages::release) { (void)release_spares(page_); }
}

void growable_pages::release_page(physical_handle h)
{
  driver_->release_physical(device_, h);  // throws: the caller keeps the page
  if (auto it = fds_.find(h); it != fds_.end()) {
    // Another process that imported the page holds its own reference: closing ours takes
    // nothing from it.
    ::close(it->second);
    fds_.erase(it);
  }
  ++releases_;
}

std::size_t growable_pages::release_spares(std::size_t limit)
{
  std::size_t n = 0;
  while (!spare_.empty() && n + page_ <= limit) {
    release_page(spare_.back());  // throws: the page stays spare
    spare_.pop_back();
    n += page_;
  }
  return n;
}

std::size_t growable_pages::unmap_inside(device_ptr ptr, std::size_t bytes, std::size_t limit,
                                         unmapped_pages what)
{
  std::size_t const lo    = ptr - base_;
  std::size_t const first = multiples_covering(lo, page_);                 // first whole page
  std::size_t const end   = std::min((lo + bytes) / page_, mapped_.size());  // exclusive
  std::size_t n = 0;
  for (std::size_t p = end; p > first && n + page_ <= limit; --p) {  // from the top down
    if (!mapped_[p - 1]) { continue; }
    unmap_page(p - 1, what);
    n += page_;
  }
  return n;
}

int growable_pages::export_page(device_ptr ptr)
{
  std::size_t const p = ptr >= base_ ? (ptr - base_) / page_ : mapped_.size();
  if (!mapped(p)) { throw pool_error{"emmpool: no mapped page at that address to share"}; }
  auto const h = handles_[p];
  if (auto it = fds_.find(h); it != fds_.end()) { return it->second; }
  int const fd = driver_->export_physical(device_, h);
  try {
    fds_.emplace(h, fd);
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

int growable_pages::exported_at(device_ptr ptr) const noexcept
{
  if (ptr < base_ || (ptr - base_) % page_ != 0) { return -1; }
  std::size_t const p = (ptr - base_) / page_;
  if (!mapped(p)) { return -1; }
  auto const it = fds_.find(handles_[p]);
  return it != fds_.end() ? it->second : -1;
}

void growable_pages::release()
{
  (void)unmap_inside(base_, size_, size_, unmapped_pages::release);
  (void)release_spares(~std::size_t{0});
  driver_->free_address(device_, base_, size_);
  mapped_.clear();
  handles_.clear();
  solid_end_ = base_;
}

}  // namespace detail
}  // namespace emmpool
