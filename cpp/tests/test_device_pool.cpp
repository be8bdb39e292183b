// Tests of device_pool over host_driver: the pool logic without a GPU.
//
// host_driver's events are incomplete from the moment they are recorded until the test calls
// complete_all_events() (or a synchronize/drain waits on them), so every test below controls
// exactly when "the GPU caught up". An event is recorded for a freed block only at the next
// maintenance, which an allocation miss (or open_batch_limit) triggers: "force a miss" below
// means an allocation that no free block can serve.
//
// Every test runs twice (pool_fixture.hpp): on the pool's default segments, where requests above
// 1 MiB share the growable segment, and under --variant=fixed on fixed segments. Where the two
// kinds differ in a number (the growable segment is one address reservation, counted as one
// segment, whose memory comes and goes in 20 MiB pages), a test says both, branching on
// test::growable_run(); a test that holds for one kind only says so with TEST_ONLY.
#include "check.hpp"
#include "pool_fixture.hpp"

#include <emmpool/detail/address_map.hpp>
#include <emmpool/detail/pool_mutex.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/host_driver.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

using namespace emmpool;
using emmpool::test::gen;
using emmpool::test::lib;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
// A block that shares its memory with no other: on fixed segments an exact-size segment of its
// own (larger than large_segment / 2), on the growable segment one whole page (the default
// growable_page_size), mapped with no room beyond it (growable_room is no larger). Handy to
// control segments and pages one by one.
constexpr std::size_t big = 20 * MiB;
constexpr stream_handle stream_a = 0x5000;  // two non-default streams (opaque to host_driver)
constexpr stream_handle stream_b = 0x6000;

std::size_t rounded(std::size_t n) { return block_bytes(n); }

using fixture = test::pool_fixture;

/// byte_accounting(), and: the tags add up; the driver holds exactly the segments the pool
/// thinks it holds (when no segment was retired by a reset): its fixed ones and, on growable
/// segments, the growable segment's address reservation; a run on fixed segments maps no page.
std::string consistency(fixture& f, bool driver_matches = true)
{
  auto const s = f->stats();
  auto const c = f.drv.stats();
  std::string problems = test::byte_accounting(s, c, driver_matches);
  std::size_t by_tag = 0;
  for (auto b : s.bytes_in_use_by_tag) { by_tag += b; }
  if (by_tag != s.bytes_in_use) { problems += "bytes_in_use_by_tag do not add up; "; }
  if (s.largest_free_block > s.bytes_free) { problems += "largest_free_block > bytes_free; "; }
  if (s.peak_bytes_in_use < s.bytes_in_use) { problems += "peak_bytes_in_use < bytes_in_use; "; }
  if (s.peak_bytes_reserved < s.bytes_reserved) {
    problems += "peak_bytes_reserved < bytes_reserved; ";
  }
  if (driver_matches) {
    if (!test::growable_run() && c.bytes_mapped != 0) {
      problems += "driver maps " + std::to_string(c.bytes_mapped) + " bytes, no page expected; ";
    }
    if (c.live_segments + c.live_reservations != s.segments) {
      problems += "driver has " + std::to_string(c.live_segments) + " segments and " +
                  std::to_string(c.live_reservations) + " reservations, pool " +
                  std::to_string(s.segments) + " segments; ";
    }
  }
  return problems;
}

bool within(device_ptr p, device_ptr base, std::size_t size) { return p >= base && p < base + size; }

/// Memory the driver made for the pool: fixed segments (cuMemAlloc) and growable pages
/// (cuMemCreate). A `big` block is one of either.
std::uint64_t driver_makes(fixture& f)
{
  auto const c = f.drv.stats();
  return c.allocations + c.creates;
}

/// Memory the pool gave back to the driver: fixed segments (cuMemFree) and growable pages
/// (cuMemRelease).
std::uint64_t driver_frees(fixture& f)
{
  auto const c = f.drv.stats();
  return c.deallocations + c.releases;
}

/// On growable segments, lift the pool's peak reserved bytes to `bytes` (grown that far, then
/// trimmed). A request whose new pages would pass the peak first waits for the pending frees of
/// its own stream that could cover them (device_pool::claim_and_map): there a freed block comes
/// back at the next miss, fenced by that wait. The tests of which fence covers which free want
/// such a miss to grow instead, as fixed segments' growth (which never waits) does, and as a
/// growable segment's does below its peak. Each fence it takes counts in the pool's statistics:
/// those tests count from after it.
void lift_peak(fixture& f, std::size_t bytes)
{
  if (!test::growable_run()) { return; }
  f->deallocate(f->allocate(bytes));
  (void)f->trim();
}

}  // namespace

// ---- alignment and sizes -----------------------------------------------------------------------

