#include <emmpool/detail/descriptors.hpp>
#include <emmpool/detail/growable_space.hpp>
#include <emmpool/error.hpp>
#include <emmpool/round_up.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <unistd.h>

namespace emmpool::detail {

void growable_space::configure(pool_options const& o) noexcept
{
  std::size_t granularity = 0;
  if (o.segments == segment_kind::growable && o.mode == pool_mode::pool) {
    try {
      granularity = driver_->vmm_page_size(device_);  // 0: unsupported, fixed segments
    } catch (...) {
    }
  }
  policy_ = page_policy{o, granularity};
}

block* growable_space::take_mapped(std::size_t rounded)
{
  if (pages_ == nullptr) { return nullptr; }
  // A slightly larger free block whose pages are mapped beats a best fit that needs new ones
  // (detail/page_policy.hpp, Placement).
  auto const it = free_.find_large(
    rounded, [&](block const* b) { return pages_->unmapped_in(b->ptr, rounded) == 0; },
    page_policy::mapped_candidates);
  return it != free_.none_large() ? free_.take_large(it, rounded, block_alignment) : nullptr;
}

growable_space::claim growable_space::claim_placed(std::size_t rounded, alloc_tag tag,
                                                    mapping m)
{
  if (pages_ == nullptr) { return {}; }
  auto const lacking = [&](block const* b) {
    return pages_->fewest_unmapped(b->ptr, b->size, rounded).second;
  };
  auto const it = free_.cheapest_large(rounded, lacking, page_policy::placement_candidates);
  if (it == free_.none_large()) { return {}; }
  auto* blk = *it;
  // At its start the request may lack pages (where take_mapped() did not look), but mapped
  // ones may lie further in: the segment's unmapped end is one free block with what was freed
  // below it, and a block freed between two live ones coalesces with its neighbours. The
  // request goes where it lacks the fewest pages; placed at the start, those mapped pages would
  // stay free beside new ones, out of reach of the moves (the claimed block is off the list).
  auto const [at, need] = pages_->fewest_unmapped(blk->ptr, blk->size, rounded);
  if (need != 0 && m == mapping::none) { return {}; }
  // Placed past its start: blk keeps the rest, a fresh record the front, which stays free.
  block* front = at != blk->ptr ? arena_->make() : nullptr;  // may throw: nothing changed yet
  (void)free_.erase_large(it);  // off the list: unmapping spares it
  if (front != nullptr) {
    carve_front(blk, static_cast<std::size_t>(at - blk->ptr), front);
    free_.insert(front);
  }
  return {blk, rounded, need, static_cast<std::uint8_t>(tag)};
}

std::size_t growable_space::prepare(claim const& c, unmapping u)
{
  if (c.need == 0) { return 0; }
  if (u == unmapping::allowed) {
    // The pages the claim and its room lack: moved from free blocks beyond the limit first.
    auto const wanted = pages_->unmapped_in(c.blk->ptr, policy_.room(c.blk->size, c.rounded));
    auto const move   = policy_.to_move(free_mapped_bytes(), wanted, pages_->spare_bytes());
    if (move != 0) { (void)unmap_free(move, unmapped_pages::keep_spare); }
  }
  auto const spare = pages_->spare_bytes();
  return c.need > spare ? c.need - spare : 0;
}

block* growable_space::finish(claim const& c, unmapping u)
{
  bool mapped = true;
  try {
    mapped = c.need == 0 || map_for(c, u);
  } catch (...) {
    give_back(c);  // a failed cuMemMap (not out of memory): the block is not lost
    if (u == unmapping::allowed) { release_spares(); }  // nor memory kept
    throw;
  }
  if (!mapped) {
    give_back(c);
    // What prepare() moved for it goes back too: a request that failed holds no more than
    // before it (its own pages were unmapped by map(): growable_pages::on_failure::undo).
    if (u == unmapping::allowed) { release_spares(); }
    return nullptr;
  }
  return free_.split(c.blk, c.rounded, block_alignment);
}

bool growable_space::map_for(claim const& c, unmapping u)
{
  auto const ptr     = c.blk->ptr;
  auto const rounded = c.rounded;
  // prepare() said how many new pages this takes, and the pool gave wholly free memory back
  // first where they would pass the cap: they fit now, or never will. Spare pages are held
  // already: only new ones count against the cap.
  auto const new_pages = [&](std::size_t bytes) {
    auto const need  = pages_->unmapped_in(ptr, bytes);
    auto const spare = pages_->spare_bytes();
    return need > spare ? need - spare : 0;
  };
  if (!fits(new_pages(rounded))) { return false; }
  // Undone if it fails part way, where unmapping is allowed: a request that fails leaves no
  // more mapped than before it.
  auto const failure = u == unmapping::allowed ? growable_pages::on_failure::undo
                                               : growable_pages::on_failure::keep;
  try {
    map_counted(ptr, rounded, ptr, c.tag, failure);
  } catch (out_of_memory const&) {
    return false;  // the ladder goes on: wait for frees, give pages back, try again
  }
  // Room for the next few requests of this size (best effort, within the cap).
  std::size_t const room = policy_.room(c.blk->size, rounded);
  if (room > rounded && fits(new_pages(room))) {
    try {
      map_counted(ptr, room, ptr + rounded, c.tag, growable_pages::on_failure::keep);
    } catch (cuda_error const&) {
    } catch (out_of_memory const&) {
    }
  }
  // What prepare() moved for this map and it did not take: not held past its need (a later
  // map takes it first where it may not go back now).
  if (u == unmapping::allowed) { release_spares(); }
  return true;
}

bool growable_space::ensure_segment(std::size_t rounded, segment_map& segments)
{
  if (!enabled()) { return false; }
  if (pages_ != nullptr) { return true; }
  auto const bytes = policy_.reservation(cap_->for_growth(),
                                         driver_->memory_info_of(device_).total, rounded);
  try {
    pages_ = std::make_unique<growable_pages>(*driver_, device_, policy_.page(), bytes);
  } catch (cuda_error const&) {
    policy_.disable();  // the driver refuses reservations: fixed segments from now on
    return false;
  }
  auto seg      = std::make_unique<segment>();
  seg->base     = pages_->base();
  seg->size     = pages_->size();
  seg->growable = true;
  auto* blk     = arena_->make();
  blk->ptr      = seg->base;
  blk->size     = seg->size;
  blk->seg      = seg.get();
  blk->kind     = seg->kind();
  seg->first    = blk;
  seg_          = seg.get();
  segments.emplace(seg->base, std::move(seg));
  free_.insert(blk);
  ledger_->reservation_made();
  return true;
}

page_totals growable_space::totals() const noexcept
{
  return {pages_->held_bytes(), pages_->maps(), pages_->unmaps(), pages_->creates(),
          pages_->releases()};
}

void growable_space::count(page_totals const& before) { ledger_->pages(before, totals()); }

std::size_t growable_space::unmap_free(std::size_t limit, unmapped_pages what)
{
  if (pages_ == nullptr) { return 0; }
  auto const before = totals();
  auto const page   = policy_.page();
  if (limit >= page) {
    std::size_t const excess = std::min(limit, pages_->mapped_bytes());
    std::size_t done         = 0;
    try {
      // Largest free blocks first: the least likely to be carved whole by the next requests.
      free_.for_each_large([&](block const* b) {
        auto const n = pages_->unmap_inside(b->ptr, b->size, excess - done, what);
        done += n;
        if (n != 0) {  // the block's highest pages go first
          log_->record(segment_event::kind::unmapped, segment_type::growable, 0,
                       page_start(b->ptr + b->size) - n, n);
        }
        return done + page <= excess;
      });
    } catch (cuda_error const&) {
      // cuMemUnmap failed (a sticky error, say): the page stays mapped and counted, for a
      // later trim, as a segment whose cuMemFree failed.
    }
  }
  if (what == unmapped_pages::release) {
    try {
      (void)pages_->release_spares(pages_->spare_bytes());
    } catch (cuda_error const&) {
      // Stays spare and counted, for a later trim.
    }
  }
  count(before);
  return before.held - pages_->held_bytes();
}

void growable_space::release_spares() noexcept
{
  auto const before = totals();
  try {
    (void)pages_->release_spares(pages_->spare_bytes());
  } catch (cuda_error const&) {
    // Stays spare and counted, for a later trim.
  }
  count(before);
}

std::size_t growable_space::drop(segment_map& segments)
{
  if (seg_ == nullptr) { return 0; }
  std::size_t retired = 0;
  if (seg_->live_blocks == 0) {
    // Wholly free: unmap everything, free the reservation, forget the segment.
    auto const before = totals();
    auto const mapped = pages_->mapped_bytes();
    try {
      pages_->release();
    } catch (cuda_error const&) {
      retired_.push_back(std::move(pages_));  // left to the driver
    }
    if (pages_ != nullptr) {
      count(before);
    } else {  // left to the driver: off the books all the same
      auto after = before;  // nothing held, every mapped page unmapped
      after.held = 0;
      after.unmaps += mapped / policy_.page();
      ledger_->pages(before, after);
    }
    log_->record(segment_event::kind::unmapped, segment_type::growable, 0, seg_->base, mapped);
    for (auto* b = seg_->first; b != nullptr;) {
      auto* next = b->next;
      if (b->state == block_state::free) { free_.erase(b); }
      arena_->recycle(b);
      b = next;
    }
    ledger_->reservation_released();
    segments.erase(seg_->base);
  } else {
    // Retired with live blocks (reset): its pages stay mapped until the process ends; its free
    // blocks are never handed out again.
    retired = pages_->held_bytes();
    free_.erase_all_of(*seg_);
    retired_.push_back(std::move(pages_));
  }
  pages_.reset();
  seg_ = nullptr;
  return retired;
}

void growable_space::release_at_teardown() noexcept
{
  if (pages_ == nullptr) { return; }
  try {
    pages_->release();
  } catch (...) {
  }
}

std::size_t growable_space::free_bytes() const
{
  return free_mapped_bytes() + (pages_ != nullptr ? pages_->spare_bytes() : 0);
}

std::size_t growable_space::largest_free() const
{
  std::size_t largest = 0;
  if (pages_ == nullptr) { return 0; }
  free_.for_each_large([&](block const* b) {
    largest = std::max(largest, pages_->longest_mapped_run(b->ptr, b->size));
    return true;
  });
  return largest;
}

std::size_t growable_space::free_mapped_bytes() const
{
  std::size_t mapped = 0;
  if (pages_ == nullptr) { return 0; }
  free_.for_each_large([&](block const* b) {
    mapped += pages_->mapped_overlap(b->ptr, b->size);
    return true;
  });
  return mapped;
}

void growable_space::throw_no_ipc()
{
  throw pool_error{"emmpool: no legacy IPC handle for a block of a growable segment "
                   "(cuIpcGetMemHandle cannot export memory mapped with cuMemMap): share it with "
                   "emmpool.ipc.export(), Numba's get_ipc_handle or PyTorch's "
                   "torch.multiprocessing, or use EMMPOOL_SEGMENTS=fixed"};
}

shared_pages growable_space::share(block const& blk, device_ptr ptr)
{
  auto const first = page_start(blk.ptr);
  auto const end   = blk.ptr + blk.size;
  std::size_t fresh = 0;  // pages exported for the first time: a descriptor each, kept
  auto const page   = policy_.page();
  for (auto p = first; p < end; p += page) { fresh += pages_->exported_at(p) < 0 ? 1 : 0; }
  reserve_descriptors(fresh * driver_->descriptors_per_export(),
                      "sharing a block's pages with another process");
  shared_pages out{first, page, static_cast<std::size_t>(ptr - first),
                   static_cast<std::size_t>(end - ptr), {}, {}};
  // A failure part way leaves the pages exported so far with their descriptors, which the
  // pages keep (and close when they are released): nothing is left to the caller.
  for (auto p = first; p < end; p += page) { out.fds.push_back(pages_->export_page(p)); }
  return out;
}

bool growable_space::describes_shared(block const& blk, device_ptr first_page,
                                      std::size_t page_size, std::vector<int> const& fds) const
{
  auto const page = policy_.page();
  if (pages_ == nullptr || page_size != page || first_page != page_start(blk.ptr) ||
      fds.size() != multiples_covering(blk.ptr + blk.size - first_page, page)) {
    return false;
  }
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0 || pages_->exported_at(first_page + i * page) != fds[i]) { return false; }
  }
  return true;
}

