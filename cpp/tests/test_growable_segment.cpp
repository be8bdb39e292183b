// Tests of growable segments (detail/growable_segment.hpp) over host_driver's model of CUDA's
// virtual memory management: pages mapped on demand, unmapped only when wholly free (never
// under a live or pending block), trim and the out-of-memory ladder, the fallback to fixed
// segments, IPC, reset and failures.
#include "check.hpp"
#include "pool_fixture.hpp"

#include <emmpool/detail/descriptors.hpp>
#include <emmpool/detail/growable_segment.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/host_driver.hpp>
#include <emmpool/ipc_imports.hpp>

#include <cstdio>
#include <exception>
#include <map>
#include <stdexcept>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

using namespace emmpool;
using emmpool::test::gen;
using emmpool::test::lib;

namespace {

constexpr std::size_t MiB  = std::size_t{1} << 20;
constexpr std::size_t page = 2 * MiB;  // host_driver's granularity

pool_options growable_options(std::size_t cap = 0)
{
  pool_options o;
  o.segments     = segment_kind::growable;
  o.maximum_size = cap;
  o.growable_room = 0;  // map exactly the pages a block needs: the tests count them
  o.growable_page_size = 0;  // the driver's 2 MiB: the tests count pages of that size
  return o;
}

/// Growable segments unless a test says otherwise.
struct fixture : test::pool_fixture {
  explicit fixture(pool_options options = growable_options(), bool vmm = true)
    : pool_fixture{options, test::default_capacity, vmm}
  {
  }
};

/// byte_accounting(), and the peak is at least what is reserved now.
std::string consistency(test::pool_fixture& f)
{
  auto const s = f->stats();
  std::string problems = test::byte_accounting(s, f.drv.stats());
  if (s.peak_bytes_reserved < s.bytes_reserved) { problems += "peak < reserved; "; }
  return problems;
}

}  // namespace

TEST(growable_maps_pages_on_demand)
{
  fixture f;
  CHECK(f->growable());
  auto const a = f->allocate(3 * MiB);  // pages 0 and 1 of the reservation
  auto const s = f->stats();
  CHECK_EQ(s.bytes_reserved, 2 * page);
  CHECK_EQ(s.page_maps, 2u);
  CHECK_EQ(s.segments, 1u);
  CHECK_EQ(f.drv.stats().live_reservations, 1u);
  CHECK_EQ(f.drv.stats().live_mappings, 2u);
  CHECK(f.drv.accessible(0, a, 3 * MiB));
  CHECK_EQ(consistency(f), "");
  f->deallocate(a);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_grows_in_page_steps)
{
  fixture f;
  std::vector<device_ptr> blocks;
  for (int i = 0; i < 5; ++i) { blocks.push_back(f->allocate(3 * MiB)); }
  // 15 MiB back to back: 8 pages, where fixed segments would hold a 20 MiB segment.
  CHECK_EQ(f->stats().bytes_reserved, 8 * page);
  for (std::size_t i = 1; i < blocks.size(); ++i) { CHECK_EQ(blocks[i], blocks[i - 1] + 3 * MiB); }
  for (auto p : blocks) { CHECK(f.drv.accessible(0, p, 3 * MiB)); }
  CHECK_EQ(consistency(f), "");
}

TEST(growable_growth_maps_room_for_the_next_requests)
{
  auto o          = growable_options();
  o.growable_room = 20 * MiB;
  fixture f{o};
  std::vector<device_ptr> blocks;
  for (int i = 0; i < 5; ++i) { blocks.push_back(f->allocate(4 * MiB)); }
  CHECK_EQ(f->stats().page_maps, 10u);  // one growth of 20 MiB served all five
  CHECK_EQ(f->stats().bytes_reserved, 20 * MiB);
  for (auto p : blocks) { CHECK(f.drv.accessible(0, p, 4 * MiB)); }
  CHECK_EQ(consistency(f), "");
}

TEST(growable_pages_of_a_larger_size_are_one_driver_map_each)
{
  auto o               = growable_options();
  o.growable_page_size = 7 * MiB;  // rounded up to a multiple of the granularity: 8 MiB
  fixture f{o};
  auto const a = f->allocate(3 * MiB);  // [0, 3) MiB: page 0 = [0, 8)
  CHECK_EQ(f->stats().bytes_reserved, 8 * MiB);
  CHECK_EQ(f->stats().page_maps, 1u);
  auto const b = f->allocate(6 * MiB);  // [3, 9): pages 0 and 1
  CHECK_EQ(b, a + 3 * MiB);
  CHECK_EQ(f->stats().bytes_reserved, 16 * MiB);
  CHECK_EQ(f->stats().page_maps, 2u);
  CHECK_EQ(f.drv.stats().live_mappings, 2u);
  CHECK(f.drv.accessible(0, a, 9 * MiB));
  f->deallocate(a);
  f->trim();  // page 0 still holds part of b
  CHECK_EQ(f->stats().bytes_reserved, 16 * MiB);
  f->deallocate(b);
  f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().live_mappings, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_trim_unmaps_only_wholly_free_pages)
{
  fixture f;
  auto const a = f->allocate(3 * MiB);  // [0, 3) MiB: pages 0, 1
  auto const b = f->allocate(3 * MiB);  // [3, 6) MiB: pages 1, 2
  CHECK_EQ(f->stats().bytes_reserved, 3 * page);
  f->deallocate(a);
  f->trim();  // waits for a's fence: page 0 is wholly free, page 1 still holds part of b
  CHECK_EQ(f->stats().bytes_reserved, 2 * page);
  CHECK(f.drv.accessible(0, b, 3 * MiB));
  CHECK_EQ(consistency(f), "");
  f->deallocate(b);
  f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().live_mappings, 0u);
  CHECK_EQ(f.drv.stats().live_reservations, 1u);  // address space is kept
  CHECK_EQ(consistency(f), "");
}

TEST(growable_pending_blocks_are_never_unmapped)
{
  fixture f;
  auto const a = f->allocate(8 * MiB);
  f->deallocate(a);  // pending: its fence has not completed
  // Past the peak: the pool gives back wholly free pages first, but a is not free yet.
  auto const b = f->allocate(20 * MiB);
  CHECK(f.drv.accessible(0, a, 8 * MiB));
  CHECK(f.drv.accessible(0, b, 20 * MiB));
  CHECK_EQ(consistency(f), "");
  (void)f->trim();  // waits for a: now it may go
  CHECK(!f.drv.accessible(0, a, 8 * MiB));
  CHECK(f.drv.accessible(0, b, 20 * MiB));
  CHECK_EQ(consistency(f), "");
}

TEST(growable_freed_pages_stay_mapped_and_serve_later_requests)
{
  fixture f;  // growable_free_limit: the default
  auto const a = f->allocate(8 * MiB);
  auto const b = f->allocate(8 * MiB);
  f->deallocate(a);
  f->synchronize();  // a's fence completed: a is free, its pages still mapped
  CHECK(f.drv.accessible(0, a, 8 * MiB));
  auto const c = f->allocate(20 * MiB);  // a's hole cannot hold it: new pages, a's kept
  CHECK_EQ(f->stats().page_unmaps, 0u);
  CHECK_EQ(f->stats().bytes_reserved, 36 * MiB);
  CHECK_EQ(consistency(f), "");
  // A free block whose pages are mapped is preferred to a better fit that would need new
  // pages: no driver call at all, however often it comes back.
  auto const maps = f->stats().page_maps;
  for (int i = 0; i < 10; ++i) {
    auto const d = f->allocate(6 * MiB);
    CHECK_EQ(d, a);
    f->deallocate(d);
    f->synchronize();
  }
  CHECK_EQ(f->stats().page_maps, maps);
  for (auto p : {b, c}) { f->deallocate(p); }
  (void)f->trim();  // trim keeps nothing
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(consistency(f), "");
}