TEST(alignment_and_rounding)
{
  fixture f;
  std::size_t const sizes[] = {0,       1,       255,          256,     257,         1000,
                               4096,    65535,   MiB - 1,      MiB,     MiB + 1,     3 * MiB + 5,
                               10 * MiB, 11 * MiB + 7, 33 * MiB + 1};
  std::size_t expected_in_use = 0;
  std::vector<device_ptr> ptrs;
  for (auto n : sizes) {
    auto const p = f->allocate(n);
    CHECK_EQ(p % device_pool::alignment, 0u);
    CHECK(p != 0);
    ptrs.push_back(p);
    expected_in_use += rounded(n);
    CHECK_EQ(f->stats().bytes_in_use, expected_in_use);
  }
  // No two blocks overlap (rounded extents).
  std::vector<std::pair<device_ptr, std::size_t>> extents;
  for (std::size_t i = 0; i < ptrs.size(); ++i) { extents.emplace_back(ptrs[i], rounded(sizes[i])); }
  std::sort(extents.begin(), extents.end());
  for (std::size_t i = 1; i < extents.size(); ++i) {
    CHECK(extents[i - 1].first + extents[i - 1].second <= extents[i].first);
  }
  CHECK_EQ(consistency(f), "");
  for (auto p : ptrs) { f->deallocate(p); }
  CHECK_EQ(f->stats().bytes_in_use, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(address_map_matches_unordered_map)
{
  // The live-block map against std::unordered_map under random inserts, lookups and erases:
  // clustered keys (the pool's addresses are 256 apart) and scattered ones, rehashes, and
  // backward-shift erases across the end of the array.
  emmpool::detail::address_map<int*> map;
  std::unordered_map<std::uint64_t, int*> ref;
  std::mt19937_64 rng{7};
  int dummy[1];
  for (int step = 0; step < 200000; ++step) {
    std::uint64_t const key = (rng() % 4 == 0 ? rng() : rng() % 4096) * 256;
    switch (rng() % 3) {
      case 0: CHECK_EQ(map.emplace(key, dummy), ref.emplace(key, dummy).second); break;
      case 1: {
        auto it = map.find(key);
        CHECK_EQ(it != map.end(), ref.count(key) == 1);
        if (it != map.end()) {
          CHECK_EQ(it->first, key);
          map.erase(it);
          ref.erase(key);
        }
        break;
      }
      default: CHECK_EQ(map.count(key), ref.count(key));
    }
    CHECK_EQ(map.size(), ref.size());
    if (step % 50000 == 0) { map.reserve(3000); }
  }
  std::size_t seen = 0;
  for (auto& [key, value] : map) {
    CHECK(ref.count(key) == 1 && value == dummy);
    ++seen;
  }
  CHECK_EQ(seen, ref.size());
  map.clear();
  CHECK(map.empty() && map.begin() == map.end());
}

TEST(zero_byte_requests_give_distinct_blocks)
{
  fixture f;
  std::set<device_ptr> seen;
  for (int i = 0; i < 100; ++i) {
    auto const p = f->allocate(0);
    CHECK(seen.insert(p).second);
    CHECK_EQ(p % 256, 0u);
  }
  CHECK_EQ(f->stats().bytes_in_use, 100u * 256u);
  CHECK_EQ(f->stats().blocks_in_use, 100u);
  // 256 bytes apart, from one small segment: each really is a 256-byte block.
  CHECK_EQ(*seen.rbegin() - *seen.begin(), 99u * 256u);
  for (auto p : seen) { f->deallocate(p); }
}

TEST(invalid_options_and_arguments)
{
  host_driver drv;
  pool_options o;
  o.maximum_fraction = 1.5;
  CHECK_THROWS(device_pool(drv, 0, o), std::invalid_argument);
  o                = {};
  o.small_request  = 1000;  // not a multiple of 256
  CHECK_THROWS(device_pool(drv, 0, o), std::invalid_argument);
  o                = {};
  o.maximum_size   = 4 * MiB;
  o.initial_size   = 8 * MiB;
  CHECK_THROWS(device_pool(drv, 0, o), std::invalid_argument);
  o = {};
  CHECK_THROWS(device_pool(drv, -1, o), std::invalid_argument);
  device_pool pool{drv, 0, test::for_this_run(o)};
  CHECK_THROWS(pool.allocate(~std::size_t{0}), std::invalid_argument);
  CHECK_THROWS(pool.allocate(256, legacy_stream, static_cast<alloc_tag>(7)), std::invalid_argument);
  CHECK_THROWS(pool_controls{pool}.defer_cleanup_end(), std::invalid_argument);
  CHECK_THROWS(pool.record_stream(0x1234, stream_a), pool_error);
}

TEST(initial_size_reserves_one_segment)
{
  pool_options o;
  o.initial_size = 5 * MiB;  // rounded to the 2 MiB granularity
  fixture f{o};
  CHECK_EQ(f->stats().bytes_reserved, 6 * MiB);
  CHECK_EQ(f->stats().segments, 1u);
  CHECK_EQ(f->stats().bytes_free, 6 * MiB);
  auto const p = f->allocate(4 * MiB);  // served from the initial segment: no growth (no page
  CHECK_EQ(driver_makes(f), 1u);        // either: requests of every size use it first)
  f->deallocate(p);
  CHECK_EQ(consistency(f), "");
}

// ---- splitting and coalescing ------------------------------------------------------------------

TEST(split_and_coalesce_within_a_segment)
{
  fixture f;
  auto const a = f->allocate(1000);  // 1024
  auto const b = f->allocate(3000);  // 3072
  auto const c = f->allocate(5000);  // 5120
  CHECK_EQ(b, a + 1024);             // adjacent: carved from one segment
  CHECK_EQ(c, b + 3072);
  auto s = f->stats();
  CHECK_EQ(s.segments, 1u);
  CHECK_EQ(s.bytes_reserved, 2 * MiB);
  std::size_t const tail = 2 * MiB - 1024 - 3072 - 5120;
  CHECK_EQ(s.bytes_free, tail);
  CHECK_EQ(s.largest_free_block, tail);

  // Free the middle block first, then its neighbours: coalescing must happen both ways.
  f->deallocate(b);
  f->deallocate(a);
  f->deallocate(c);
  s = f->stats();
  CHECK_EQ(s.bytes_waiting, 9216u);
  CHECK_EQ(s.bytes_free, tail);  // nothing returns before its event completes

  auto const miss1 = f->allocate(big);  // miss: records the event of the three frees
  f.drv.complete_all_events();
  s = f->stats();
  CHECK_EQ(s.bytes_waiting, 9216u);      // completed, but not promoted until maintenance
  auto const miss2 = f->allocate(big);  // miss: maintenance promotes and coalesces
  s = f->stats();
  CHECK_EQ(s.bytes_waiting, 0u);
  // The small segment, and the misses' two segments, or the growable segment (one reservation,
  // one page each) whose pages the misses fill: nothing free but the small segment.
  CHECK_EQ(s.segments, test::growable_run() ? 2u : 3u);
  CHECK_EQ(s.bytes_free, 2 * MiB);
  CHECK_EQ(s.largest_free_block, 2 * MiB);  // one block spans the small segment again
  // And it is handed out from the segment's start again.
  auto const whole = f->allocate(MiB);
  CHECK_EQ(whole, a);
  f->deallocate(whole);
  f->deallocate(miss1);
  f->deallocate(miss2);
  f->synchronize();
  // Two segments of their own; or two neighbouring pages, which coalesce into one block.
  CHECK_EQ(f->stats().largest_free_block, test::growable_run() ? 2 * big : big);
  CHECK_EQ(consistency(f), "");
}

TEST(partial_coalescing_and_best_fit)
{
  fixture f;
  auto const a = f->allocate(1024);
  auto const b = f->allocate(2048);
  auto const c = f->allocate(1024);
  (void)b;
  f->deallocate(a);  // a: bounded by the segment start and b (live): stays 1024
  f->deallocate(c);  // c: merges with the free tail
  f->synchronize();
  auto const s = f->stats();
  CHECK_EQ(s.bytes_free, 2 * MiB - 2048);
  CHECK_EQ(s.largest_free_block, 2 * MiB - 4096 + 1024);
  // Best fit: a 1 KiB request takes the 1 KiB hole, not the tail.
  CHECK_EQ(f->allocate(1024), a);
  // The next one comes from the start of the tail, where c was.
  CHECK_EQ(f->allocate(512), c);
  CHECK_EQ(consistency(f), "");
}

TEST(small_and_large_requests_use_separate_segments)
{
  fixture f;
  auto const l = f->allocate(2 * MiB);  // large: a 20 MiB segment (or page), 18 MiB free
  CHECK_EQ(f->stats().bytes_reserved, 20 * MiB);
  auto const s = f->allocate(256);  // small: never carved from a large segment
  CHECK_EQ(f->stats().bytes_reserved, 22 * MiB);
  CHECK(!within(s, l, 20 * MiB));
  f->deallocate(l);
  f->deallocate(s);
}

// ---- the reuse rule --------------------------------------------------------------------------

TEST(no_reuse_before_the_event_completes)
{
  fixture f;
  std::size_t const n = 4096;
  auto const p = f->allocate(n);
  f->deallocate(p);
  std::vector<device_ptr> held;
  // Many same-size and smaller requests, with many misses (maintenance records events), and
  // frees of other blocks in between: the freed block must never come back, not even in part.
  for (int i = 0; i < 3000; ++i) {
    auto const q = f->allocate(i % 3 == 0 ? 256 : n);
    CHECK(!within(q, p, n));
    if (i % 7 == 0) {
      f->deallocate(q);
    } else {
      held.push_back(q);
    }
    if (i % 500 == 0) { (void)f->allocate(big); }  // large misses too (held: leaked until trim)
  }
  CHECK(f->stats().segments > 3);  // several small segments: there were misses
  CHECK(f->stats().batches_closed > 0);
  f.drv.complete_all_events();
  (void)f->allocate(big);  // a miss: promotes what has completed
  // p is reusable now: best fit reaches p's hole once the smaller (or equal, lower) holes
  // left by the frees above are taken.
  bool reused = false;
  for (int i = 0; i < 5000 && !reused; ++i) { reused = f->allocate(n) == p; }
  CHECK(reused);
  CHECK_EQ(consistency(f), "");
}

TEST(event_must_be_recorded_after_the_free)
{
  fixture f;
  lift_peak(f, 8 * big);  // misses grow: they wait for no fence
  auto const p1 = f->allocate(big);
  auto const p2 = f->allocate(big);
  f->deallocate(p1);
  auto const m1 = f->allocate(big);  // miss: records E1 covering p1 only
  CHECK(m1 != p1);
  f->deallocate(p2);                   // freed after E1 was recorded
  f.drv.complete_all_events();          // E1 completes
  auto const m2 = f->allocate(big);    // miss: records E2 (incomplete) for p2, promotes p1
  CHECK_EQ(m2, p1);
  auto const m3 = f->allocate(big);    // p2 is not reusable: E2 has not completed
  CHECK(m3 != p2);
  CHECK_EQ(f->stats().bytes_waiting, big);
  f.drv.complete_all_events();
  auto const m4 = f->allocate(big);
  CHECK_EQ(m4, p2);
  CHECK_EQ(consistency(f), "");
}

TEST(a_miss_asks_earlier_fences_before_recording_its_own)
{
  // An event just recorded has not completed on a GPU: a miss asks the fences recorded before
  // and, when one of them handed blocks back, leaves its own new fence for the next miss
  // (fence_queue::poll). One cuEventQuery per miss, not two.
  fixture f;
  lift_peak(f, 8 * big);  // misses grow: they wait for no fence
  auto const before = f->stats();
  auto const p1     = f->allocate(big);
  auto const p2     = f->allocate(big);
  f->deallocate(p1);
  auto const m1 = f->allocate(big);  // miss: records E1 (p1), asks it too (nothing else)
  CHECK(m1 != p1);
  CHECK_EQ(f->stats().fence_queries - before.fence_queries, 1u);
  f->deallocate(p2);
  f.drv.complete_all_events();  // E1 completes
  auto const queries = f.drv.stats().event_queries;
  auto const m2      = f->allocate(big);  // miss: asks E1 (p1 back), records E2 (p2), asks it not
  CHECK_EQ(m2, p1);
  CHECK_EQ(f.drv.stats().event_queries - queries, 1u);
  CHECK_EQ(f->stats().fence_queries - before.fence_queries, 2u);
  CHECK_EQ(f->stats().batches_closed - before.batches_closed, 2u);
  CHECK_EQ(f->stats().bytes_waiting, big);  // p2 waits for E2, complete or not
  f.drv.complete_all_events();
  CHECK_EQ(f->allocate(big), p2);  // the next miss asks E2
  for (auto q : {m1, m2, p2}) { f->deallocate(q); }
  CHECK_EQ(consistency(f), "");

  // Nothing earlier completed: the new fence is asked at once, and on an idle GPU (here the
  // host driver completing events as they are recorded) its block comes back without growth.
  fixture g;
  g.drv.set_auto_complete(true);
  auto const p = g->allocate(big);
  g->deallocate(p);
  CHECK_EQ(g->allocate(big), p);
  CHECK_EQ(driver_makes(g), 1u);
  CHECK_EQ(g->stats().fence_queries, 1u);
}

TEST(streams_fence_independently)
{
  // A stream's frees are fenced on that stream, at an allocation on it (the moment it is sure
  // to be alive): an allocation elsewhere leaves them open (reuse_rule.hpp).
  fixture f;
  auto const pa = f->allocate(big, stream_a);
  auto const pb = f->allocate(big, stream_b);
  f->deallocate(pa, stream_a);
  f->deallocate(pb, stream_b);
  auto const before = f.drv.stats().event_records;
  auto const m = f->allocate(big);  // miss on the legacy stream: neither stream is touched
  CHECK_EQ(f.drv.stats().event_records - before, 0u);
  auto const ma = f->allocate(big + 256 * KiB, stream_a);  // miss on stream_a: its fence only
  CHECK_EQ(f.drv.stats().event_records - before, 1u);
  auto const mb = f->allocate(big + 256 * KiB, stream_b);  // and stream_b's
  CHECK_EQ(f.drv.stats().event_records - before, 2u);
  CHECK_EQ(f->stats().batches_closed, 2u);
  f.drv.complete_all_events();
  std::set<device_ptr> got{f->allocate(big), f->allocate(big)};
  CHECK(got.count(pa) == 1);
  CHECK(got.count(pb) == 1);
  for (auto q : got) { f->deallocate(q); }
  for (auto q : {m, ma, mb}) { f->deallocate(q); }
  CHECK_EQ(consistency(f), "");
}

TEST(same_stream_reuse_is_unfenced_and_stream_local)
{
  fixture f;
  auto const p = f->allocate(big, stream_a);
  f->deallocate(p, stream_a);
  auto const records = f.drv.stats().event_records;
  CHECK(f->allocate(big, stream_b) != p);        // another stream: only after the fence
  CHECK(f->allocate(big) != p);                  // no stream named: likewise
  CHECK_EQ(f->allocate(big, stream_a), p);       // the same stream: at once, stream order
  CHECK_EQ(f->stats().same_stream_reuses, 1u);
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  auto const q = f->allocate(big);               // a free that names no stream ...
  f->deallocate(q);
  CHECK(f->allocate(big, stream_a) != q);        // ... is never taken unfenced
  auto const r = f->allocate(big, stream_a);
  f->deallocate(r, allocation_stream);           // queued on the allocation's stream ...
  CHECK(f->allocate(big, stream_b) != r);
  CHECK_EQ(f->allocate(big, stream_a), r);       // ... so stream_a, and only it, takes it back
  CHECK_EQ(f->stats().same_stream_reuses, 2u);
  CHECK(f.drv.stats().event_records > records);  // the other requests closed fences meanwhile
  CHECK_EQ(consistency(f), "");
}

TEST(try_paths_take_no_cuda_call_and_leave_the_rest_to_the_full_calls)
{
  fixture f;
  auto const before = f.drv.stats();
  CHECK(!f->try_allocate(big, legacy_stream, alloc_tag::numba));  // would need a segment (page)
  CHECK_EQ(f.drv.stats().allocations, before.allocations);
  CHECK_EQ(f.drv.stats().live_reservations, before.live_reservations);
  CHECK_EQ(f.drv.stats().creates, before.creates);
  CHECK_EQ(f.drv.stats().maps, before.maps);
  auto const p = f->allocate(big, stream_a, alloc_tag::cupy);
  // Naming another stream asks its id; the allocation's asks nothing.
  CHECK(!f->try_deallocate(p, stream_b, gen(f->generation())));
  CHECK(f->try_deallocate(p, stream_a, gen(f->generation())));
  auto const records = f.drv.stats().event_records;
  auto const q       = f->try_allocate(big, stream_a, alloc_tag::cupy);  // stream order
  CHECK(q.has_value() && *q == p);
  CHECK(!f->try_allocate(big, stream_b, alloc_tag::cupy));  // another stream: needs a fence
  CHECK_EQ(f.drv.stats().event_records, records);
  // A block from before a reset: its free may call CUDA (its segment is retired), so no.
  f.controls().reset();
  CHECK(!f->try_deallocate(p, stream_a, gen(f->generation() - 1)));
  f->deallocate(p, stream_a, gen(f->generation() - 1));
  // Past the open-batch limit, fencing (CUDA) comes first: only allocate() does it.
  pool_options o;
  o.open_batch_limit = 1 * MiB;
  fixture g{o};
  auto const a = g->allocate(2 * MiB);
  auto const b = g->allocate(64 * KiB);
  g->deallocate(a);
  CHECK(!g->try_allocate(64 * KiB, legacy_stream, alloc_tag::other));
  CHECK(g->allocate(64 * KiB) != a);
  g->deallocate(b);
  CHECK_EQ(consistency(f, false), "");
  CHECK_EQ(consistency(g), "");
}

TEST(allocate_after_a_try_miss_sees_what_changed_since)
{
  // The binding's pair: try_allocate() misses, allocate() goes on where it left off. It skips
  // the search only while nothing could have changed its result.
  fixture f;
  auto const a = f->allocate(big, legacy_stream, alloc_tag::numba);
  f->deallocate(a);  // pending: its fence is recorded at the next miss
  CHECK(!f->try_allocate(big, legacy_stream, alloc_tag::numba));
  f.drv.set_auto_complete(true);  // the fence completes as soon as it is recorded
  // Nothing changed: no second search, but the ladder's first step still fences and finds a.
  CHECK_EQ(f->allocate(big, legacy_stream, alloc_tag::numba), a);
  CHECK_EQ(driver_makes(f), 1u);

  // A free between the two calls: allocate() searches again and takes it in stream order.
  auto const b = f->allocate(big, stream_a, alloc_tag::cupy);
  CHECK(!f->try_allocate(big, stream_a, alloc_tag::cupy));  // needs a segment
  f->deallocate(b, stream_a);
  CHECK_EQ(f->allocate(big, stream_a, alloc_tag::cupy), b);
  CHECK_EQ(f->stats().same_stream_reuses, 1u);
  CHECK_EQ(driver_makes(f), 2u);

  // Another request than the one that missed is checked and searched as any other.
  CHECK(!f->try_allocate(big, legacy_stream, alloc_tag::numba));
  CHECK_THROWS(f->allocate(big, allocation_stream, alloc_tag::numba), std::invalid_argument);
  CHECK_THROWS(f->allocate(big, legacy_stream, static_cast<alloc_tag>(9)), std::invalid_argument);
  auto const c = f->allocate(big, legacy_stream, alloc_tag::other);
  CHECK_EQ(driver_makes(f), 3u);
  f->deallocate(a);
  f->deallocate(b, stream_a);
  f->deallocate(c);
  CHECK_EQ(consistency(f), "");
}

TEST(auto_complete_reuses_at_the_next_miss)
{
  fixture f;
  f.drv.set_auto_complete(true);
  auto const p = f->allocate(big);
  f->deallocate(p);
  CHECK_EQ(f->allocate(big), p);
  CHECK_EQ(driver_makes(f), 1u);
  CHECK_EQ(f.drv.stats().event_syncs, 0u);  // no waiting: the event had completed
}

TEST(open_batch_limit_closes_batches_without_a_miss)
{
  pool_options o;
  o.open_batch_limit = 64 * KiB;
  fixture f{o};
  std::vector<device_ptr> ps;
  for (int i = 0; i < 40; ++i) { ps.push_back(f->allocate(4 * KiB)); }
  for (auto p : ps) { f->deallocate(p); }  // 160 KiB waiting in the open batch
  CHECK_EQ(f->stats().batches_closed, 0u);
  auto const q = f->allocate(256);  // no miss, but past the limit: the batch is closed
  CHECK_EQ(f->stats().batches_closed, 1u);
  CHECK(std::find(ps.begin(), ps.end(), q) == ps.end());  // closed is not completed
  f->deallocate(q);
}

// ---- record_stream: two fences ----------------------------------------------------------------

TEST(record_stream_needs_two_fences)
{
  fixture f;
  lift_peak(f, 8 * big);  // misses grow: they wait for no fence
  // Control: without record_stream, one completed event makes the block reusable.
  {
    auto const p = f->allocate(big);
    f->deallocate(p, legacy_stream);
    auto const m = f->allocate(big);  // miss: records the fence
    f.drv.complete_all_events();
    CHECK_EQ(f->allocate(big), p);  // miss: promoted
    f->deallocate(m);
    f->synchronize();
    f->trim();
  }
  auto const p = f->allocate(big);
  f->record_stream(p, stream_b);
  auto const records0 = f.drv.stats().event_records;
  f->deallocate(p, legacy_stream);  // fence 1 recorded on stream_b in the free itself
  CHECK_EQ(f.drv.stats().event_records - records0, 1u);

  auto const m1 = f->allocate(big);  // miss: fence 1 not complete
  CHECK(m1 != p);
  f.drv.complete_all_events();       // first completion: stream_b caught up
  auto const m2 = f->allocate(big);  // miss: fence 1 promoted -> queued for the legacy fence
  CHECK(m2 != p);                    // NOT reusable after the first completion
  CHECK_EQ(f->stats().bytes_waiting, big);
  auto const m3 = f->allocate(big);  // miss: fence 2 recorded on the legacy stream
  CHECK(m3 != p);
  CHECK_EQ(f.drv.stats().event_records - records0, 2u);
  f.drv.complete_all_events();       // second completion
  auto const m4 = f->allocate(big);  // miss: promoted, reusable now
  CHECK_EQ(m4, p);
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  for (auto q : {m1, m2, m3, m4}) { f->deallocate(q); }
  CHECK_EQ(consistency(f), "");
}

TEST(record_stream_on_the_stream_of_the_free_is_one_fence)
{
  fixture f;
  auto const p = f->allocate(big, stream_a);
  f->record_stream(p, stream_a);
  auto const records0 = f.drv.stats().event_records;
  f->deallocate(p, stream_a);
  CHECK_EQ(f.drv.stats().event_records, records0);  // not in the free: one fence, later
  (void)f->allocate(big + 256 * KiB, stream_a);      // a miss on stream_a records it
  CHECK_EQ(f.drv.stats().event_records - records0, 1u);
  f.drv.complete_all_events();
  CHECK_EQ(f->allocate(big), p);
}

TEST(record_stream_then_synchronize_waits_for_both_fences)
{
  fixture f;
  auto const p = f->allocate(big);
  f->record_stream(p, stream_b);
  f->deallocate(p, legacy_stream);
  f->synchronize();  // "wait for every pending free and make those blocks reusable"
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  CHECK_EQ(f->stats().bytes_free, big);
  auto const made = driver_makes(f);
  CHECK_EQ(f->allocate(big), p);
  CHECK_EQ(driver_makes(f), made);
  f->deallocate(p);
  CHECK_THROWS(f->record_stream(p, stream_b), pool_error);  // p is not live any more
  CHECK_EQ(consistency(f), "");
}

TEST(record_stream_then_trim_returns_everything)
{
  fixture f;
  auto const p = f->allocate(big);
  auto const q = f->allocate(300);
  f->record_stream(p, stream_b);
  f->record_stream(q, stream_a);
  f->deallocate(p, legacy_stream);
  f->deallocate(q, stream_b);
  CHECK_EQ(f->trim(), big + 2 * MiB);
  CHECK_EQ(f.drv.stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().live_segments, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
  CHECK_EQ(consistency(f), "");
}

// ---- growth policy and caps ------------------------------------------------------------------

// The sizes of the cuMemAlloc segments growth makes (pool_options::segment_size): fixed
// segments' policy. The growable segment grows in pages: growth_in_growable_pages.
TEST_ONLY(growth_segment_sizes, "fixed")
{
  fixture f;
  auto reserved = [&] { return f->stats().bytes_reserved; };
  // Small (<= 1 MiB): 2 MiB segments, shared.
  auto const s1 = f->allocate(MiB);
  CHECK_EQ(reserved(), 2 * MiB);
  auto const s2 = f->allocate(MiB);
  CHECK_EQ(reserved(), 2 * MiB);
  CHECK_EQ(s2, s1 + MiB);
  (void)f->allocate(1);
  CHECK_EQ(reserved(), 4 * MiB);
  // Mid-sized (1 MiB, 10 MiB]: 20 MiB segments, shared.
  auto const m1 = f->allocate(MiB + 1);
  CHECK_EQ(reserved(), 24 * MiB);
  auto const m2 = f->allocate(10 * MiB);
  CHECK_EQ(reserved(), 24 * MiB);
  CHECK_EQ(m2, m1 + MiB + 256);
  (void)f->allocate(10 * MiB);  // 9 MiB - 256 left in the first: a second 20 MiB segment
  CHECK_EQ(reserved(), 44 * MiB);
  // Big (> 10 MiB): an exact segment, rounded to 2 MiB.
  (void)f->allocate(10 * MiB + 1);
  CHECK_EQ(reserved(), 56 * MiB);
  (void)f->allocate(13 * MiB);
  CHECK_EQ(reserved(), 70 * MiB);
  (void)f->allocate(64 * MiB);
  CHECK_EQ(reserved(), 134 * MiB);
  CHECK_EQ(f->stats().segments, 7u);
  CHECK_EQ(f.drv.stats().allocations, 7u);
  CHECK_EQ(consistency(f), "");
}

// The requests of growth_segment_sizes with the default options: small ones as there; the
// rest share the growable segment, one after the other, which maps the 20 MiB pages they reach
// (its room, up to 20 MiB of the free block beyond a request, reaches no further page here).
TEST_ONLY(growth_in_growable_pages, "")
{
  fixture f;
  REQUIRE(f->growable());
  auto reserved = [&] { return f->stats().bytes_reserved; };
  auto const s1 = f->allocate(MiB);
  CHECK_EQ(reserved(), 2 * MiB);
  auto const s2 = f->allocate(MiB);
  CHECK_EQ(s2, s1 + MiB);
  (void)f->allocate(1);
  CHECK_EQ(reserved(), 4 * MiB);
  // Offsets in the reservation below, in MiB (+ 256 B per rounded request).
  auto const m1 = f->allocate(MiB + 1);  // [0, 1): page 0, [0, 20)
  CHECK_EQ(reserved(), 24 * MiB);
  auto const m2 = f->allocate(10 * MiB);  // [1, 11): page 0
  CHECK_EQ(m2, m1 + MiB + 256);
  CHECK_EQ(reserved(), 24 * MiB);
  auto const m3 = f->allocate(10 * MiB);  // [11, 21): page 1 too
  CHECK_EQ(m3, m2 + 10 * MiB);
  CHECK_EQ(reserved(), 44 * MiB);
  auto const m4 = f->allocate(10 * MiB + 1);  // [21, 31): page 1
  CHECK_EQ(m4, m3 + 10 * MiB);
  CHECK_EQ(reserved(), 44 * MiB);
  auto const m5 = f->allocate(13 * MiB);  // [31, 44): page 2
  CHECK_EQ(m5, m4 + 10 * MiB + 256);
  CHECK_EQ(reserved(), 64 * MiB);
  auto const m6 = f->allocate(64 * MiB);  // [44, 108): pages 3 to 5
  CHECK_EQ(m6, m5 + 13 * MiB);
  CHECK_EQ(reserved(), 124 * MiB);  // fixed segments: 134 MiB
  CHECK_EQ(f->stats().segments, 3u);  // two small segments and the reservation
  CHECK_EQ(f.drv.stats().allocations, 2u);
  CHECK_EQ(f.drv.stats().creates, 6u);
  CHECK_EQ(f->stats().page_maps, 6u);
  for (auto [p, n] : {std::pair{m1, MiB + 1}, {m2, 10 * MiB}, {m3, 10 * MiB},
                      {m4, 10 * MiB + 1}, {m5, 13 * MiB}, {m6, 64 * MiB}}) {
    CHECK(f.drv.accessible(0, p, n));
  }
  CHECK_EQ(consistency(f), "");
}

TEST(maximum_size_cap)
{
  pool_options o;
  o.maximum_size = 2 * big;  // two segments, or two pages, of a big block each
  fixture f{o};
  CHECK_THROWS(f->allocate(2 * big + MiB), out_of_memory);
  auto const a = f->allocate(big);
  auto const b = f->allocate(big);
  CHECK_EQ(f->stats().bytes_reserved, 40 * MiB);
  try {
    (void)f->allocate(256);  // needs a 2 MiB small segment: over the cap
    CHECK(false);
  } catch (out_of_memory const& e) {
    std::string const what = e.what();
    CHECK(what.find("cap 40.00 MiB") != std::string::npos);
  }
  CHECK_EQ(f->stats().out_of_memory, 2u);
  CHECK_EQ(driver_makes(f), 2u);  // the cap is checked before asking the driver
  // Usable after: free one (pending, incomplete), the ladder waits for it, releases its
  // segment (page) and grows a small one within the cap.
  f->deallocate(a);
  CHECK_EQ(f->stats().fence_waits, 0u);
  auto const s = f->allocate(256);
  CHECK_EQ(f->stats().fence_waits, 1u);
  CHECK_EQ(f->stats().bytes_reserved, big + 2 * MiB);
  CHECK_EQ(driver_frees(f), 1u);
  CHECK(f->stats().peak_bytes_reserved <= 2 * big);
  f->deallocate(s);
  f->deallocate(b);
  CHECK_EQ(consistency(f), "");
}

TEST(maximum_fraction_cap)
{
  pool_options o;
  o.maximum_fraction = 0.25;
  fixture f{o, 100 * MiB};  // cap: 25 MiB
  auto const a = f->allocate(24 * MiB);
  // The two 20 MiB pages it would take on the growable segment pass the cap: a fixed segment
  // of its size serves it there too.
  CHECK_EQ(f->stats().page_maps, 0u);
  CHECK_EQ(f.drv.stats().bytes_reserved, 24 * MiB);
  // A 2 MiB small segment would pass 25 MiB; a segment of just the request still fits.
  auto const small = f->allocate(MiB);
  CHECK_EQ(f->stats().bytes_reserved, 25 * MiB);
  CHECK_THROWS(f->allocate(256), out_of_memory);  // the cap is reached exactly
  CHECK_THROWS(f->allocate(26 * MiB), out_of_memory);
  f->deallocate(small);
  f->deallocate(a);
  auto const b = f->allocate(2 * MiB);  // after the ladder released a's segment
  CHECK(f->stats().peak_bytes_reserved <= 25 * MiB);
  f->deallocate(b);
  CHECK_EQ(consistency(f), "");
}

// ---- the out-of-memory ladder -----------------------------------------------------------------

TEST(out_of_memory_ladder_order)
{
  fixture f{{}, 2 * big};  // a device of 40 MiB
  auto const s = f->allocate(256);  // segment S: 2 MiB (small, fixed on either kind)
  auto const p = f->allocate(big);  // P: a segment of its own, or the growable segment's page
  f->deallocate(s);
  f->synchronize();  // S is wholly free, in the free lists
  auto const syncs0 = f.drv.stats().event_syncs;
  auto const made0  = driver_makes(f);
  auto const freed0 = driver_frees(f);

  // (a) A completed pending free is reused before growing (and without waiting).
  f.drv.set_auto_complete(true);
  f->deallocate(p);
  auto const q = f->allocate(big);
  CHECK_EQ(q, p);
  auto const syncs1 = f.drv.stats().event_syncs;
  CHECK_EQ(driver_makes(f), made0);
  CHECK_EQ(syncs1, syncs0);
  CHECK_EQ(driver_frees(f), freed0);
  f.drv.set_auto_complete(false);

  // (b) A pending (incomplete) free is waited for before giving up - and before releasing S.
  // (On the growable segment before growing even: new pages past the peak, which the frees
  // of the request's stream could cover, wait for them.)
  f->deallocate(q);
  auto const r = f->allocate(big);  // growing 20 MiB would exceed 40 MiB
  CHECK_EQ(r, p);
  auto const syncs2 = f.drv.stats().event_syncs;
  CHECK(syncs2 > syncs1);
  CHECK_EQ(f->stats().fence_waits, 1u);
  CHECK_EQ(driver_makes(f), made0);
  CHECK_EQ(driver_frees(f), freed0);  // S was not released: waiting sufficed

  // (c) Nothing fits even after waiting: wholly free memory goes back (S, and P's segment or
  // page), then growth to the request's size: an exact segment, or the two pages it reaches.
  f->deallocate(r);
  auto const t = f->allocate(38 * MiB);
  CHECK(f.drv.stats().event_syncs > syncs2);  // r's free was waited for first
  CHECK_EQ(f->stats().fence_waits, 2u);
  CHECK_EQ(driver_frees(f), freed0 + 2);  // S, and P's segment or page
  CHECK_EQ(driver_makes(f), made0 + (test::growable_run() ? 2 : 1));
  CHECK_EQ(f->stats().bytes_reserved, test::growable_run() ? 40 * MiB : 38 * MiB);
  CHECK_EQ(f->stats().segments, 1u);
  CHECK_EQ(consistency(f), "");

  // (d) Out of memory, with a message that says what the pool holds.
  try {
    (void)f->allocate(8 * MiB);
    CHECK(false);
  } catch (out_of_memory const& e) {
    std::string const what = e.what();
    CHECK(what.find("out of memory allocating 8.00 MiB") != std::string::npos);
    CHECK(what.find(test::growable_run() ? "holds 40.00 MiB in 1 segments"
                                         : "holds 38.00 MiB in 1 segments") != std::string::npos);
    CHECK(what.find("38.00 MiB in use") != std::string::npos);
    CHECK(what.find("waiting for pending frees") != std::string::npos);
  }
  CHECK_EQ(f->stats().out_of_memory, 1u);
  CHECK_EQ(consistency(f), "");

  // The pool still works: within what is left, and after freeing.
  auto const u = f->allocate(2 * MiB);  // a 20 MiB segment would not fit: exact 2 MiB does
  CHECK_EQ(f->stats().bytes_reserved, 40 * MiB);  // (on growable segments: t's second page)
  f->deallocate(t);
  f->deallocate(u);
  auto const v = f->allocate(8 * MiB);
  f->deallocate(v);
  f->trim();
  CHECK_EQ(f.drv.stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(out_of_memory_mid_size_falls_back_to_exact_growth)
{
  // On the growable segment too: a request that no page fits falls back to fixed segments.
  fixture f{{}, big + 8 * MiB};
  auto const p = f->allocate(big);
  auto const q = f->allocate(6 * MiB);  // 20 MiB would not fit; an exact 6 MiB segment does
  CHECK_EQ(f->stats().bytes_reserved, big + 6 * MiB);
  CHECK_EQ(f.drv.stats().bytes_reserved, test::growable_run() ? 6 * MiB : big + 6 * MiB);
  CHECK_EQ(consistency(f), "");
  f->deallocate(p);
  f->deallocate(q);
}

// ---- fault injection --------------------------------------------------------------------------

TEST(fault_failed_segment_allocation)
{
  fixture f;
  bool const growable = test::growable_run();
  if (growable) {
    f.drv.fail_next_creates(1);  // its page fails (cuMemCreate): a 20 MiB fixed segment serves it
  } else {
    f.drv.fail_next_allocations(1);  // 20 MiB growth fails; exact growth retried
  }
  auto const a = f->allocate(2 * MiB);
  CHECK_EQ(f->stats().bytes_reserved, growable ? 20 * MiB : 2 * MiB);
  CHECK_EQ(f.drv.stats().bytes_reserved, f->stats().bytes_reserved);
  CHECK_EQ(consistency(f), "");
  // Every attempt of the ladder fails: on fixed segments its growth and its exact growth; on
  // the growable segment, a page (the pages step, then again after giving memory back) and a
  // fixed segment (the growth step, then again after giving memory back): one try each.
  if (growable) { f.drv.fail_next_creates(2); }
  f.drv.fail_next_allocations(2);
  CHECK_THROWS(f->allocate(big), out_of_memory);
  CHECK_EQ(f->stats().out_of_memory, 1u);
  CHECK_EQ(consistency(f), "");
  auto const b = f->allocate(big);  // no more failures: a segment, or a page
  CHECK(f.drv.accessible(0, b, big));
  CHECK_EQ(f.drv.stats().live_mappings, growable ? 1u : 0u);
  f->deallocate(a);
  f->deallocate(b);
  f->trim();
  CHECK_EQ(f.drv.stats().live_segments, 0u);
  CHECK_EQ(f.drv.stats().live_mappings, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(fault_failed_event_record_keeps_blocks_fenced)
{
  fixture f;
  lift_peak(f, 8 * big);  // misses grow: they wait for no fence
  auto const p = f->allocate(big);
  f->deallocate(p);
  f.drv.fail_next_event_records(1);
  CHECK_THROWS(f->allocate(big), cuda_error);  // the miss's maintenance fails to record
  CHECK_EQ(f->stats().bytes_waiting, big);      // p stays waiting, unfenced
  CHECK_EQ(consistency(f), "");
  f.drv.complete_all_events();  // nothing recorded for p: must not free it
  auto const m = f->allocate(big);
  CHECK(m != p);
  f.drv.complete_all_events();
  CHECK_EQ(f->allocate(big), p);
  f->deallocate(m);
  f->deallocate(p);
  f.drv.fail_next_event_records(1);
  CHECK_THROWS(f->synchronize(), cuda_error);
  CHECK_NOTHROW(f->synchronize());
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  CHECK_EQ(f->trim(), 2 * big);  // p's and m's segments (pages): the failed miss did not grow
  CHECK_EQ(f.drv.stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
}

TEST(fault_random_injection_loses_nothing)
{
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    std::mt19937_64 rng{seed};
    fixture f{{}, 256 * MiB};
    std::vector<std::pair<device_ptr, std::size_t>> live;
    int ooms = 0, cuda_errors = 0;
    for (int i = 0; i < 3000; ++i) {
      auto const r = rng() % 100;
      if (r < 3) {  // cuMemAlloc and cuMemCreate (the one the run uses, but for small requests)
        auto const n = 1 + static_cast<int>(rng() % 3);
        f.drv.fail_next_allocations(n);
        f.drv.fail_next_creates(n);
      }
      if (r >= 3 && r < 6) {
        f.drv.fail_next_event_records(1);
        f.drv.fail_next_unmaps(1);  // growable pages given back or moved: they stay, counted
        f.drv.fail_next_maps(1);    // a cuMemMap refused (not out of memory): the request fails
      }
      if (r >= 6 && r < 10) { f.drv.complete_all_events(); }
      if (r >= 10 && r < 12) {  // memory goes back and comes again: segments, pages
        try {
          (void)f->trim();
        } catch (cuda_error const&) {  // a fence's event, or a segment's cuMemFree
          ++cuda_errors;
        }
      }
      if (live.size() > 40 || (!live.empty() && rng() % 2 == 0)) {
        auto const k = rng() % live.size();
        auto const p = live[k].first;
        live[k]      = live.back();
        live.pop_back();
        if (rng() % 4 == 0) { f->record_stream(p, stream_b); }
        f->deallocate(p, rng() % 3 == 0 ? stream_a : legacy_stream);
      } else {
        std::size_t const n = std::size_t{256} << (rng() % 17);  // 256 B .. 16 MiB
        try {
          live.emplace_back(f->allocate(n + rng() % 256), n);
        } catch (out_of_memory const&) {
          ++ooms;
        } catch (cuda_error const&) {
          ++cuda_errors;
        }
      }
      if (i % 97 == 0) {
        auto const problems = consistency(f);
        CHECK_EQ(problems, "");
        if (!problems.empty()) { break; }
        for (auto& [p, n] : live) { CHECK(f.drv.accessible(0, p, n)); }
      }
    }
    CHECK(cuda_errors > 0);  // the injections did hit
    for (auto& [p, n] : live) { f->deallocate(p); }
    f.drv.fail_next_allocations(0);
    f.drv.fail_next_event_records(0);
    f.drv.fail_next_creates(0);
    f.drv.fail_next_unmaps(0);
    f.drv.fail_next_maps(0);
    CHECK_EQ(f->stats().bytes_in_use, 0u);
    f->synchronize();
    f->trim();
    auto const c = f.drv.stats();
    CHECK_EQ(c.bytes_reserved, 0u);
    CHECK_EQ(c.live_segments, 0u);
    CHECK_EQ(c.bytes_physical, 0u);
    CHECK_EQ(f->stats().bytes_free, 0u);
    CHECK_EQ(consistency(f), "");
    f.pool.reset();  // destroying the pool destroys its events
    CHECK_EQ(f.drv.stats().live_events, 0u);
    (void)ooms;
  }
}

// ---- stream lifetime: a stream reaches the driver only while it is sure to be alive ---------------
//
// host_driver throws dead_stream_error (which the pool never catches) on any use of a destroyed
// stream's handle, and create_stream() reuses the last destroyed handle: each test below would
// fail on the first touch of a dead stream (reuse_rule.hpp, "stream lifetime").

namespace {

/// Allocate on a new stream, destroy the stream, then free as CuPy and PyTorch do (the free
/// names no stream, or the allocation's: allocation_stream).
device_ptr allocate_on_a_stream_that_dies(fixture& f, std::size_t n, alloc_tag tag)
{
  auto const s = f.drv.create_stream();
  auto const p = f->allocate(n, s, tag);
  f.drv.destroy_stream(s);
  f->deallocate(p, allocation_stream, lib(tag));
  return p;
}

}  // namespace

TEST(destroyed_stream_is_never_touched_cupy_and_torch_frees)
{
  for (auto mode : {pool_mode::pool, pool_mode::passthrough}) {
    pool_options o;
    o.mode = mode;
    fixture f{o};
    auto const pc = allocate_on_a_stream_that_dies(f, big, alloc_tag::cupy);
    auto const pt = allocate_on_a_stream_that_dies(f, 64 * KiB, alloc_tag::torch);
    auto const syncs = f.drv.stats().device_syncs;
    // Misses on the legacy stream, the null stream and a live stream: none may fence the dead
    // streams' batches on their handles, and the blocks stay pending (no fence covers them).
    auto const live = f.drv.create_stream();
    std::vector<device_ptr> got;
    for (auto s : {legacy_stream, stream_handle{0}, live}) {
      got.push_back(f->allocate(big, s));
      got.push_back(f->allocate(64 * KiB, s));
    }
    f.drv.complete_all_events();
    got.push_back(f->allocate(big));
    got.push_back(f->allocate(64 * KiB));
    CHECK(std::find(got.begin(), got.end(), pc) == got.end());
    CHECK(std::find(got.begin(), got.end(), pt) == got.end());
    CHECK_EQ(f.drv.stats().device_syncs, syncs);
    for (auto q : got) { f->deallocate(q); }
    f->synchronize();  // fences them with one device synchronization
    CHECK_EQ(f.drv.stats().device_syncs, syncs + 1);
    CHECK_EQ(f->stats().bytes_waiting, 0u);
    if (mode == pool_mode::pool) {
      CHECK_EQ(f->stats().dormant_fences, 1u);
      CHECK_EQ(f->allocate(big), pc);  // reusable now
    }
    CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
    CHECK_EQ(consistency(f), "");
  }
}

TEST(reused_stream_handle_is_another_stream)
{
  fixture f;
  auto const s1 = f.drv.create_stream();
  auto const p  = f->allocate(big, s1, alloc_tag::cupy);
  f->deallocate(p, allocation_stream, lib(alloc_tag::cupy));  // pending on s1
  f.drv.destroy_stream(s1);
  auto const s2 = f.drv.create_stream();
  CHECK_EQ(s2, s1);  // the driver reused the handle
  auto const records = f.drv.stats().event_records;
  // s2's work does not follow s1's: no stream order, and no event on s2 for s1's frees.
  auto const q = f->allocate(big, s2, alloc_tag::cupy);
  CHECK(q != p);
  CHECK_EQ(f->stats().same_stream_reuses, 0u);
  CHECK_EQ(f.drv.stats().event_records, records);
  // s2's own frees do go back to s2 in stream order.
  f->deallocate(q, allocation_stream, lib(alloc_tag::cupy));
  CHECK_EQ(f->allocate(big, s2, alloc_tag::cupy), q);
  CHECK_EQ(f->stats().same_stream_reuses, 1u);
  f->deallocate(q, s2);  // a free that names s2 (alive)
  f.drv.destroy_stream(s2);
  f->synchronize();
  CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(stream_order_needs_the_stream_alive_at_the_allocation)
{
  // The RMM pattern: the free names its (live) stream; the stream dies later; a block pending
  // on it is fenced only by the device synchronization, and is taken by nobody before that.
  fixture f;
  auto const s = f.drv.create_stream();
  auto const p = f->allocate(big, s, alloc_tag::rmm);
  f->deallocate(p, s);
  f.drv.destroy_stream(s);
  auto const q = f->allocate(big, stream_a);
  CHECK(q != p);
  f->deallocate(q, stream_a);
  f->trim();
  CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
  CHECK_EQ(f->stats().bytes_waiting, 0u);
}

TEST(dormant_frees_are_fenced_by_one_device_sync_past_the_limits)
{
  {  // past max_dormant streams
    fixture f;
    std::vector<device_ptr> freed;
    for (std::size_t i = 0; i <= reuse_rule::max_dormant; ++i) {
      freed.push_back(allocate_on_a_stream_that_dies(f, 4 * KiB, alloc_tag::cupy));
    }
    CHECK_EQ(f->stats().dormant_fences, 0u);
    auto const p = f->allocate(big);  // a miss: the dormant batches are too many
    CHECK_EQ(f->stats().dormant_fences, 1u);
    CHECK_EQ(f->stats().bytes_waiting, 0u);
    CHECK(std::find(freed.begin(), freed.end(), f->allocate(4 * KiB)) != freed.end());
    f->deallocate(p);
    CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
  }
  {  // past open_batch_limit bytes, at any allocation (not only a miss)
    pool_options o;
    o.open_batch_limit = 1 * MiB;
    fixture f{o};
    auto const keep = f->allocate(4 * KiB);
    (void)allocate_on_a_stream_that_dies(f, 2 * MiB, alloc_tag::torch);
    CHECK_EQ(f->stats().dormant_fences, 0u);
    f->deallocate(keep);
    f.drv.complete_all_events();
    (void)f->allocate(4 * KiB);  // not a miss (keep's block is back), but the limit is passed
    CHECK_EQ(f->stats().dormant_fences, 1u);
    CHECK_EQ(f->stats().bytes_waiting, 0u);
    CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
  }
}

TEST(out_of_memory_ladder_fences_dormant_frees)
{
  fixture f{{}, 3 * big};
  std::vector<device_ptr> held;
  held.push_back(f->allocate(big));
  held.push_back(f->allocate(big));
  auto const p = allocate_on_a_stream_that_dies(f, big, alloc_tag::cupy);
  CHECK_EQ(f->allocate(big), p);  // full: only waiting for every free makes room
  CHECK_EQ(f->stats().dormant_fences, 1u);
  CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
}

TEST(record_stream_fence_is_recorded_at_the_free)
{
  // record_stream's stream must live until the free, not after: its fence is recorded in the
  // free, and the stream may die right after.
  fixture f;
  auto const s = f.drv.create_stream();
  auto const p = f->allocate(big);
  f->record_stream(p, s);
  auto const records = f.drv.stats().event_records;
  f->deallocate(p);
  CHECK_EQ(f.drv.stats().event_records - records, 1u);
  f.drv.destroy_stream(s);
  std::vector<device_ptr> got;
  for (int i = 0; i < 4; ++i) {  // misses; both fences complete in turn
    got.push_back(f->allocate(big));
    f.drv.complete_all_events();
  }
  got.push_back(f->allocate(big));
  CHECK(std::find(got.begin(), got.end(), p) != got.end());
  CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
  for (auto q : got) { f->deallocate(q); }
  CHECK_EQ(consistency(f), "");
}

TEST(without_stream_ids_no_stream_is_named_after_its_call)
{
  // A driver without cuStreamGetId: a new stream under a dead one's handle cannot be told
  // apart, so no stream order, and no event on such a stream but in the call that names it.
  fixture f;
  f.drv.set_stream_ids(false);
  auto const s1 = f.drv.create_stream();
  auto const p  = f->allocate(big, s1, alloc_tag::cupy);
  f->deallocate(p, allocation_stream, lib(alloc_tag::cupy));
  CHECK(f->allocate(big, s1, alloc_tag::cupy) != p);  // even on the same live stream
  CHECK_EQ(f->stats().same_stream_reuses, 0u);
  f.drv.destroy_stream(s1);
  auto const s2 = f.drv.create_stream();  // s1's handle
  auto const q  = f->allocate(big + 256 * KiB, s2, alloc_tag::cupy);  // a miss on s2
  CHECK(q != p);
  f->record_stream(q, s2);
  f->deallocate(q);  // record_stream's fence: not on s2 either (its batch may hold s1's)
  f.drv.destroy_stream(s2);
  f->synchronize();  // the device synchronization fences them all
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
}

TEST(stream_lifetime_fuzz_no_dead_stream_use_no_early_reuse)
{
  // Clients as they behave: CuPy and PyTorch allocate on live streams (null, or their own)
  // and free naming none; RMM frees on a live stream it names; Numba on the legacy stream;
  // record_stream on a live stream that then lives until the free. Streams die at any time,
  // with their blocks alive or pending, and their handles are reused. Events never complete
  // by themselves, so a freed block may come back only (a) in the order of the very stream
  // instance it was freed on, while that stream is alive, or (b) after a device
  // synchronization issued after its free. Any other reuse, and any use of a dead stream
  // (dead_stream_error), fails. Stream order may hand out part of a pending block (split) or
  // several neighbours at once (merged): every pending block a new one overlaps is checked.
  for (auto mode : {pool_mode::pool, pool_mode::passthrough}) {
    std::size_t reshaped = 0;  // stream-order reuses of a pending block split or merged
    for (std::uint64_t seed = 1; seed <= 6; ++seed) {
      pool_options o;
      o.mode             = mode;
      o.open_batch_limit = 8 * MiB;
      fixture f{o};
      std::mt19937_64 rng{seed};
      struct stream_inst {
        stream_handle handle;
        bool alive;
        int pinned;  // record_stream'ed live blocks: must outlive their free
      };
      std::vector<stream_inst> streams{{0, true, 0}};  // instance 0: the null stream
      struct live_block {
        device_ptr p;
        std::size_t n;
        std::size_t inst;      // allocation stream instance; SIZE_MAX: legacy (Numba)
        std::size_t recorded;  // record_stream instance, or SIZE_MAX
      };
      constexpr std::size_t none = SIZE_MAX;
      struct pending_block {
        std::size_t n;
        std::size_t freed_inst;  // stream instance of the free, or none (legacy)
        std::uint64_t syncs;     // device syncs at the free
      };
      std::vector<live_block> live;
      std::map<device_ptr, pending_block> pending;
      std::size_t early = 0, checked = 0;
      auto live_streams = [&] {
        std::vector<std::size_t> v;
        for (std::size_t i = 0; i < streams.size(); ++i) {
          if (streams[i].alive) { v.push_back(i); }
        }
        return v;
      };
      for (int step = 0; step < 4000; ++step) {
        auto const r = rng() % 100;
        if (r < 4 && streams.size() < 400) {
          streams.push_back({f.drv.create_stream(), true, 0});
        } else if (r < 8) {
          auto v = live_streams();
          auto const i = v[rng() % v.size()];
          if (i != 0 && streams[i].pinned == 0) {
            f.drv.destroy_stream(streams[i].handle);
            streams[i].alive = false;
          }
        } else if (r < 10) {
          f->synchronize();
          pending.clear();  // everything fenced
        } else if (r < 55 || live.empty()) {
          auto v                = live_streams();
          bool const numba      = rng() % 4 == 0;
          std::size_t const ins = numba ? none : v[rng() % v.size()];
          std::size_t const n   = rounded(std::size_t{256} << (rng() % 13));  // 256 B .. 1 MiB
          auto const h          = numba ? legacy_stream : streams[ins].handle;
          auto const q          = f->allocate(n, h, numba ? alloc_tag::numba : alloc_tag::cupy);
          auto const syncs      = f.drv.stats().device_syncs;
          for (auto it = pending.begin(); it != pending.end();) {
            auto const& b = it->second;
            bool const overlaps = it->first < q + n && q < it->first + b.n;
            if (!overlaps) { ++it; continue; }
            ++checked;
            bool const fenced       = syncs > b.syncs;
            bool const stream_order = b.freed_inst != none && b.freed_inst == ins &&
                                      streams[ins].alive;
            if (!fenced && !stream_order) { ++early; }
            if (!fenced && (it->first != q || b.n != n)) { ++reshaped; }
            it = pending.erase(it);
          }
          std::size_t recorded = none;
          if (rng() % 8 == 0) {
            auto const j = v[rng() % v.size()];
            f->record_stream(q, streams[j].handle);
            if (streams[j].handle != 0) { ++streams[j].pinned; }
            recorded = j;
          }
          live.push_back({q, n, ins, recorded});
        } else {
          auto const k = rng() % live.size();
          auto const b = live[k];
          live[k]      = live.back();
          live.pop_back();
          std::size_t freed_inst = b.inst;
          if (b.inst == none) {
            f->deallocate(b.p);  // Numba: legacy
          } else if (rng() % 3 == 0 && streams[b.inst].alive) {
            f->deallocate(b.p, streams[b.inst].handle);  // RMM: names its live stream
          } else {
            f->deallocate(b.p, allocation_stream, lib(alloc_tag::cupy));
          }
          if (b.recorded != none) {
            // Two fences: never taken in stream order; one if it recorded the stream of the
            // free itself.
            if (b.recorded != freed_inst) { freed_inst = none; }
            if (streams[b.recorded].handle != 0) { --streams[b.recorded].pinned; }
          }
          pending[b.p] = {b.n, freed_inst, f.drv.stats().device_syncs};
        }
        if (step % 101 == 0) {
          auto const problems = consistency(f);
          CHECK_EQ(problems, "");
          if (!problems.empty()) { break; }
        }
      }
      CHECK_EQ(early, 0u);
      CHECK(checked > 0 || mode == pool_mode::passthrough);
      CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
      for (auto& b : live) { f->deallocate(b.p); }
      f->trim();
      CHECK_EQ(f.drv.stats().live_segments, 0u);
      CHECK_EQ(consistency(f), "");
    }
    CHECK(reshaped > 0 || mode == pool_mode::passthrough);
  }
}

// ---- trim and deferred cleanup ----------------------------------------------------------------

TEST(trim_releases_only_wholly_free_segments)
{
  fixture f;
  auto const s1 = f->allocate(256);
  auto const s2 = f->allocate(256);  // same small segment as s1
  auto const b1 = f->allocate(big);
  auto const b2 = f->allocate(big);
  f->deallocate(s2);
  f->deallocate(b1);
  CHECK_EQ(f->trim(), big);  // b1's segment (page); not s1's (s1 live), not b2's
  auto c = f.drv.stats();
  if (test::growable_run()) {  // b1's page goes; s1's small segment and b2's page stay
    CHECK_EQ(c.deallocations, 0u);
    CHECK_EQ(c.releases, 1u);
    CHECK_EQ(c.live_segments, 1u);
    CHECK_EQ(c.live_mappings, 1u);
    CHECK_EQ(f->stats().page_releases, 1u);
    CHECK(!f.drv.accessible(0, b1, big));
  } else {
    CHECK_EQ(c.deallocations, 1u);
    CHECK_EQ(c.live_segments, 2u);
    CHECK_EQ(f->stats().segment_releases, 1u);
  }
  CHECK(f.queries().owns(s1));
  CHECK(f.queries().owns(b2));
  CHECK(f.drv.accessible(0, b2, big));
  CHECK_EQ(f->trim(), 0u);
  f->deallocate(s1);
  f->deallocate(b2);
  CHECK_EQ(f->trim(), big + 2 * MiB);
  CHECK_EQ(f.drv.stats().live_segments, 0u);
  CHECK_EQ(f.drv.stats().live_mappings, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(defer_cleanup_blocks_driver_frees_not_reuse)
{
  fixture f{{}, big};  // a device that holds P alone
  auto const p = f->allocate(big);
  f.controls().defer_cleanup_begin();
  f.controls().defer_cleanup_begin();  // nests
  f->deallocate(p);
  CHECK_EQ(f->trim(), 0u);
  CHECK_EQ(driver_frees(f), 0u);
  CHECK_EQ(f->stats().bytes_free, big);  // trim still drained the queue
  CHECK_EQ(f->allocate(big), p);         // reusable while deferred
  f->deallocate(p);
  f->synchronize();
  // The ladder must not give memory back while deferred: a small request's segment needs P's
  // segment (page) back.
  CHECK_THROWS(f->allocate(256), out_of_memory);
  CHECK_EQ(driver_frees(f), 0u);
  f.controls().defer_cleanup_end();
  CHECK_EQ(f->trim(), 0u);  // still deferred (nested)
  f.controls().defer_cleanup_end();
  auto const q = f->allocate(256);  // now the ladder can give P's segment (page) back
  CHECK_EQ(driver_frees(f), 1u);
  f->deallocate(q);
  CHECK_EQ(f->trim(), 2 * MiB);
  CHECK_EQ(consistency(f), "");
}

TEST(defer_cleanup_still_grows_exact_segments)
{
  // Deferral holds back releases only: a mid-size request whose 20 MiB segment does not fit
  // still gets an exact segment that does (on growable segments too: nor does a page fit).
  fixture f{{}, big + 8 * MiB};
  auto const p = f->allocate(big);
  f.controls().defer_cleanup_begin();
  device_ptr q = 0;
  CHECK_NOTHROW(q = f->allocate(6 * MiB));
  CHECK_EQ(f->stats().bytes_reserved, big + 6 * MiB);
  f.controls().defer_cleanup_end();
  if (q != 0) { f->deallocate(q); }
  f->deallocate(p);
  CHECK_EQ(consistency(f), "");
}

// ---- passthrough ------------------------------------------------------------------------------

TEST(passthrough_one_segment_per_allocation)
{
  pool_options o;
  o.mode = pool_mode::passthrough;
  fixture f{o};
  auto const a = f->allocate(100);
  auto const b = f->allocate(100);
  auto const c = f->allocate(5 * MiB + 1);
  CHECK_EQ(f.drv.stats().allocations, 3u);
  CHECK_EQ(f->stats().segments, 3u);
  CHECK_EQ(f->stats().bytes_reserved, 256 + 256 + 5 * MiB + 256);  // exact, 256-rounded
  CHECK_EQ(f.drv.stats().bytes_reserved, f->stats().bytes_reserved);
  f->deallocate(a);
  f->deallocate(b);
  // Not returned before the fence completes, even on allocation (which maintains).
  auto const d = f->allocate(100);
  CHECK(d != a && d != b);
  CHECK_EQ(f.drv.stats().deallocations, 0u);
  f.drv.complete_all_events();
  auto const e = f->allocate(100);  // maintenance: a and b go back to the driver
  CHECK_EQ(f.drv.stats().deallocations, 2u);
  CHECK_EQ(f.drv.stats().allocations, 5u);
  f->deallocate(c);
  f->deallocate(d);
  f->deallocate(e);
  f->synchronize();
  CHECK_EQ(f.drv.stats().deallocations, 5u);
  CHECK_EQ(f.drv.stats().live_segments, 0u);
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(passthrough_with_deferred_cleanup)
{
  pool_options o;
  o.mode = pool_mode::passthrough;
  fixture f{o};
  auto const a = f->allocate(4096);
  f.controls().defer_cleanup_begin();
  f->deallocate(a);
  f->synchronize();
  CHECK_EQ(f.drv.stats().live_segments, 1u);
  f.controls().defer_cleanup_end();  // releases what was held back
  CHECK_EQ(f.drv.stats().live_segments, 0u);
  CHECK_EQ(consistency(f), "");
}

// ---- reset and generations --------------------------------------------------------------------

// A retired growable segment keeps its pages mapped until the process exits (docs/limits.md):
// its free blocks are never handed out again all the same, and the pool counts none of it.
TEST(reset_retires_live_blocks)
{
  fixture f;
  bool const growable = test::growable_run();
  auto const a = f->allocate(1000);  // first block of a small segment (base a)
  auto const b = f->allocate(big);   // segment base b (or page)
  auto const c = f->allocate(big);
  f->deallocate(c);  // pending: reset waits for it, then releases its segment
  auto const g0 = f->generation();
  f.controls().reset();
  CHECK_EQ(f->generation(), g0 + 1);
  auto const s = f->stats();
  CHECK_EQ(s.bytes_in_use, 0u);
  CHECK_EQ(s.blocks_in_use, 0u);
  CHECK_EQ(s.bytes_reserved, 0u);
  CHECK_EQ(s.bytes_free, 0u);
  CHECK_EQ(s.bytes_waiting, 0u);
  CHECK_EQ(s.segments, 0u);
  CHECK_EQ(driver_frees(f), 1u);  // c's segment (page)
  // a's and b's: retired, not freed (live blocks). b's page stays mapped, in its reservation.
  CHECK_EQ(f.drv.stats().live_segments, growable ? 1u : 2u);
  CHECK_EQ(f.drv.stats().live_mappings, growable ? 1u : 0u);
  CHECK(f.drv.accessible(0, b, big));
  CHECK(!f.queries().owns(a));
  CHECK(!f.queries().owns(b));
  // The retired segments' free space is never handed out again.
  auto const allocs0 = f.drv.stats().allocations;
  std::vector<device_ptr> ps;
  for (int i = 0; i < 600; ++i) {
    auto const p = f->allocate(4 * KiB);
    CHECK(!within(p, a, 2 * MiB));
    ps.push_back(p);
  }
  auto const pb = f->allocate(big);
  CHECK(!within(pb, b, big));
  CHECK(f.drv.stats().allocations > allocs0);
  // Old-generation frees: not through the plain deallocate (not live in this generation).
  CHECK_THROWS(f->deallocate(a), pool_error);
  // Its retired segment is now empty: freed (a growable one keeps its pages).
  f->deallocate(b, legacy_stream, gen(g0));
  CHECK_EQ(driver_frees(f), growable ? 1u : 2u);
  CHECK_THROWS(f->deallocate(b, legacy_stream, gen(g0)), pool_error);  // double free
  f->deallocate(a, legacy_stream, gen(g0));
  CHECK_EQ(driver_frees(f), growable ? 2u : 3u);
  for (auto p : ps) { f->deallocate(p, legacy_stream, gen(g0 + 1)); }
  f->deallocate(pb);
  f->trim();
  auto const c1 = f.drv.stats();
  CHECK_EQ(c1.live_segments, 0u);
  if (growable) {
    // The driver holds b's page and the two reservations (the retired one, and pb's, whose
    // pages trim gave back), the pool one segment and no memory.
    CHECK_EQ(c1.bytes_physical, big);
    CHECK_EQ(c1.live_mappings, 1u);
    CHECK_EQ(c1.live_reservations, 2u);
    CHECK_EQ(f->stats().segments, 1u);
    CHECK_EQ(f->stats().bytes_reserved, 0u);
  }
  CHECK_EQ(consistency(f, !growable), "");
}

TEST(reset_then_address_reuse_by_the_driver)
{
  fixture f;
  auto const a = f->allocate(big);
  auto const g0 = f->generation();
  f.controls().reset();
  f.drv.invalidate_device(0);  // the context reset: addresses are handed out again
  auto const x = f->allocate(big);
  REQUIRE(x == a);  // the driver reused the address: this is the case under test
  CHECK(f.queries().owns(x));
  auto const frees = driver_frees(f);
  f->deallocate(a, legacy_stream, gen(g0));  // the old block: must not touch x
  CHECK(f.queries().owns(x));
  // Not freed: the driver's id differs (a retired growable segment gives nothing back).
  CHECK_EQ(driver_frees(f), frees);
  CHECK(f.drv.accessible(0, x, big));
  CHECK_EQ(test::growable_run() ? f.drv.stats().live_mappings : f.drv.stats().live_segments, 1u);
  CHECK_EQ(f->stats().bytes_in_use, big);
  CHECK_THROWS(f->deallocate(a, legacy_stream, gen(g0)), pool_error);
  f->deallocate(x, legacy_stream, gen(g0 + 1));
  CHECK(!f.queries().owns(x));
  CHECK_THROWS(f->deallocate(x, legacy_stream, gen(g0 + 1)), pool_error);
  CHECK_THROWS(f->deallocate(x), pool_error);
  f->trim();
  CHECK_EQ(f.drv.stats().live_segments, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(tagged_try_free_leaves_a_retired_block_to_the_full_free)
{
  // CuPy's and PyTorch's frees name no generation: deallocate_tagged() looks among the blocks
  // a reset retired first. Its try (taken holding the GIL) must not skip that look.
  fixture f;
  auto const a = f->allocate(big, legacy_stream, alloc_tag::cupy);
  f.controls().reset();
  f.drv.invalidate_device(0);
  auto const x = f->allocate(big, legacy_stream, alloc_tag::cupy);
  REQUIRE(x == a);  // the same library's live block at the retired one's address
  CHECK(!f->try_deallocate(a, allocation_stream, lib(alloc_tag::cupy)));
  CHECK(f.queries().owns(x));
  f->deallocate(a, allocation_stream, lib(alloc_tag::cupy));  // the retired one
  CHECK(f.queries().owns(x));
  CHECK(f.drv.accessible(0, x, big));
  CHECK(f->try_deallocate(x, allocation_stream, lib(alloc_tag::cupy)));  // none retired now
  CHECK(!f.queries().owns(x));
  auto const y = f->allocate(4096, legacy_stream, alloc_tag::torch);
  CHECK(!f->try_deallocate(y, allocation_stream, lib(alloc_tag::cupy)));  // another library's
  CHECK(f.queries().owns(y));
  CHECK(f->try_deallocate(y, allocation_stream, lib(alloc_tag::torch)));
  CHECK_EQ(f->stats().blocks_in_use, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(reset_with_record_stream_pending)
{
  fixture f;
  auto const p = f->allocate(big);
  auto const q = f->allocate(big);
  f->record_stream(p, stream_b);
  f->deallocate(p, legacy_stream);
  f.controls().reset();  // waits for both of p's fences: p's segment (page) goes back to the driver
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  CHECK_EQ(driver_frees(f), 1u);
  // q's, retired: its segment, or its page
  CHECK_EQ(test::growable_run() ? f.drv.stats().live_mappings : f.drv.stats().live_segments, 1u);
  CHECK_EQ(consistency(f, false), "");
  f.drv.set_auto_complete(true);
  for (int i = 0; i < 4; ++i) {
    auto const r = f->allocate(big);  // misses, maintenance: never p's retired block
    CHECK(r != p);
    CHECK(r != q);
  }
  CHECK_EQ(consistency(f, false), "");
  f->deallocate(q, legacy_stream, gen(0));
}

TEST(reset_when_the_fence_fails)
{
  fixture f;
  auto const p = f->allocate(big);
  auto const q = f->allocate(big);
  f->deallocate(p);
  f.drv.fail_next_event_records(1);  // the context is already broken
  CHECK_NOTHROW(f.controls().reset());
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(driver_frees(f), 1u);  // p's segment (page) was released
  // q's, retired: its segment, or its page
  auto const live = [&] {
    auto const c = f.drv.stats();
    return test::growable_run() ? c.live_mappings : c.live_segments;
  };
  CHECK_EQ(live(), 1u);
  CHECK_EQ(consistency(f, false), "");
  f->deallocate(q, legacy_stream, gen(0));
  // Its segment goes back; a retired growable segment keeps its pages (docs/limits.md).
  CHECK_EQ(live(), test::growable_run() ? 1u : 0u);
}

TEST(reset_after_the_context_is_gone)
{
  // The context went away before reset() (the driver no longer knows the segments): freeing
  // segments fails, and the pool must still retire everything consistently and work after.
  fixture f;
  auto const a = f->allocate(big);
  auto const b = f->allocate(big);
  auto const s = f->allocate(256);
  f->deallocate(b);
  f->synchronize();  // b's segment wholly free: reset() will try to release it
  auto const g0 = f->generation();
  f.drv.invalidate_device(0);
  CHECK_NOTHROW(f.controls().reset());
  auto const st = f->stats();
  CHECK_EQ(st.bytes_reserved, 0u);
  CHECK_EQ(st.bytes_free, 0u);
  CHECK_EQ(st.segments, 0u);
  CHECK_EQ(consistency(f), "");
  std::set<device_ptr> fresh;
  for (int i = 0; i < 3; ++i) {
    CHECK(fresh.insert(f->allocate(big)).second);
    CHECK(fresh.insert(f->allocate(256)).second);
  }
  CHECK_EQ(f->stats().bytes_in_use, 3 * big + 3 * 256);
  CHECK_EQ(consistency(f), "");
  f->deallocate(a, legacy_stream, gen(g0));  // unknown to the driver now: not freed, no error
  f->deallocate(s, legacy_stream, gen(g0));
  for (auto p : fresh) { f->deallocate(p); }
  f->trim();
  CHECK_EQ(f.drv.stats().live_segments, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(failed_segment_release_keeps_the_pool_consistent)
{
  fixture f;
  auto const a = f->allocate(big);
  f->deallocate(a);
  f->synchronize();
  f.drv.invalidate_device(0);  // cuMemFree of the segment (cuMemUnmap of the page) will fail
  if (test::growable_run()) {
    CHECK_EQ(f->trim(), 0u);  // not thrown: the page stays mapped and counted, for a later trim
  } else {
    CHECK_THROWS(f->trim(), cuda_error);
  }
  CHECK_EQ(f->stats().segments, 1u);
  CHECK_EQ(f->stats().bytes_reserved, big);
  CHECK_EQ(f->stats().bytes_free, big);
  CHECK_EQ(consistency(f, false), "");
}

TEST(double_free_and_foreign_pointers)
{
  fixture f;
  auto const p = f->allocate(1000);
  f->deallocate(p);
  CHECK_THROWS(f->deallocate(p), pool_error);
  CHECK_THROWS(f->deallocate(p + 256), pool_error);
  CHECK_THROWS(f->deallocate(0x1234), pool_error);
  auto const q = f->allocate(1000);
  CHECK_THROWS(f->deallocate(q + 256), pool_error);  // inside a block: not a block start
  CHECK_THROWS(f->deallocate(q, legacy_stream, gen(f->generation() + 5)), pool_error);
  CHECK(f.queries().owns(q));
  f->deallocate(q);
  CHECK_EQ(f->stats().frees, 2u);
  CHECK_EQ(consistency(f), "");
}

// ---- statistics -------------------------------------------------------------------------------

TEST(statistics_add_up)
{
  fixture f;
  bool const growable = test::growable_run();
  auto const a = f->allocate(1000, legacy_stream, alloc_tag::numba);   // 1024
  auto const b = f->allocate(3 * MiB, legacy_stream, alloc_tag::cupy);  // 3 MiB
  auto const c = f->allocate(18 * MiB, legacy_stream, alloc_tag::torch);  // > the 17 MiB left
  auto const d = f->allocate(100);                                           // other: 256
  std::size_t const big = 18 * MiB;
  // b's 20 MiB large segment, c's exact one; or the growable segment: b in page 0, c behind it
  // in [3, 21) MiB, which takes page 1 too.
  std::size_t const large = growable ? 2 * 20 * MiB : 20 * MiB + big;
  auto s = f->stats();
  CHECK_EQ(s.bytes_in_use, 1024 + 3 * MiB + big + 256);
  CHECK_EQ(s.bytes_in_use_by_tag[static_cast<int>(alloc_tag::numba)], 1024u);
  CHECK_EQ(s.bytes_in_use_by_tag[static_cast<int>(alloc_tag::cupy)], 3 * MiB);
  CHECK_EQ(s.bytes_in_use_by_tag[static_cast<int>(alloc_tag::torch)], big);
  CHECK_EQ(s.bytes_in_use_by_tag[static_cast<int>(alloc_tag::other)], 256u);
  CHECK_EQ(s.allocations_by_tag[static_cast<int>(alloc_tag::numba)], 1u);
  CHECK_EQ(s.allocations, 4u);
  CHECK_EQ(s.blocks_in_use, 4u);
  CHECK_EQ(s.bytes_reserved, 2 * MiB + large);
  CHECK_EQ(s.segments, growable ? 2u : 3u);  // the growable segment is one
  CHECK_EQ(s.segment_allocations, growable ? 2u : 3u);
  CHECK_EQ(s.page_maps, growable ? 2u : 0u);
  CHECK_EQ(s.peak_bytes_in_use, s.bytes_in_use);
  CHECK_EQ(s.peak_bytes_reserved, s.bytes_reserved);
  CHECK_EQ(consistency(f), "");

  f->deallocate(c);
  f->deallocate(a);
  s = f->stats();
  CHECK_EQ(s.bytes_in_use, 3 * MiB + 256);
  CHECK_EQ(s.bytes_waiting, big + 1024);
  CHECK_EQ(s.peak_bytes_in_use, 1024 + 3 * MiB + big + 256);
  CHECK_EQ(s.bytes_in_use_by_tag[static_cast<int>(alloc_tag::torch)], 0u);
  CHECK_EQ(s.frees, 2u);
  CHECK_EQ(consistency(f), "");

  f->trim();  // c's segment; or page 1, wholly free (page 0 holds b)
  s = f->stats();
  CHECK_EQ(s.bytes_reserved, 2 * MiB + 20 * MiB);
  CHECK_EQ(s.peak_bytes_reserved, 2 * MiB + large);
  CHECK_EQ(s.segment_releases, growable ? 0u : 1u);
  CHECK_EQ(s.page_unmaps, growable ? 1u : 0u);
  CHECK_EQ(s.page_releases, growable ? 1u : 0u);
  f.controls().reset_peaks();
  s = f->stats();
  CHECK_EQ(s.peak_bytes_in_use, s.bytes_in_use);
  CHECK_EQ(s.peak_bytes_reserved, s.bytes_reserved);
  auto const desc = f.queries().describe();
  CHECK(desc.find("pool on device 0 holds 22.00 MiB in 2 segments") != std::string::npos);
  f->deallocate(b);
  f->deallocate(d);
  f->synchronize();
  s = f->stats();
  CHECK_EQ(s.bytes_in_use, 0u);
  CHECK_EQ(s.bytes_free, s.bytes_reserved);
  CHECK_EQ(s.largest_free_block, 20 * MiB);  // b's segment, or page 0
  CHECK_EQ(consistency(f), "");
}

TEST(ipc_handle_describes_the_segment)
{
  fixture f;
  auto const a = f->allocate(1000);
  auto const b = f->allocate(1000);
  auto const info = f.sharing().ipc_handle(b + 10);
  REQUIRE(info.has_value());
  CHECK_EQ(info->segment_base, a);
  CHECK_EQ(info->segment_size, 2 * MiB);
  CHECK_EQ(info->offset, 1024u + 10u);
  CHECK(!f.sharing().ipc_handle(0x1234).has_value());
  f->deallocate(a);
  f->deallocate(b);
  f->synchronize();
  CHECK(!f.sharing().ipc_handle(a).has_value());  // no live block in the segment
}

TEST(a_held_block_is_never_reused_until_its_last_release)
{
  // Another process may use a held block (an IPC export): its owner's free takes the pointer
  // but the block stays in use until the last release, then is fenced as any free.
  fixture f;
  lift_peak(f, 8 * big);  // misses grow: they wait for no fence
  auto const p = f->allocate(big, stream_a, alloc_tag::cupy);
  CHECK_THROWS((void)f.sharing().hold(p + big), pool_error);  // past the block
  CHECK_THROWS((void)f.sharing().hold(0x1234), pool_error);
  CHECK_EQ(f.sharing().hold(p + 4096), p);  // inside it: the block's address
  CHECK_EQ(f.sharing().hold(p), p);         // two holds
  auto const in_use = f->stats().bytes_in_use;
  // The fast free (CuPy's and PyTorch's entry points try it first) leaves a held block to the
  // full one, which parks it.
  CHECK(!f->try_deallocate(p, stream_a, lib(alloc_tag::cupy)));
  CHECK(f.queries().owns(p));
  f->deallocate(p, stream_a);
  CHECK(!f.queries().owns(p));
  CHECK_THROWS(f->deallocate(p, stream_a), pool_error);  // the pointer is no longer live
  CHECK_THROWS((void)f.sharing().hold(p), pool_error);              // nor can be held again
  CHECK_EQ(f->stats().bytes_in_use, in_use);  // still in use, by another process
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  CHECK_EQ(f.sharing().held_blocks(), 1u);
  f.drv.complete_all_events();
  f->synchronize();
  auto const q = f->allocate(big, stream_a);  // not p, not even in stream order
  CHECK_NE(q, p);
  f.sharing().release_hold(p);
  CHECK_EQ(f.sharing().held_blocks(), 1u);  // one hold left
  auto const r = f->allocate(big, stream_a);
  CHECK(r != p && r != q);
  CHECK_EQ(f->stats().bytes_in_use, 3 * big);  // p (held), q and r
  f.sharing().release_hold(p);  // the last: the free settles, on its stream
  CHECK_EQ(f.sharing().held_blocks(), 0u);
  CHECK_EQ(f->stats().bytes_in_use, 2 * big);  // q and r: p is off the books
  CHECK_EQ(f->stats().bytes_waiting, big);
  CHECK_EQ(f->allocate(big, stream_a), p);  // stream order on the free's stream
  f.sharing().release_hold(p);                       // a release the pool no longer knows: nothing
  CHECK_EQ(consistency(f), "");
}

TEST(a_held_block_freed_after_record_stream_waits_for_the_device)
{
  // record_stream's stream is the caller's only until the free; a held block's free settles
  // later, when that stream may be gone: it is never recorded on, the block waits for a device
  // synchronization instead (here the stream is destroyed: a record on it would throw).
  fixture f;
  lift_peak(f, 8 * big);
  auto const side = f.drv.create_stream();
  auto const p    = f->allocate(big);
  (void)f.sharing().hold(p);
  f->record_stream(p, side);
  f->deallocate(p);
  f.drv.destroy_stream(side);
  f.sharing().release_hold(p);
  CHECK_EQ(f->stats().bytes_waiting, big);
  auto const syncs = f.drv.stats().device_syncs;
  CHECK_NE(f->allocate(big), p);  // a miss: no device sync for a dormant free yet
  f->synchronize();               // waits for everything: a device synchronization
  CHECK(f.drv.stats().device_syncs > syncs);
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  CHECK_EQ(f.drv.stats().dead_stream_uses, 0u);
  CHECK_EQ(consistency(f), "");
}

TEST(a_reset_releases_every_hold)
{
  fixture f;
  auto const p = f->allocate(big);
  auto const q = f->allocate(big);
  (void)f.sharing().hold(p);
  (void)f.sharing().hold(q);
  f->deallocate(p);  // held and freed: settled by the reset
  auto const g0 = f->generation();
  f.controls().reset();
  CHECK_EQ(f.sharing().held_blocks(), 0u);
  CHECK_EQ(f->stats().bytes_in_use, 0u);  // q was retired with its segment: counted out
  f.sharing().release_hold(p);                     // the holders' late releases do nothing
  f.sharing().release_hold(q);
  f->deallocate(q, legacy_stream, gen(g0));  // q's owner frees it into the retired segment
  CHECK_EQ(f->stats().bytes_in_use, 0u);
}

TEST(a_reset_whose_settle_fails_still_releases_every_hold)
{
  // A record_stream block's settle records an event: made to fail, it must not leave the
  // other holds behind (a held block with no hold, whose free would then be lost).
  fixture f;
  auto const s = f.drv.create_stream();
  auto const a = f->allocate(big, s);
  auto const b = f->allocate(big, s);
  auto const c = f->allocate(big, s);
  for (auto p : {a, b, c}) { (void)f.sharing().hold(p); }
  f->record_stream(a, 0);
  f->deallocate(a, s);
  f->deallocate(b, s);
  auto const g0 = f->generation();
  f.drv.fail_next_event_records(1);
  try {
    f.controls().reset();
  } catch (cuda_error const&) {
  }
  CHECK_EQ(f.sharing().held_blocks(), 0u);
  f->deallocate(c, s, gen(g0));  // c's owner frees it: no error, nothing lost
  f.drv.complete_all_events();
  f->synchronize();
  CHECK_EQ(f->stats().bytes_in_use, 0u);
}

TEST(live_extent_is_the_block_holding_a_pointer)
{
  // Numba's device_extents asks for "the allocation" holding an array or a view inside it: the
  // block, not the segment that other arrays share. A freed block or a foreign address: none.
  fixture f;
  auto const a = f->allocate(1000);  // blocks of 1024 B in one small segment
  auto const b = f->allocate(1000);
  auto const c = f->allocate(5000);
  using extent = std::pair<device_ptr, std::size_t>;
  CHECK(f.queries().live_extent(a) == extent(a, 1024));
  CHECK(f.queries().live_extent(b + 10) == extent(b, 1024));   // a view inside b
  CHECK(f.queries().live_extent(b + 1023) == extent(b, 1024));
  CHECK(f.queries().live_extent(b + 1024) != extent(b, 1024));  // one past its end: not b
  CHECK(f.queries().live_extent(c + 4999) == extent(c, 5120));
  CHECK(!f.queries().live_extent(0x1234).has_value());
  f->deallocate(b);
  CHECK(!f.queries().live_extent(b + 10).has_value());  // pending: no array holds it
  f->synchronize();
  CHECK(!f.queries().live_extent(b).has_value());       // free
  CHECK(f.queries().live_extent(c + 1) == extent(c, 5120));
  auto const big_block = f->allocate(big);  // a segment (page) of its own
  CHECK(f.queries().live_extent(big_block + big - 1) == extent(big_block, big));
  f->deallocate(a);
  f->deallocate(c);
  f->deallocate(big_block);
  f->synchronize();
  CHECK(!f.queries().live_extent(a).has_value());  // no live block in the segment
  CHECK_EQ(consistency(f), "");
}

TEST(destroying_the_pool_returns_everything)
{
  host_driver drv;
  {
    device_pool pool{drv, 0, test::for_this_run({})};
    (void)pool.allocate(100);
    auto const p = pool.allocate(big);
    pool.deallocate(p);
    (void)pool.allocate(big);  // records an event
  }
  auto const c = drv.stats();
  CHECK_EQ(c.live_segments, 0u);
  CHECK_EQ(c.bytes_reserved, 0u);
  CHECK_EQ(c.live_events, 0u);
  CHECK_EQ(c.live_mappings, 0u);
  CHECK_EQ(c.bytes_physical, 0u);
  CHECK_EQ(c.live_reservations, 0u);
}

// ---- threads ------------------------------------------------------------------------------------

TEST(pool_mutex_excludes_and_wakes_sleeping_waiters)
{
  // Threads take the pools' mutex (detail/pool_mutex.hpp) in turn, some holding it long enough
  // that the others give up spinning and sleep: a lost wakeup hangs this test, a broken
  // exclusion loses increments (a plain read-modify-write under the lock).
  detail::pool_mutex mutex;
  long counter = 0;
  int const nthreads = 6, rounds = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < rounds; ++i) {
        if (i % 3 == 0) {
          while (!mutex.try_lock()) { std::this_thread::yield(); }
        } else {
          mutex.lock();
        }
        long const seen = counter;
        if ((i + t) % 97 == 0) { std::this_thread::sleep_for(std::chrono::microseconds{200}); }
        counter = seen + 1;
        mutex.unlock();
      }
    });
  }
  for (auto& th : threads) { th.join(); }
  CHECK_EQ(counter, long{nthreads} * rounds);
  CHECK(mutex.try_lock());  // left unlocked
  CHECK(!mutex.try_lock());
  mutex.unlock();
}

// A deterministic stress test (fixed seeds; NOT a benchmark): threads allocate and free random
// sizes on a few streams, hand blocks to each other to free, while another thread completes
// events, trims and checks statistics. Every block handed out is checked against all blocks
// live at that moment, and against the driver: its memory is there (a growable segment's pages
// mapped, whatever trim and the moves of free pages unmap meanwhile).
TEST(stress_threads)
{
  int const nthreads = 8;
  int ops            = 20000;
  if (char const* e = std::getenv("EMMPOOL_STRESS_OPS")) { ops = std::atoi(e); }

  host_driver drv;
  device_pool pool{drv, 0, test::for_this_run({})};

  std::mutex live_mutex;
  std::map<device_ptr, device_ptr> live;  // [begin, end) of every block held by a thread
  std::mutex handoff_mutex;
  std::deque<device_ptr> handoff;  // blocks allocated by one thread, to be freed by another
  std::atomic<int> errors{0};
  std::mutex message_mutex;
  std::string first_error;
  auto error = [&](std::string const& what) {
    if (errors.fetch_add(1) == 0) {
      std::lock_guard lock{message_mutex};
      first_error = what;
    }
  };

  auto claim = [&](device_ptr p, std::size_t n) {
    if (!drv.accessible(0, p, rounded(n))) { error("a block whose memory is not there"); }
    std::lock_guard lock{live_mutex};
    auto const end = p + rounded(n);
    auto it        = live.lower_bound(p);
    if (it != live.end() && it->first < end) { error("overlap with the next live block"); }
    if (it != live.begin() && std::prev(it)->second > p) {
      error("overlap with the previous live block");
    }
    live.emplace(p, end);
  };
  auto unclaim = [&](device_ptr p) {
    std::lock_guard lock{live_mutex};
    if (live.erase(p) != 1) { error("freeing a block not held"); }
  };

  std::atomic<bool> done{false};
  std::thread gpu{[&] {  // plays the GPU catching up, and a monitoring thread
    int i = 0;
    while (!done.load()) {
      drv.complete_all_events();
      auto const s = pool.stats();
      if (s.bytes_in_use + s.bytes_waiting + s.bytes_free != s.bytes_reserved) {
        error("statistics do not add up under concurrency");
      }
      if (++i % 200 == 0) { pool.trim(); }
      std::this_thread::sleep_for(std::chrono::microseconds{100});
    }
  }};

  std::vector<std::thread> threads;
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng{0x5eed0000u + static_cast<std::uint64_t>(t)};
      stream_handle const own_stream = 0x10000 + static_cast<stream_handle>(t) * 0x100;
      std::vector<device_ptr> mine;
      auto pick_size = [&]() -> std::size_t {
        auto const r = rng() % 100;
        if (r < 70) { return rng() % (64 * KiB); }
        if (r < 95) { return rng() % (2 * MiB); }
        return rng() % (24 * MiB);
      };
      auto free_one = [&](device_ptr p) {
        unclaim(p);
        auto const stream = rng() % 2 == 0 ? legacy_stream : own_stream;
        // Half through the try path, as the Python binding does, falling back when it declines.
        if (rng() % 2 == 0 && pool.try_deallocate(p, stream, gen(pool.generation()))) { return; }
        pool.deallocate(p, stream);
      };
      try {
        for (int i = 0; i < ops; ++i) {
          auto const r = rng() % 100;
          if (mine.size() < 8 || (r < 45 && mine.size() < 64)) {
            auto const n      = pick_size();
            auto const stream = rng() % 2 == 0 ? legacy_stream : own_stream;
            auto const tag    = static_cast<alloc_tag>(rng() % 4);
            auto const fast   = rng() % 2 == 0 ? pool.try_allocate(n, stream, tag) : std::nullopt;
            auto const p      = fast ? *fast : pool.allocate(n, stream, tag);
            if (p % device_pool::alignment != 0) { error("misaligned block"); }
            claim(p, n);
            if (rng() % 20 == 0) { pool.record_stream(p, 0x20000 + rng() % 4); }
            mine.push_back(p);
          } else if (r < 60) {  // hand one to another thread
            auto const k = rng() % mine.size();
            std::lock_guard lock{handoff_mutex};
            handoff.push_back(mine[k]);
            mine[k] = mine.back();
            mine.pop_back();
          } else if (r < 75) {  // free one handed over by another thread
            device_ptr p = 0;
            {
              std::lock_guard lock{handoff_mutex};
              if (!handoff.empty()) {
                p = handoff.front();
                handoff.pop_front();
              }
            }
            if (p != 0) { free_one(p); }
          } else {
            auto const k = rng() % mine.size();
            auto const p = mine[k];
            mine[k]      = mine.back();
            mine.pop_back();
            free_one(p);
          }
        }
        for (auto p : mine) { free_one(p); }
      } catch (std::exception const& e) {
        error(std::string{"exception in a worker: "} + e.what());
      }
    });
  }
  for (auto& th : threads) { th.join(); }
  done = true;
  gpu.join();
  for (auto p : handoff) {
    unclaim(p);
    pool.deallocate(p);
  }

  CHECK_EQ(errors.load(), 0);
  CHECK_EQ(first_error, "");
  auto const s = pool.stats();
  CHECK_EQ(s.bytes_in_use, 0u);
  CHECK_EQ(s.blocks_in_use, 0u);
  CHECK_EQ(s.allocations, s.frees);
  CHECK(s.allocations >= static_cast<std::uint64_t>(nthreads) * static_cast<std::uint64_t>(ops) / 3);
  CHECK(live.empty());
  pool.synchronize();
  pool.trim();
  CHECK_EQ(drv.stats().bytes_reserved, 0u);
  CHECK_EQ(drv.stats().live_segments, 0u);
  CHECK_EQ(drv.stats().bytes_physical, 0u);
  CHECK_EQ(pool.stats().bytes_reserved, 0u);
}