std::optional<std::vector<int>> growable_space::duplicate_shared(
  block const& blk, device_ptr first_page, std::size_t page_size,
  std::vector<int> const& fds) const
{
  if (!describes_shared(blk, first_page, page_size, fds)) { return std::nullopt; }
  std::vector<int> dups;
  dups.reserve(fds.size());
  for (int fd : fds) {
    int const dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
      close_descriptors(dups);
      throw pool_error{"emmpool: cannot duplicate a shared page's descriptor for another "
                       "process: " + std::string{std::strerror(errno)}};
    }
    dups.push_back(dup);
  }
  return dups;
}

device_ptr growable_space::page_start(device_ptr ptr) const noexcept
{
  auto const base = pages_->base();
  auto const page = policy_.page();
  return base + (ptr - base) / page * page;
}

void growable_space::map_counted(device_ptr ptr, std::size_t bytes, device_ptr at,
                                 std::uint8_t tag, growable_pages::on_failure failure)
{
  // Counted from the pages' totals around the call, failure included: a map that fails part
  // way keeps what it mapped and made, or undoes it (growable_pages::map), and the ledger must
  // say which.
  auto const before        = totals();
  auto const mapped_before = pages_->mapped_bytes();
  auto const counted       = [&] {
    count(before);
    if (pages_->mapped_bytes() > mapped_before) {
      log_->record(segment_event::kind::mapped, segment_type::growable, tag, page_start(at),
                   pages_->mapped_bytes() - mapped_before);
    }
  };
  try {
    pages_->map(ptr, bytes, failure);
  } catch (...) {
    counted();
    throw;
  }
  counted();
}

}  // namespace emmpool::detail