/// Two 4 MiB blocks x and y, freed, x's pages unmapped: one free block from x on, unmapped,
/// then y's mapped pages, then unmapped to the segment's end. @return {x, y}
std::pair<device_ptr, device_ptr> free_block_with_pages_inside(fixture& f)
{
  auto const x = f->allocate(4 * MiB);
  auto const y = f->allocate(4 * MiB);
  f->deallocate(x);
  f->synchronize();
  (void)f->trim();  // x's pages go
  f->deallocate(y);
  f->synchronize();
  return {x, y};
}

TEST(growable_a_request_goes_where_its_free_block_has_pages)
{
  // The segment's unmapped end is one free block with what was freed below it: placed at that
  // block's start, a request would map new pages beside free mapped ones.
  fixture f;
  auto const [x, y] = free_block_with_pages_inside(f);
  auto const maps = f->stats().page_maps;
  CHECK_EQ(f->allocate(4 * MiB), y);  // no new page
  CHECK_EQ(f->stats().page_maps, maps);
  CHECK_EQ(f->allocate(4 * MiB), x);  // the front stayed free: the lowest that lacks the fewest
  CHECK_EQ(f->stats().page_maps, maps + 2);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_request_reuses_pages_deeper_in_a_larger_block_before_mapping_any)
{
  // Pages 0-6 mapped under a..g; a freed and trimmed: the best fit for 4 MiB, [0, 4 MiB),
  // lacks both its pages. c freed and trimmed, then d and e: the larger free block
  // [6, 12 MiB) lacks its first page only, and its last two are mapped.
  fixture f;
  auto const a = f->allocate(4 * MiB);
  auto const b = f->allocate(2 * MiB);
  auto const c = f->allocate(2 * MiB);
  auto const d = f->allocate(2 * MiB);
  auto const e = f->allocate(2 * MiB);
  auto const g = f->allocate(2 * MiB);
  CHECK_EQ(d, a + 8 * MiB);
  f->deallocate(a);
  f->deallocate(c);
  f->synchronize();
  (void)f->trim();
  f->deallocate(d);
  f->deallocate(e);
  f->synchronize();
  auto const maps = f->stats().page_maps;
  auto const x    = f->allocate(4 * MiB);
  CHECK_EQ(x, d);  // where d and e were: no page mapped, none moved
  CHECK_EQ(f->stats().page_maps, maps);
  CHECK_EQ(f->allocate(4 * MiB), a);  // the best fit, which maps its two pages
  CHECK_EQ(f->stats().page_maps, maps + 2);
  CHECK_EQ(consistency(f), "");
  for (auto p : {b, g}) { f->deallocate(p); }
}

TEST(growable_new_peak_moves_free_pages_beyond_the_limit)
{
  auto o                = growable_options();
  o.growable_free_limit = 0;  // every free page moves or goes at a new peak
  fixture f{o};
  auto const a = f->allocate(8 * MiB);
  auto const b = f->allocate(8 * MiB);
  f->deallocate(a);
  f->synchronize();  // a is free
  auto const creates = f.drv.stats().creates;
  auto const c       = f->allocate(20 * MiB);  // a's 8 MiB hole cannot hold it
  // a's four pages moved under c (unmapped, mapped again: no cuMemCreate, no cuMemRelease),
  // six pages are new: the peak is b + c, not a + b + c.
  CHECK_EQ(f.drv.stats().creates - creates, 6u);
  CHECK_EQ(f.drv.stats().releases, 0u);
  CHECK_EQ(f->stats().page_creates, 4u + 4u + 6u);
  CHECK_EQ(f->stats().peak_bytes_reserved, 28 * MiB);
  CHECK(!f.drv.accessible(0, a, 8 * MiB));
  CHECK(f.drv.accessible(0, b, 8 * MiB));
  CHECK(f.drv.accessible(0, c, 20 * MiB));
  CHECK_EQ(consistency(f), "");
  // More free pages than the new peak needs: the rest go back to the driver.
  f->deallocate(c);
  f->synchronize();
  auto const d = f->allocate(4 * MiB);  // c's pages serve it: no new peak, nothing moves
  CHECK_EQ(d, c);
  f->deallocate(b);
  f->synchronize();
  auto const e = f->allocate(30 * MiB);  // past the peak: b's and c's rest move or go
  CHECK(f->stats().peak_bytes_reserved <= 34 * MiB);
  CHECK(f.drv.accessible(0, d, 4 * MiB));
  CHECK(f.drv.accessible(0, e, 30 * MiB));
  CHECK_EQ(consistency(f), "");
}

TEST(growable_new_peak_keeps_free_pages_within_the_limit)
{
  auto o                = growable_options();
  o.growable_free_limit = 8 * MiB;
  fixture f{o};
  auto const a = f->allocate(8 * MiB);
  auto const b = f->allocate(8 * MiB);
  auto const c = f->allocate(8 * MiB);
  auto const d = f->allocate(2 * MiB);  // keeps c's pages off the free tail
  f->deallocate(a);
  f->deallocate(c);
  f->synchronize();  // 16 MiB of wholly free pages, reserved = peak = 26 MiB
  auto const e = f->allocate(12 * MiB);  // the 8 MiB holes cannot hold it
  // 8 MiB of free pages stay mapped (the limit): c's, the largest, highest free block's,
  // moved under e; a's kept. e needs 2 new pages besides.
  CHECK_EQ(f->stats().page_unmaps, 4u);
  CHECK(!f.drv.accessible(0, c, 2 * MiB));
  CHECK(f.drv.accessible(0, a, 8 * MiB));
  CHECK(f.drv.accessible(0, e, 12 * MiB));
  CHECK_EQ(f->stats().bytes_reserved, 30 * MiB);
  CHECK_EQ(consistency(f), "");
  // a's pages still mapped serve the next request without a driver call.
  auto const maps = f->stats().page_maps;
  auto const g    = f->allocate(4 * MiB);
  CHECK_EQ(g, a);
  CHECK_EQ(f->stats().page_maps, maps);
  for (auto p : {b, d, e, g}) { f->deallocate(p); }
  (void)f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(consistency(f), "");
}

namespace {

struct step_counts {
  double maps_per_step, unmaps_per_step, creates_per_step;
  std::size_t peak_reserved, peak_in_use;
};

/// A PyTorch training loop's pattern, shapes changing every step: parameters held throughout;
/// per step a batch scale, activations allocated layer by layer (forward), then per layer in
/// reverse a gradient allocated and the activation freed (backward). The GPU keeps up.
step_counts torch_like_steps(std::size_t free_limit, int steps)
{
  auto o                = growable_options();
  o.growable_room       = 20 * MiB;  // the default
  o.growable_free_limit = free_limit;
  fixture f{o};
  std::mt19937_64 rng{7};
  std::vector<device_ptr> params;
  for (int i = 0; i < 8; ++i) { params.push_back(f->allocate(6 * MiB)); }
  constexpr int layers = 16;
  std::vector<std::size_t> base(layers);
  for (auto& b : base) { b = (1 + rng() % 16) * 256 * 1024; }  // 0.25 .. 4 MiB per unit
  std::uint64_t maps0 = 0, unmaps0 = 0, creates0 = 0;
  int const warm = 5;
  for (int s = 0; s < warm + steps; ++s) {
    if (s == warm) {
      maps0    = f->stats().page_maps;
      unmaps0  = f->stats().page_unmaps;
      creates0 = f->stats().page_creates;
    }
    std::size_t const scale = 1 + rng() % 8;
    std::vector<device_ptr> act(layers);
    for (int l = 0; l < layers; ++l) {
      act[l] = f->allocate(base[l] * scale + (rng() % 64) * 256);
      f.drv.complete_all_events();
    }
    device_ptr grad = 0;
    for (int l = layers - 1; l >= 0; --l) {
      auto const g = f->allocate(base[l] * scale);
      f->deallocate(act[l]);
      if (grad != 0) { f->deallocate(grad); }
      grad = g;
      f.drv.complete_all_events();
    }
    f->deallocate(grad);
    f.drv.complete_all_events();
  }
  auto const st = f->stats();
  CHECK_EQ(consistency(f), "");
  for (auto p : params) { f->deallocate(p); }
  return {double(st.page_maps - maps0) / steps, double(st.page_unmaps - unmaps0) / steps,
          double(st.page_creates - creates0) / steps, st.peak_bytes_reserved,
          st.peak_bytes_in_use};
}

}  // namespace

TEST(growable_pages_move_rather_than_come_and_go_on_a_torch_like_loop)
{
  auto const moved = torch_like_steps(0, 60);  // every free page a request lacks moves
  auto const dflt  = torch_like_steps(pool_options{}.growable_free_limit, 60);
  auto const kept  = torch_like_steps(std::size_t{1} << 40, 60);  // no free page ever moves
  std::printf("torch-like loop, per step (2 MiB pages), maps/unmaps/pages made, peak reserved:\n"
              "  limit 0:   %.1f %.1f %.1f, %zu MiB\n  default:   %.1f %.1f %.1f, %zu MiB\n"
              "  keep all:  %.1f %.1f %.1f, %zu MiB (peak in use %zu MiB)\n",
              moved.maps_per_step, moved.unmaps_per_step, moved.creates_per_step,
              moved.peak_reserved / MiB, dflt.maps_per_step, dflt.unmaps_per_step,
              dflt.creates_per_step, dflt.peak_reserved / MiB, kept.maps_per_step,
              kept.unmaps_per_step, kept.creates_per_step, kept.peak_reserved / MiB,
              kept.peak_in_use / MiB);
  // Moved pages are no new ones: most maps cost no cuMemCreate (and their unmaps no release).
  CHECK(moved.creates_per_step * 2 < moved.maps_per_step);
  // Keeping free pages maps less, moving them reserves less; the default lies between.
  CHECK(kept.unmaps_per_step == 0.0);
  CHECK(kept.maps_per_step < moved.maps_per_step);
  CHECK(dflt.maps_per_step <= moved.maps_per_step);
  CHECK(moved.peak_reserved <= kept.peak_reserved);
  CHECK(dflt.peak_reserved <= kept.peak_reserved + 2 * MiB);
}

TEST(growable_deferred_cleanup_unmaps_nothing)
{
  for (std::size_t limit : {pool_options{}.growable_free_limit, std::size_t{0}}) {
    auto o                = growable_options(32 * MiB);
    o.growable_free_limit = limit;
    fixture f{o};
    auto const a = f->allocate(8 * MiB);
    auto const b = f->allocate(8 * MiB);
    f->deallocate(a);
    f->synchronize();
    f.controls().defer_cleanup_begin();
    auto const c = f->allocate(12 * MiB);  // a new peak, and then the cap: nothing unmapped
    CHECK_EQ(f->stats().page_unmaps, 0u);
    CHECK(f.drv.accessible(0, a, 8 * MiB));
    CHECK_EQ(consistency(f), "");
    CHECK_THROWS((void)f->allocate(12 * MiB), out_of_memory);  // the cap, cleanup deferred
    CHECK_EQ(f->stats().page_unmaps, 0u);
    f.controls().defer_cleanup_end();
    f->deallocate(b);
    f->deallocate(c);
    (void)f->trim();
    CHECK_EQ(f->stats().bytes_reserved, 0u);
    CHECK_EQ(consistency(f), "");
  }
}

TEST(growable_reuse_waits_for_the_fence)
{
  // A freed block serves again only once its fence completed: found so by a later request, or
  // waited for where new pages would pass the peak and the frees waiting could cover them.
  fixture f;
  auto const big = f->allocate(8 * MiB);
  f->deallocate(big);
  f->synchronize();  // 8 MiB of free pages: the peak
  auto const a = f->allocate(4 * MiB);
  CHECK_EQ(a, big);
  f->deallocate(a);                     // fenced, its event not completed
  auto const b = f->allocate(4 * MiB);  // on free pages: no wait, a stays pending
  CHECK_EQ(b, big + 4 * MiB);
  CHECK_EQ(f->stats().fence_waits, 0u);
  auto const c = f->allocate(4 * MiB);  // new pages past the peak, a could cover them: wait
  CHECK_EQ(c, a);
  CHECK_EQ(f->stats().fence_waits, 1u);
  CHECK_EQ(f->stats().page_maps, 4u);  // big's pages only
  CHECK_EQ(f->stats().peak_bytes_reserved, 8 * MiB);
  f->deallocate(b);                     // 4 MiB waiting
  auto const d = f->allocate(8 * MiB);  // 8 MiB past the peak, more than waits: new pages
  CHECK_EQ(f->stats().fence_waits, 1u);
  CHECK(d >= big + 8 * MiB);
  f.drv.complete_all_events();
  auto const e = f->allocate(4 * MiB);  // miss: maintenance promotes b
  CHECK_EQ(e, b);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_new_peak_waits_for_its_own_streams_frees_only)
{
  // Another stream's frees are not waited for: that would hold this stream's work up behind
  // the other's (a kernel still reading the freed block), where fixed segments would grow.
  fixture f;
  auto const s1 = f.drv.create_stream();
  auto const s2 = f.drv.create_stream();
  auto const a  = f->allocate(8 * MiB, s1);
  f->deallocate(a, s1);                     // pending on s1
  auto const b = f->allocate(8 * MiB, s2);  // a new peak: new pages
  CHECK_NE(b, a);
  CHECK_EQ(f->stats().fence_waits, 0u);
  CHECK_EQ(f->stats().peak_bytes_reserved, 16 * MiB);
  f->deallocate(b, s2);
  f->synchronize();
  CHECK_EQ(f->allocate(16 * MiB, s2), a);  // both completed: one free block, no new page
  CHECK_EQ(f->stats().peak_bytes_reserved, 16 * MiB);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_new_peak_wait_completes_its_own_streams_frees_and_no_others)
{
  // The wait at a new peak takes the request's own stream's frees (they precede its next work
  // anyway) and leaves another stream's waiting: taking those would hold this stream up behind
  // the other's kernels.
  fixture f;
  auto const s1 = f.drv.create_stream();
  auto const s2 = f.drv.create_stream();
  auto const b1 = f->allocate(8 * MiB, s2);
  auto const a  = f->allocate(8 * MiB, s1);
  auto const b2 = f->allocate(8 * MiB, s2);
  REQUIRE(a == b1 + 8 * MiB && b2 == a + 8 * MiB);
  f->deallocate(a, s1);
  f->deallocate(b1, s2);
  f->deallocate(b2, s2);  // apart from b1: a lies between them
  // 10 MiB on s2: neither of its pending blocks holds it, and new pages would pass the peak
  // while s2's own 16 MiB wait: the pool waits for those, then b2 with the end serves.
  auto const c = f->allocate(10 * MiB, s2);
  CHECK_EQ(f->stats().fence_waits, 1u);
  CHECK_EQ(c, b2);
  CHECK_EQ(f->stats().bytes_waiting, 8 * MiB);  // a: s1's, still waiting for its fence
  CHECK_EQ(f->stats().peak_bytes_reserved, 26 * MiB);  // b2's pages and one more page
  f->deallocate(c, s2);
  f->synchronize();
  CHECK_EQ(consistency(f), "");
}

TEST(growable_new_pages_past_the_cap_give_wholly_free_fixed_memory_back_first)
{
  // A fixed segment wholly free (a small one, here) holds memory the growable segment's new
  // pages need under the cap: it goes back before they are mapped, at once, with no wait for
  // another stream's frees (the out-of-memory ladder's wait would synchronize for them).
  fixture f{growable_options(10 * MiB)};
  auto const small = f->allocate(512 * 1024);  // a 2 MiB fixed segment
  f->deallocate(small);
  f->synchronize();  // wholly free: a new peak of the growable segment keeps it
  auto const t = f.drv.create_stream();
  auto const w = f->allocate(2 * MiB, t);  // one page: 4 MiB reserved
  f->deallocate(w, t);                     // pending on t, dormant: nobody waits for it here
  auto const syncs = f.drv.stats().event_syncs + f.drv.stats().device_syncs;
  auto const frees = f.drv.stats().deallocations;
  auto const s = f.drv.create_stream();
  auto const c = f->allocate(8 * MiB, s);  // 4 + 8 MiB would pass the cap of 10
  CHECK(f.drv.accessible(0, c, 8 * MiB));
  CHECK_EQ(c, w + 2 * MiB);                          // new pages past w's
  CHECK_EQ(f.drv.stats().deallocations, frees + 1);  // the small segment went back
  CHECK_EQ(f.drv.stats().event_syncs + f.drv.stats().device_syncs, syncs);  // no wait
  CHECK_EQ(f->stats().bytes_waiting, 2 * MiB);  // w still waits for its fence
  CHECK_EQ(f->stats().bytes_reserved, 10 * MiB);
  f->deallocate(c, s);
  f->synchronize();
  CHECK_EQ(consistency(f), "");
}

TEST(growable_requests_use_the_initial_fixed_segment_first)
{
  auto o         = growable_options();
  o.initial_size = 64 * MiB;  // a fixed segment, made with the pool
  fixture f{o};
  auto const a = f->allocate(40 * MiB);
  auto const b = f->allocate(20 * MiB);
  CHECK_EQ(f->stats().bytes_reserved, 64 * MiB);  // both inside it: no page mapped
  CHECK_EQ(f->stats().page_maps, 0u);
  auto const c = f->allocate(8 * MiB);  // past it: pages
  CHECK_EQ(f->stats().page_maps, 4u);
  f->deallocate(a);
  f->deallocate(b);
  f->deallocate(c);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_cap_and_out_of_memory_ladder)
{
  fixture f{growable_options(16 * MiB)};
  auto const a = f->allocate(10 * MiB);
  CHECK_EQ(f->stats().bytes_reserved, 10 * MiB);
  f->deallocate(a);  // pending
  // 10 + 12 MiB would pass the cap; the ladder waits for a, whose pages then serve again.
  auto const b = f->allocate(12 * MiB);
  CHECK_EQ(b, a);
  CHECK_EQ(f->stats().bytes_reserved, 12 * MiB);
  CHECK_EQ(consistency(f), "");
  CHECK_THROWS(f->allocate(6 * MiB), out_of_memory);  // 12 + 6 > 16, nothing to give back
  CHECK_EQ(consistency(f), "");
  f->deallocate(b);
  auto const c = f->allocate(16 * MiB);
  CHECK(f.drv.accessible(0, c, 16 * MiB));
  CHECK_EQ(consistency(f), "");
}

TEST(growable_failed_maps_and_unmaps_keep_the_pool_consistent)
{
  fixture f;
  f.drv.fail_next_creates(1);  // cuMemCreate fails once: served by a fixed segment instead
  auto const a = f->allocate(6 * MiB);
  CHECK(f.drv.accessible(0, a, 6 * MiB));
  CHECK_EQ(f.drv.stats().bytes_reserved, 20 * MiB);
  CHECK_EQ(consistency(f), "");
  auto const b = f->allocate(16 * MiB);  // maps again
  CHECK_EQ(f.drv.stats().bytes_mapped, 16 * MiB);
  f.drv.fail_next_creates(1000);
  f.drv.fail_next_allocations(1000);  // no fixed segment either
  CHECK_THROWS(f->allocate(40 * MiB), out_of_memory);  // no half-mapped block is left
  CHECK_EQ(f.drv.stats().bytes_mapped, 16 * MiB);
  CHECK_EQ(consistency(f), "");
  f.drv.fail_next_creates(0);
  f.drv.fail_next_allocations(0);
  f->deallocate(a);
  f->deallocate(b);
  f.drv.fail_next_unmaps(1);
  (void)f->trim();  // an unmap fails: pages stay mapped and counted, for the next trim
  CHECK(f->stats().bytes_reserved >= page);
  CHECK_EQ(consistency(f), "");
  (void)f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().live_mappings, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_placed_request_whose_map_fails_leaves_its_block_whole)
{
  // A request placed past its free block's start (where it lacks the fewest pages) splits the
  // block's front off before it maps; when the map fails the two join again.
  fixture f;
  auto const a = free_block_with_pages_inside(f).first;
  auto const free_blocks = [&] {
    std::size_t n = 0;
    for (auto const& blk : f.queries().layout()) {
      n += blk.kind == segment_type::growable && blk.state == block_status::free ? 1 : 0;
    }
    return n;
  };
  CHECK_EQ(free_blocks(), 1u);
  f.drv.fail_next_creates(1000);
  f.drv.fail_next_allocations(1000);  // no fixed segment either
  CHECK_THROWS(f->allocate(6 * MiB), out_of_memory);  // placed at a + 2 MiB: one page short
  CHECK_EQ(free_blocks(), 1u);
  f.drv.fail_next_creates(0);
  f.drv.fail_next_allocations(0);
  auto const c = f->allocate(6 * MiB);
  CHECK_EQ(c, a);  // the ladder gave b's pages back on its way: the block from its start
  CHECK_EQ(consistency(f), "");
  f->deallocate(c);
}

TEST(growable_pages_inside_the_mapped_prefix_and_past_a_hole)
{
  // unmapped_in() answers from the prefix of pages mapped from the first without counting:
  // a page unmapped below its end must shorten it.
  host_driver drv;
  detail::growable_pages pages{drv, 0, page, 16 * page};
  auto const base = pages.base();
  pages.map(base, 4 * page);
  CHECK_EQ(pages.unmapped_in(base, 4 * page), 0u);
  CHECK_EQ(pages.unmapped_in(base + page, 4 * page), page);
  // a hole at page 1
  CHECK_EQ(pages.unmap_inside(base + page, page, page, detail::unmapped_pages::keep_spare), page);
  CHECK_EQ(pages.unmapped_in(base, page), 0u);
  CHECK_EQ(pages.unmapped_in(base, 2 * page), page);
  CHECK_EQ(pages.unmapped_in(base + 2 * page, 2 * page), 0u);
  pages.map(base + page, 1);  // the hole filled: the prefix reaches page 4 again
  CHECK_EQ(pages.unmapped_in(base, 4 * page), 0u);
  pages.map(base + 6 * page, page);  // past a gap: not in the prefix
  CHECK_EQ(pages.unmapped_in(base, 7 * page), 2 * page);
  CHECK_EQ(pages.unmapped_in(base + 6 * page, page), 0u);
  pages.release();
}

TEST(growable_pages_a_map_undone_leaves_spares_spare_and_releases_what_it_made)
{
  // on_failure::undo: the pages held before the map stay held (spare), the pages it made go
  // back to the driver, whichever way the map got them.
  host_driver drv;
  detail::growable_pages pages{drv, 0, page, 16 * page};
  auto const base = pages.base();
  pages.map(base, 2 * page);
  CHECK_EQ(pages.unmap_inside(base, 2 * page, 2 * page, detail::unmapped_pages::keep_spare),
           2 * page);
  drv.fail_next_maps(1, 3);  // two spares mapped, a third page made and mapped, the fourth fails
  CHECK_THROWS(pages.map(base + 4 * page, 4 * page, detail::growable_pages::on_failure::undo),
               cuda_error);
  CHECK_EQ(pages.mapped_bytes(), 0u);
  CHECK_EQ(pages.spare_bytes(), 2 * page);  // the two held before, spare again
  CHECK_EQ(drv.stats().live_handles, 2u);   // the two the map made: released
  CHECK_EQ(drv.stats().bytes_physical, 2 * page);
  pages.release();
}

TEST(growable_a_map_that_fails_part_way_is_counted)
{
  // Room for two pages (the rest of the device taken since the segment was reserved): a
  // 5 MiB block makes and maps two, the third cuMemCreate finds the device full. What was made
  // goes back (a request that fails leaves no more mapped or held than before it), each step
  // counted, so the pool's reserved bytes stay the driver's, and the pool serves once there is
  // room.
  fixture f;
  f->deallocate(f->allocate(3 * MiB));  // the segment, reserved over the whole device
  (void)f->trim();
  f.drv.set_capacity(0, 2 * page);
  f.drv.fail_next_allocations(1000);  // no fixed segment either
  auto const made = f.drv.stats().creates;
  CHECK_THROWS(f->allocate(5 * MiB), out_of_memory);
  CHECK_EQ(consistency(f), "");
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().bytes_mapped, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
  CHECK(f.drv.stats().creates >= made + 2);  // it did make pages before it failed
  CHECK_EQ(f->stats().page_creates, f->stats().page_releases);
  CHECK_EQ(f->stats().page_maps, f->stats().page_unmaps);
  f.drv.set_capacity(0, 64 * MiB);
  auto const a = f->allocate(5 * MiB);
  CHECK(f.drv.accessible(0, a, 5 * MiB));
  CHECK_EQ(consistency(f), "");
  f->deallocate(a);
  (void)f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_failed_request_leaves_nothing_mapped_and_the_largest_block_is_told)
{
  // The default options (20 MiB pages, room for the next requests): a 900 MiB request on a
  // 1 GiB device of which another allocator took half maps pages until the device is full,
  // then fails; it must leave the device as it found it, and the error must say what the pool
  // holds. A request larger than the device fails at once, mapping nothing.
  test::pool_fixture f{pool_options{}, 1024 * MiB};
  f.drv.fail_next_allocations(1000);  // no fixed segment either
  CHECK_THROWS(f->allocate(2048 * MiB), out_of_memory);
  CHECK_EQ(f.drv.stats().creates, 0u);
  f.drv.set_capacity(0, 512 * MiB);
  try {
    (void)f->allocate(900 * MiB);
    CHECK(false);
  } catch (out_of_memory const& e) {
    CHECK(std::string{e.what()}.find("largest block 0 B") != std::string::npos);
  }
  CHECK(f.drv.stats().creates >= 25u);  // 500 MiB of pages made, then given back
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().bytes_mapped, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
  CHECK_EQ(consistency(f), "");

  // With a block live and its page's rest free, the largest block is that rest, mapped.
  auto const a = f->allocate(4 * MiB);
  auto const s = f->stats();
  CHECK_EQ(s.bytes_free, s.bytes_reserved - 4 * MiB);
  CHECK(s.largest_free_block > 0u);
  CHECK_EQ(s.largest_free_block, s.bytes_free);  // one run, behind a
  try {
    (void)f->allocate(900 * MiB);
    CHECK(false);
  } catch (out_of_memory const& e) {
    CHECK(std::string{e.what()}.find("largest block 0 B") == std::string::npos);
  }
  CHECK_EQ(f->stats().bytes_reserved, s.bytes_reserved);  // as before the request
  f->deallocate(a);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_largest_free_block_is_the_longest_mapped_run_of_a_free_block)
{
  fixture f;  // 2 MiB pages, no room
  auto const a = f->allocate(6 * MiB);   // pages 0-2
  auto const b = f->allocate(2 * MiB);   // page 3
  auto const c = f->allocate(4 * MiB);   // pages 4-5
  f->deallocate(a);
  f->deallocate(c);
  f->synchronize();
  CHECK_EQ(f->stats().largest_free_block, 6 * MiB);  // a's pages, free and mapped
  CHECK_EQ(f->stats().bytes_free, 10 * MiB);
  f->deallocate(b);
  f->synchronize();
  CHECK_EQ(f->stats().largest_free_block, 12 * MiB);  // coalesced: one run of six pages
  (void)f->trim();
  CHECK_EQ(f->stats().largest_free_block, 0u);  // address space alone is no free memory
  CHECK_EQ(consistency(f), "");
}

TEST(growable_nothing_is_unmapped_or_released_during_a_capture)
{
  // cuMemUnmap synchronizes and a capture forbids it: during one, a map that fails part way
  // (the device full after two more pages) keeps what it mapped, and nothing goes back.
  auto o                = growable_options();
  o.growable_free_limit = 0;  // outside a capture, every free page would move
  fixture f{o};
  f.drv.fail_next_allocations(1000);  // no fixed segment
  auto const a = f->allocate(8 * MiB);
  f->deallocate(a);
  f->synchronize();
  f.drv.set_capacity(0, f.drv.stats().bytes_physical + 2 * page);
  auto const before = f.drv.stats();
  f.controls().capture_begin();
  CHECK_THROWS(f->allocate(40 * MiB), out_of_memory);
  auto const during = f.drv.stats();
  CHECK_EQ(during.creates, before.creates + 2);
  CHECK_EQ(during.unmaps, before.unmaps);
  CHECK_EQ(during.releases, before.releases);
  CHECK_EQ(consistency(f), "");
  f.controls().capture_end();
  (void)f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(a_legacy_handle_opened_twice_is_closed_twice)
{
  // Two blocks of one fixed segment export the same handle; the driver maps it once and
  // counts the opens: each close undoes one, the last unmaps.
  pool_options fixed;
  fixed.segments = segment_kind::fixed;
  fixture f{fixed};
  auto const a = f->allocate(3 * MiB);
  auto const b = f->allocate(3 * MiB);
  auto const ha = f.sharing().ipc_handle(a);
  auto const hb = f.sharing().ipc_handle(b);
  REQUIRE(ha.has_value() && hb.has_value());
  CHECK(ha->handle == hb->handle);
  ipc_imports imports{f.drv};
  auto const base_a = imports.open_handle(0, ha->handle);
  auto const base_b = imports.open_handle(0, hb->handle);
  CHECK_EQ(base_a, base_b);
  CHECK_EQ(imports.open_count(), 1u);
  CHECK_EQ(f.drv.ipc_opens(), 2u);
  imports.close(base_a);
  CHECK_EQ(imports.open_count(), 1u);  // b's open still maps it
  CHECK_EQ(f.drv.ipc_opens(), 1u);
  imports.close(base_b);
  CHECK_EQ(imports.open_count(), 0u);
  CHECK_EQ(f.drv.ipc_opens(), 0u);
  CHECK_THROWS(imports.close(base_a), pool_error);
  f->deallocate(a);
  f->deallocate(b);
}

TEST(growable_falls_back_to_fixed_segments_without_vmm)
{
  fixture f{growable_options(), false};  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 0
  CHECK(!f->growable());
  (void)f->allocate(3 * MiB);
  CHECK_EQ(f->stats().bytes_reserved, 20 * MiB);  // today's large segment
  CHECK_EQ(f.drv.stats().live_reservations, 0u);
  CHECK_EQ(consistency(f), "");

  fixture g;  // supported, but the reservation fails: fixed segments from then on
  g.drv.fail_next_reservations(1);
  (void)g->allocate(3 * MiB);
  CHECK(!g->growable());
  CHECK_EQ(g->stats().bytes_reserved, 20 * MiB);
  CHECK_EQ(consistency(g), "");

  pool_options fixed;  // asked for
  fixed.segments = segment_kind::fixed;
  fixture h{fixed};
  CHECK(!h->growable());
  fixture d{pool_options{}};  // the default: growable
  CHECK(d->growable());
}

TEST(growable_and_fixed_memory_do_not_evict_each_other_at_a_new_peak)
{
  // Fixed segments hold small requests, the growable one the rest. A new peak of one kind
  // gives none of the other kind's free memory back: a program that mixes them would unmap
  // and make the same memory again every step (cuMemFree, cuMemCreate).
  auto o                = growable_options();
  o.growable_free_limit = 0;  // every free page is beyond the limit
  fixture f{o};
  auto const n = f->allocate(MiB, legacy_stream, alloc_tag::numba);  // a small segment
  f->deallocate(n);
  f->synchronize();  // wholly free
  auto const c = f->allocate(40 * MiB, legacy_stream, alloc_tag::cupy);  // new pages: a new peak
  CHECK_EQ(f->stats().segment_releases, 0u);
  CHECK_EQ(f->allocate(MiB, legacy_stream, alloc_tag::numba), n);  // its segment, kept
  f->deallocate(c);
  f->synchronize();  // 40 MiB of free pages
  auto const segments = f->stats().segment_allocations;
  auto const s2 = f->allocate(MiB, legacy_stream, alloc_tag::numba);  // fills n's segment
  auto const s3 = f->allocate(MiB, legacy_stream, alloc_tag::numba);  // a second one, and
  CHECK_EQ(f->stats().segment_allocations, segments + 1);
  CHECK_EQ(f->stats().page_unmaps, 0u);  // the free pages stay mapped
  CHECK_EQ(f->allocate(40 * MiB, legacy_stream, alloc_tag::cupy), c);  // no driver call
  CHECK_EQ(f->stats().page_maps, 20u);
  CHECK_EQ(consistency(f), "");
  f->deallocate(n);
  f->deallocate(s2);
  f->deallocate(s3);
  f->deallocate(c);
  (void)f->trim();  // pressure and trim still take both kinds
  CHECK_EQ(f->stats().bytes_reserved, 0u);
}

TEST(growable_blocks_of_every_library_share_pages_not_legacy_handles)
{
  fixture f;
  for (auto tag : {alloc_tag::numba, alloc_tag::cupy, alloc_tag::torch}) {
    auto const b = f->allocate(3 * MiB, legacy_stream, tag);
    CHECK_THROWS((void)f.sharing().ipc_handle(b), pool_error);  // no legacy handle: share_pages()
    CHECK_THROWS((void)f.sharing().ipc_handle(b + 1024), pool_error);
    CHECK(f.sharing().share_pages(b).has_value());
  }
  auto const small = f->allocate(4096, legacy_stream, alloc_tag::numba);  // small: fixed
  CHECK(f.sharing().ipc_handle(small).has_value());
  CHECK(!f.sharing().share_pages(small).has_value());
  CHECK_EQ(consistency(f), "");
}

TEST(growable_pages_not_aligned_to_their_size_share_from_the_reservations_base)
{
  auto o               = growable_options();
  o.growable_page_size = 20 * MiB;  // no power of two: the base is not a multiple of it
  fixture f{o};
  auto const a = f->allocate(5 * MiB, legacy_stream, alloc_tag::cupy);  // page 0: [0, 20)
  auto const b = f->allocate(5 * MiB, legacy_stream, alloc_tag::cupy);  // [5, 10): page 0
  CHECK_EQ(b, a + 5 * MiB);
  CHECK(a % (20 * MiB) != 0);
  auto const shared = f.sharing().share_pages(b + MiB);
  REQUIRE(shared.has_value());
  CHECK_EQ(shared->first_page, a);
  CHECK_EQ(shared->page_size, 20 * MiB);
  CHECK_EQ(shared->offset, 6 * MiB);
  CHECK_EQ(shared->block_size, 4 * MiB);
  CHECK_EQ(shared->fds.size(), 1u);
  auto const first = f.sharing().share_pages(a);
  REQUIRE(first.has_value());
  CHECK_EQ(first->offset, 0u);
  CHECK(first->fds == shared->fds);
  ipc_imports imports{f.drv};
  auto const base = imports.open_pages(0, shared->fds, shared->page_size);
  CHECK(f.drv.accessible(0, base, 20 * MiB));
  imports.close(base);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_blocks_share_their_pages_and_an_import_outlives_nothing_of_the_sender)
{
  fixture f;
  auto const c = f->allocate(5 * MiB, legacy_stream, alloc_tag::cupy);  // pages 0, 1, 2
  CHECK(!f.sharing().share_pages(f->allocate(4096, legacy_stream, alloc_tag::numba)));  // small: fixed
  auto const shared = f.sharing().share_pages(c + MiB);
  REQUIRE(shared.has_value());
  CHECK_EQ(shared->first_page, c);
  CHECK_EQ(shared->page_size, page);
  CHECK_EQ(shared->offset, MiB);
  CHECK_EQ(shared->block_size, 4 * MiB);
  REQUIRE(shared->fds.size() == 3u);
  auto const again = f.sharing().share_pages(c);  // a page is exported once: the same descriptors
  REQUIRE(again.has_value());
  CHECK(again->fds == shared->fds);
  CHECK_EQ(f.drv.stats().exports, 3u);
  // Another process (here, the same driver) maps them into addresses of its own.
  ipc_imports imports{f.drv};
  auto const base = imports.open_pages(0, shared->fds, shared->page_size);
  CHECK(base != c);
  CHECK(f.drv.accessible(0, base, 6 * MiB));
  CHECK_EQ(imports.open_count(), 1u);
  // The sender frees and gives its pages back: its books are as if nothing was shared; the
  // import keeps the memory alive until it is closed.
  auto const physical = f.drv.stats().bytes_physical;
  f->deallocate(c);
  (void)f->trim();
  CHECK(f.drv.accessible(0, base, 6 * MiB));
  CHECK_EQ(f.drv.stats().bytes_physical, physical);  // still the importer's
  auto const syncs = f.drv.stats().device_syncs;
  imports.close(base);
  CHECK(f.drv.stats().device_syncs > syncs);  // work issued to it finished first
  CHECK_EQ(f.drv.stats().bytes_physical, physical - 6 * MiB);
  CHECK_EQ(imports.open_count(), 0u);
  CHECK_THROWS(imports.close(base), pool_error);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_exported_descriptors_hold_memory_until_the_pool_closes_them_with_the_pages)
{
  // An exported descriptor holds its page's memory in the driver, here or wherever a copy went
  // (CUDA's rule, modelled by the host driver): the pool keeps one per exported page and must
  // close it when the page goes back, or the memory stays allocated with no one to free it.
  fixture f;
  auto const a = f->allocate(6 * MiB, legacy_stream, alloc_tag::cupy);  // three pages
  auto const shared = f.sharing().share_pages(a);
  REQUIRE(shared.has_value() && shared->fds.size() == 3u);
  int const copy = ::dup(shared->fds[1]);  // what a receiver would hold, not imported yet
  REQUIRE(copy >= 0);
  CHECK_EQ(f.drv.stats().live_exports, 3u);
  f->deallocate(a);
  (void)f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().live_exports, 1u);           // the pool closed its three
  CHECK_EQ(f.drv.stats().bytes_physical, page);       // the copy holds its page
  ::close(copy);
  CHECK_EQ(f.drv.stats().live_exports, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_shared_pages_are_duplicated_only_while_they_are_the_blocks)
{
  fixture f;
  auto const a = f->allocate(6 * MiB, legacy_stream, alloc_tag::cupy);
  auto const shared = f.sharing().share_pages(a);
  REQUIRE(shared.has_value());
  auto const* key = shared->key.data();
  auto const dups = f.sharing().duplicate_shared_pages(key, shared->first_page, page, shared->fds);
  REQUIRE(dups.has_value() && dups->size() == 3u);
  for (int d : *dups) { ::close(d); }
  CHECK(f.sharing().share_pages(a + MiB)->key == shared->key);  // one key per block
  auto reversed = shared->fds;
  std::swap(reversed[0], reversed[2]);
  CHECK(!f.sharing().duplicate_shared_pages(key, shared->first_page, page, reversed));
  CHECK(!f.sharing().duplicate_shared_pages(key, shared->first_page + page, page, shared->fds));
  CHECK(!f.sharing().duplicate_shared_pages(key, shared->first_page, 2 * page, shared->fds));
  CHECK(!f.sharing().duplicate_shared_pages(key, shared->first_page, page, {}));
  auto fewer = shared->fds;  // some of the block's pages only
  fewer.pop_back();
  CHECK(!f.sharing().duplicate_shared_pages(key, shared->first_page, page, fewer));
  auto wrong = shared->key;
  wrong[5] ^= 1;
  CHECK(!f.sharing().duplicate_shared_pages(wrong.data(), shared->first_page, page, shared->fds));
  CHECK(f.sharing().offers(key, shared->first_page, page, shared->fds));
  CHECK(!f.sharing().offers(wrong.data(), shared->first_page, page, shared->fds));
  // No room for a second duplicate: the first is closed again, and the error says so.
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  rlimit tight = saved;
  tight.rlim_cur = static_cast<rlim_t>(detail::open_descriptors() + 1);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &tight) == 0);
  auto const open_before = detail::open_descriptors();
  // The error is kept, and destroyed only once the limit is back: UBSan's check of its
  // destructor opens a pipe, which a process at its descriptor limit cannot.
  std::exception_ptr failure;
  try {
    (void)f.sharing().duplicate_shared_pages(key, shared->first_page, page, shared->fds);
  } catch (...) {
    failure = std::current_exception();
  }
  CHECK_EQ(detail::open_descriptors(), open_before);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
  REQUIRE(failure != nullptr);
  CHECK_THROWS(std::rethrow_exception(failure), pool_error);
  failure = nullptr;
  f->deallocate(a);
  f->synchronize();
  // Freed, its pages still mapped with the same descriptors: the key is forgotten, and a block
  // at the same address, on the same pages, is another block, which the old key never reaches.
  CHECK(!f.sharing().duplicate_shared_pages(key, shared->first_page, page, shared->fds));
  auto const b = f->allocate(6 * MiB, legacy_stream, alloc_tag::cupy);
  REQUIRE(b == a);
  CHECK(!f.sharing().duplicate_shared_pages(key, shared->first_page, page, shared->fds));
  auto const again = f.sharing().share_pages(b);
  REQUIRE(again.has_value() && again->fds == shared->fds);
  CHECK(again->key != shared->key);
  f->deallocate(b);
  f->synchronize();
  (void)f->trim();  // the pages went: their descriptors no longer describe them
  CHECK(!f.sharing().duplicate_shared_pages(again->key.data(), shared->first_page, page,
                                            shared->fds));
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_held_block_keeps_its_key_until_its_last_hold_goes)
{
  fixture f;
  auto const a      = f->allocate(6 * MiB, legacy_stream, alloc_tag::cupy);
  std::uint64_t gen = 0;
  (void)f.sharing().hold(a, &gen);
  auto const shared = f.sharing().share_pages(a);
  REQUIRE(shared.has_value());
  auto const* key = shared->key.data();
  f->deallocate(a);  // held: another process may still ask for its pages
  CHECK(f.sharing().offers(key, shared->first_page, page, shared->fds));
  f.sharing().release_hold(a, gen + 1);  // a release of another generation: nothing
  CHECK(f.sharing().offers(key, shared->first_page, page, shared->fds));
  f.sharing().release_hold(a, gen);
  CHECK(!f.sharing().offers(key, shared->first_page, page, shared->fds));
  CHECK_EQ(f.sharing().held_blocks(), 0u);
  f->synchronize();
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_block_freed_during_a_capture_is_not_shared)
{
  // Parked until the capture ends (its record_stream fence is an event recorded after it),
  // the block is still allocated but no longer the caller's: sharing it would make a key
  // that outlives it, and reach the block at its address next.
  fixture f;
  auto const side = f.drv.create_stream();
  auto const p    = f->allocate(4 * MiB);
  f.controls().capture_begin();
  f->record_stream(p, side);
  f->deallocate(p);
  CHECK(!f.sharing().share_pages(p).has_value());
  f.controls().capture_end();
  f->synchronize();
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_new_peak_on_a_stream_without_an_id_maps_pages_without_waiting)
{
  // Before CUDA 12 streams have no ids: the fence queue cannot wait for one stream's frees,
  // so the new-peak wait is not tried (it waited for nothing, then made a fixed segment).
  fixture f;
  f.drv.set_stream_ids(false);
  auto const s = f.drv.create_stream();
  f->deallocate(f->allocate(8 * MiB, s), s);
  auto const b  = f->allocate(8 * MiB, s);
  auto const st = f->stats();
  CHECK_EQ(st.segments, 1u);
  CHECK_EQ(st.bytes_reserved, 16 * MiB);
  CHECK_EQ(st.fence_waits, 0u);
  f->deallocate(b, s);
  f->synchronize();
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_new_peak_waits_once_then_maps_what_it_lacks)
{
  // Nine other streams with unfinished frees: the wait synchronizes this stream's newest
  // fence, but the queue releases no batch behind the ninth unfinished stream's, so its own
  // frees stay queued. The retake after the wait maps pages; it never waits again, nor makes
  // a fixed segment.
  fixture f;
  for (int i = 0; i < 9; ++i) {
    auto const si = f.drv.create_stream();
    f->deallocate(f->allocate(256, si), si);
    (void)f->allocate(4 * MiB, si);  // a miss on si: its batch closed, its event not complete
  }
  auto const s  = f.drv.create_stream();
  auto const a1 = f->allocate(8 * MiB, s);
  auto const l  = f->allocate(2 * MiB, s);
  auto const a2 = f->allocate(8 * MiB, s);
  f->deallocate(a1, s);
  f->deallocate(a2, s);
  auto const segments = f->stats().segments;
  auto const c        = f->allocate(10 * MiB, s);
  CHECK_EQ(f->stats().segments, segments);
  CHECK(f->stats().fence_waits <= 1u);
  f->deallocate(c, s);
  f->deallocate(l, s);
  f.drv.complete_all_events();
  f->synchronize();
  CHECK_EQ(consistency(f), "");
}

TEST(growable_an_export_that_fails_part_way_strands_nothing)
{
  fixture f;
  auto const a = f->allocate(6 * MiB, legacy_stream, alloc_tag::cupy);
  f.drv.fail_next_exports(1, 1);  // the second page's export fails
  CHECK_THROWS((void)f.sharing().share_pages(a), cuda_error);
  CHECK_EQ(f.drv.stats().live_exports, 1u);  // the first page's: the pool's, kept with it
  auto const again = f.sharing().share_pages(a);      // the first is exported once, the rest now
  REQUIRE(again.has_value() && again->fds.size() == 3u);
  CHECK_EQ(f.drv.stats().exports, 3u);  // one per page: the first kept from the failed try
  f->deallocate(a);
  (void)f->trim();
  CHECK_EQ(f.drv.stats().live_exports, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_an_import_that_fails_part_way_leaves_nothing_mapped_or_held)
{
  fixture f;
  auto const a = f->allocate(6 * MiB, legacy_stream, alloc_tag::cupy);
  auto const shared = f.sharing().share_pages(a);
  REQUIRE(shared.has_value());
  ipc_imports imports{f.drv};
  auto const before = f.drv.stats();
  auto const undone = [&] {
    auto const c = f.drv.stats();
    return c.live_mappings == before.live_mappings && c.live_handles == before.live_handles &&
           c.live_reservations == before.live_reservations && imports.open_count() == 0;
  };
  f.drv.fail_next_imports(1, 1);  // the second page cannot be imported
  CHECK_THROWS((void)imports.open_pages(0, shared->fds, shared->page_size), cuda_error);
  CHECK(undone());
  f.drv.fail_next_maps(1, 2);  // the third page cannot be mapped
  CHECK_THROWS((void)imports.open_pages(0, shared->fds, shared->page_size), cuda_error);
  CHECK(undone());
  f.drv.fail_next_reservations(1);  // no address space for them
  CHECK_THROWS((void)imports.open_pages(0, shared->fds, shared->page_size), cuda_error);
  CHECK(undone());
  CHECK_THROWS((void)imports.open_pages(7, shared->fds, shared->page_size), std::invalid_argument);
  auto const base = imports.open_pages(0, shared->fds, shared->page_size);  // and now it does
  CHECK(f.drv.accessible(0, base, 6 * MiB));
  f.drv.fail_next_device_syncs(1);  // work here may still use it: nothing is unmapped
  CHECK_THROWS(imports.close(base), cuda_error);
  CHECK_EQ(imports.open_count(), 1u);
  CHECK(f.drv.accessible(0, base, 6 * MiB));
  imports.close(base);  // again: now it goes
  CHECK(undone());
  f->deallocate(a);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_a_claim_whose_room_cannot_be_made_is_given_back_whole)
{
  // Under the cap, new pages first give wholly free fixed memory back; a cuMemFree that fails
  // then (a sticky error) fails the request, and the free block it had claimed is whole again:
  // the next request, with the driver well again, is served from it.
  fixture f{growable_options(10 * MiB)};
  auto const small = f->allocate(512 * 1024);  // a 2 MiB fixed segment, then wholly free
  f->deallocate(small);
  f->synchronize();
  auto const a = f->allocate(2 * MiB);
  auto const free_blocks = [&] {
    std::size_t n = 0;
    for (auto const& blk : f.queries().layout()) {
      n += blk.kind == segment_type::growable && blk.state == block_status::free ? 1 : 0;
    }
    return n;
  };
  CHECK_EQ(free_blocks(), 1u);
  f.drv.fail_next_deallocations(1);
  CHECK_THROWS(f->allocate(8 * MiB), cuda_error);  // 4 + 8 MiB: the small segment must go
  CHECK_EQ(free_blocks(), 1u);
  CHECK_EQ(consistency(f), "");
  auto const b = f->allocate(8 * MiB);
  CHECK_EQ(b, a + 2 * MiB);
  CHECK_EQ(f->stats().bytes_reserved, 10 * MiB);
  CHECK_EQ(consistency(f), "");
}

TEST(growable_reset_and_destruction_return_everything)
{
  {
    fixture f;
    auto const a = f->allocate(5 * MiB);
    f->deallocate(a);
    f.controls().reset();  // nothing live: pages unmapped, reservation freed
    CHECK_EQ(f.drv.stats().live_mappings, 0u);
    CHECK_EQ(f.drv.stats().live_reservations, 0u);
    CHECK_EQ(f->stats().bytes_reserved, 0u);
    auto const b = f->allocate(5 * MiB);  // a new growable segment
    CHECK(f.drv.accessible(0, b, 5 * MiB));
    CHECK_EQ(consistency(f), "");
  }
  {
    fixture f;
    auto const g0 = f->generation();
    auto const a  = f->allocate(5 * MiB);
    f.controls().reset();  // a is live: its segment is retired, its pages stay mapped
    CHECK(f.drv.accessible(0, a, 5 * MiB));
    CHECK_EQ(f->stats().bytes_reserved, 0u);
    f->deallocate(a, legacy_stream, gen(g0));
    auto const b = f->allocate(5 * MiB);
    CHECK_NE(b, a);
  }
  {
    auto f = std::make_unique<fixture>();
    (void)(*f)->allocate(5 * MiB);
    (void)(*f)->allocate(50 * MiB);
    f->pool.reset();  // the destructor unmaps and frees the reservation
    CHECK_EQ(f->drv.stats().live_mappings, 0u);
    CHECK_EQ(f->drv.stats().live_reservations, 0u);
  }
}

TEST(growable_fuzz_live_and_pending_blocks_stay_mapped)
{
  fixture f{growable_options(512 * MiB)};
  std::mt19937_64 rng{20240601};
  std::uniform_real_distribution<double> logsize{8.0, 26.0};  // 256 B .. 64 MiB
  struct live_block {
    device_ptr ptr;
    std::size_t size;
  };
  std::vector<live_block> live, pending;
  for (int op = 0; op < 4000; ++op) {
    auto const r     = rng() % 100;
    auto const waits = f.drv.stats().event_syncs + f.drv.stats().device_syncs;
    if (r < 50 || live.empty()) {
      auto const n   = static_cast<std::size_t>(std::exp2(logsize(rng)));
      auto const tag = static_cast<alloc_tag>(rng() % alloc_tag_count);
      auto const stream = (rng() % 3 == 0) ? stream_handle{0x5000} : legacy_stream;
      try {
        live.push_back({f->allocate(n, stream, tag), n});
      } catch (out_of_memory const&) {
      }
    } else if (r < 95) {
      auto const i = rng() % live.size();
      f->deallocate(live[i].ptr, rng() % 2 ? legacy_stream : allocation_stream);
      pending.push_back(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (r < 98) {
      f.drv.complete_all_events();
      pending.clear();
    } else {
      (void)f->trim();
      pending.clear();
    }
    // The pool waited for the GPU (the ladder, a dormant fence): what was pending may be free
    // now, and so may be unmapped. Only blocks freed after that are checked.
    if (f.drv.stats().event_syncs + f.drv.stats().device_syncs != waits) { pending.clear(); }
    for (auto const& b : live) {
      REQUIRE(f.drv.accessible(0, b.ptr, b.size));
    }
    for (auto const& b : pending) {
      REQUIRE(f.drv.accessible(0, b.ptr, b.size));
    }
    if (op % 97 == 0) { REQUIRE(consistency(f) == ""); }
  }
  for (auto const& b : live) { f->deallocate(b.ptr); }
  (void)f->trim();
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(consistency(f), "");
}
