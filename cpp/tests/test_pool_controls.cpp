// Tests of what a framework's allocator asks of a device_pool beyond allocate and free, over
// host_driver: a CUDA graph capture under way (no CUDA call a capture forbids), a cap changed
// at run time (torch.cuda.set_per_process_memory_fraction) and the bytes another allocator
// holds against it (a PyTorch MemPool made with its own allocator), and the layout of its
// segments (a memory snapshot).
//
// host_driver's events stay incomplete until complete_all_events(); it counts every call, so
// "no event query during a capture" is a count that must not move.
//
// Every test runs on both kinds of segments (pool_fixture.hpp) but those written for growable
// segments; large blocks fill their growable pages, so that both kinds hold the same bytes.
#include "check.hpp"
#include "pool_fixture.hpp"

#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/host_driver.hpp>

#include <cstddef>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

using namespace emmpool;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
// An exact-size segment of its own (more than large_segment / 2), or one growable page of
// pool_options' default size: no free memory lies beside it on either kind.
constexpr std::size_t big = default_growable_page_size;
constexpr stream_handle stream_a = 0x5000;
constexpr stream_handle stream_b = 0x6000;

using fixture = test::pool_fixture;

// The driver calls a capture forbids (or would record into the graph).
struct forbidden {
  std::uint64_t records, queries, syncs, device_syncs, frees, unmaps;
  static forbidden of(host_driver const& d)
  {
    auto const c = d.stats();
    return {c.event_records, c.event_queries, c.event_syncs, c.device_syncs, c.deallocations,
            c.unmaps};
  }
  bool operator==(forbidden const& o) const
  {
    return records == o.records && queries == o.queries && syncs == o.syncs &&
           device_syncs == o.device_syncs && frees == o.frees && unmaps == o.unmaps;
  }
};
std::string show(forbidden const& f)
{
  return "records " + std::to_string(f.records) + " queries " + std::to_string(f.queries) +
         " syncs " + std::to_string(f.syncs) + " device_syncs " + std::to_string(f.device_syncs) +
         " frees " + std::to_string(f.frees) + " unmaps " + std::to_string(f.unmaps);
}

}  // namespace

// ---- capture -----------------------------------------------------------------------------------

TEST(a_capture_makes_no_forbidden_call_and_the_end_catches_up)
{
  fixture f;
  // Before the capture: frees waiting for fences, one with a record_stream fence.
  auto const p = f->allocate(big);
  auto const q = f->allocate(big, stream_a);
  auto const r = f->allocate(1000, stream_a);
  f->deallocate(p);
  f.controls().capture_begin();
  CHECK(f.controls().capturing());
  auto const before   = forbidden::of(f.drv);
  auto const reserved = f->stats().bytes_reserved;
  // Everything a capture may see: misses (the ladder would poll, wait and give back), frees
  // with and without record_stream fences, same-stream reuse, trim and synchronize.
  auto const m = f->allocate(big);          // a miss: grows, polls nothing
  f->record_stream(q, stream_b);
  f->deallocate(q, stream_a);               // its fence would be an event now: held
  f->deallocate(r, stream_a);
  auto const r2 = f->allocate(1000, stream_a);  // stream order: no fence needed
  CHECK_EQ(r2, r);
  CHECK_EQ(f->trim(), 0u);
  f->synchronize();
  for (int i = 0; i < 3; ++i) { f->deallocate(f->allocate(3 * big), legacy_stream); }
  // Each large request grew the pool by its size (a new segment, or new pages past the peak
  // though frees of its stream wait): none waited for a free, none gave memory back.
  CHECK_EQ(f->stats().bytes_reserved, reserved + big + 3 * 3 * big);
  auto const after = forbidden::of(f.drv);
  CHECK(after == before);
  if (!(after == before)) { std::fprintf(stderr, "%s -> %s\n", show(before).c_str(), show(after).c_str()); }
  CHECK(f->stats().bytes_waiting > 0);

  f.controls().capture_end();
  CHECK(!f.controls().capturing());
  CHECK(f.drv.stats().event_records > before.records);  // q's record_stream fence, now
  f->synchronize();
  CHECK_EQ(f->stats().bytes_waiting, 0u);
  f->deallocate(m);
  f->deallocate(r2, stream_a);
  f->trim();
  CHECK_EQ(f->stats().bytes_in_use, 0u);
  CHECK_EQ(f->stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().bytes_reserved, 0u);
  CHECK_EQ(test::byte_accounting(f->stats(), f.drv.stats()), "");
}

// Growable segments only: the wait it leaves out is a growable segment's (device_pool.cpp,
// claim_and_map); a fixed segment's new peak waits for no free.
TEST_ONLY(a_capture_never_waits_for_frees_at_a_growable_new_peak, "")
{
  // A request on S that needs new pages past the peak while S's own frees wait for their fence
  // and could cover them: the pool waits for those frees first, and maps fewer new pages.
  // During a capture that wait would record and synchronize an event: new pages instead. The
  // same request outside a capture first, to show that it waits there.
  for (bool const capturing : {false, true}) {
    fixture f;
    REQUIRE(f->growable());
    // Three one-page blocks on S, the outer two freed: 2 pages wait on S, in no one block that
    // stream order could hand out whole or cut (y keeps them apart).
    auto const x = f->allocate(big, stream_a);
    auto const y = f->allocate(big, stream_a);
    auto const z = f->allocate(big, stream_a);
    REQUIRE(y == x + big && z == y + big);
    f->deallocate(x, stream_a);
    f->deallocate(z, stream_a);
    if (capturing) { f.controls().capture_begin(); }
    auto const before = forbidden::of(f.drv);
    auto const b      = f->allocate(2 * big, stream_a);  // past the peak of 3 pages
    auto const s      = f->stats();
    if (capturing) {
      auto const after = forbidden::of(f.drv);
      CHECK(after == before);
      if (!(after == before)) {
        std::fprintf(stderr, "%s -> %s\n", show(before).c_str(), show(after).c_str());
      }
      CHECK_EQ(s.fence_waits, 0u);
      CHECK_EQ(s.bytes_waiting, 2 * big);  // x and z wait still
      CHECK_EQ(b, z + big);                // two new pages past z
      CHECK_EQ(s.peak_bytes_reserved, 5 * big);
      f.controls().capture_end();
    } else {
      CHECK_EQ(s.fence_waits, 1u);
      CHECK_EQ(s.bytes_waiting, 0u);
      CHECK_EQ(b, z);  // z's page, free now, and one new page
      CHECK_EQ(s.peak_bytes_reserved, 4 * big);
    }
    CHECK(f.drv.accessible(0, b, 2 * big));
    f->synchronize();
    CHECK_EQ(test::byte_accounting(f->stats(), f.drv.stats()), "");
  }
}

TEST(captures_nest_and_an_unmatched_end_is_refused)
{
  fixture f;
  CHECK_THROWS(f.controls().capture_end(), pool_error);
  f.controls().capture_begin();
  f.controls().capture_begin();
  auto const p = f->allocate(big);
  f->record_stream(p, stream_b);
  f->deallocate(p);
  auto const records = f.drv.stats().event_records;
  f.controls().capture_end();
  CHECK(f.controls().capturing());
  CHECK_EQ(f.drv.stats().event_records, records);  // still held: one capture remains
  f.controls().capture_end();
  CHECK(!f.controls().capturing());
  CHECK(f.drv.stats().event_records > records);
  CHECK_EQ(f->trim(), big);
}

TEST(reset_during_a_capture_is_refused_and_changes_nothing)
{
  // With a record_stream free held for the capture's end, a reset would have to fence it now
  // (and wait for every pending free): refused, the pool as it was, and usable after the end.
  fixture f;
  auto const p = f->allocate(big);
  f.controls().capture_begin();
  f->record_stream(p, stream_b);
  f->deallocate(p);
  auto const before = forbidden::of(f.drv);
  CHECK_THROWS(f.controls().reset(), pool_error);
  CHECK(forbidden::of(f.drv) == before);
  CHECK(f.controls().capturing());
  f.controls().capture_end();
  f.controls().reset();
  CHECK_EQ(f->stats().bytes_in_use, 0u);
  CHECK_EQ(f.drv.stats().bytes_reserved, 0u);
  CHECK_EQ(f.drv.stats().bytes_physical, 0u);
}

TEST(out_of_memory_during_a_capture_waits_for_nothing)
{
  pool_options o;
  o.maximum_size = 2 * big;
  fixture f{o};
  auto const p = f->allocate(big);
  auto const q = f->allocate(big);
  f->deallocate(p);
  f.controls().capture_begin();
  auto const before = forbidden::of(f.drv);
  // Outside a capture the ladder would wait for p's fence and reuse it; during one it may not.
  CHECK_THROWS(f->allocate(big), out_of_memory);
  CHECK(forbidden::of(f.drv) == before);
  f.controls().capture_end();
  CHECK_EQ(f->allocate(big), p);  // the ladder waits for p now
  f->deallocate(q);
}

// ---- the cap -----------------------------------------------------------------------------------

TEST(the_cap_changes_at_run_time)
{
  fixture f;
  CHECK_EQ(f.controls().maximum_size(), std::numeric_limits<std::size_t>::max());
  auto const p = f->allocate(big);
  auto const q = f->allocate(big);
  f->deallocate(q);  // waiting for its fence: waited for, then given back
  f.controls().set_maximum_size(big + MiB);
  CHECK_EQ(f.controls().maximum_size(), big + MiB);
  CHECK_EQ(f->stats().bytes_reserved, big);
  // Neither a 2 MiB segment nor a page (p fills its page) fits beside p.
  CHECK_THROWS(f->allocate(2 * MiB), out_of_memory);
  try {
    f.controls().set_maximum_size(big / 2);
    CHECK(false);
  } catch (pool_error const& e) {
    CHECK(std::string{e.what()}.find("is in use") != std::string::npos);
  }
  CHECK_EQ(f.controls().maximum_size(), big + MiB);  // a refused cap leaves the old one
  f.controls().set_maximum_size(0);  // no cap
  auto const r = f->allocate(2 * MiB);
  f->deallocate(r);
  f->deallocate(p);
  CHECK_EQ(test::byte_accounting(f->stats(), f.drv.stats()), "");
}

TEST(a_lower_cap_keeps_segments_with_live_blocks)
{
  fixture f;
  auto const a = f->allocate(1000);  // a small segment (2 MiB), live
  auto const b = f->allocate(big);
  f->deallocate(b);
  f.controls().set_maximum_size(4 * MiB);  // b's segment goes; a's stays
  CHECK_EQ(f->stats().bytes_reserved, 2 * MiB);
  f->deallocate(a);
}

TEST(another_allocators_bytes_count_against_the_cap)
{
  pool_options o;
  o.maximum_size = 3 * big;
  fixture f{o};
  auto const p = f->allocate(big);
  auto const q = f->allocate(big);
  f->deallocate(q);  // a wholly free segment, waiting for its fence
  // Room is made by giving q's segment back; past what that frees, nothing is counted.
  CHECK(!f.controls().reserve_outside(static_cast<std::ptrdiff_t>(2 * big + MiB)));
  CHECK_EQ(f.controls().reserved_outside(), std::size_t{0});
  CHECK(f.controls().reserve_outside(static_cast<std::ptrdiff_t>(2 * big)));
  CHECK_EQ(f.controls().reserved_outside(), 2 * big);
  CHECK_EQ(f->stats().bytes_reserved, big);  // q's segment went back
  CHECK_THROWS(f->allocate(big), out_of_memory);  // the pool may not grow into them
  try {
    f.controls().set_maximum_size(2 * big);  // p and the other allocator's bytes are more
    CHECK(false);
  } catch (pool_error const& e) {
    CHECK(std::string{e.what()}.find("another allocator") != std::string::npos);
  }
  try {
    (void)f->allocate(big);
    CHECK(false);
  } catch (out_of_memory const& e) {
    CHECK(std::string{e.what()}.find("reserved by another allocator") != std::string::npos);
  }
  CHECK(f.controls().reserve_outside(-static_cast<std::ptrdiff_t>(2 * big)));
  CHECK_EQ(f.controls().reserved_outside(), std::size_t{0});
  auto const r = f->allocate(big);
  f->deallocate(r);
  f->deallocate(p);
  CHECK_EQ(test::byte_accounting(f->stats(), f.drv.stats()), "");
}

// ---- layout ------------------------------------------------------------------------------------

TEST(the_layout_tiles_every_segment_and_names_each_block)
{
  fixture f;
  auto const a = f->allocate(1000, stream_a, alloc_tag::torch);
  auto const b = f->allocate(3000, legacy_stream, alloc_tag::numba);
  auto const c = f->allocate(big, stream_b, alloc_tag::cupy);
  f->deallocate(b);  // pending: waits for its fence
  auto const c_kind = test::growable_run() ? segment_type::growable : segment_type::large;
  auto const rows   = f.queries().layout();
  std::size_t covered = 0, covered_fixed = 0;
  std::size_t segments = 0;
  device_ptr expect = 0;
  bool saw_a = false, saw_b = false, saw_c = false;
  for (auto const& row : rows) {
    if (row.ptr == row.segment) {
      CHECK_EQ(expect, 0u);  // the previous segment was tiled to its end
      expect = row.segment;
      ++segments;
    }
    CHECK_EQ(row.ptr, expect);  // blocks follow each other without gaps
    expect += row.size;
    covered += row.size;
    covered_fixed += row.kind != segment_type::growable ? row.size : 0;
    if (expect == row.segment + row.segment_size) { expect = 0; }
    if (row.ptr == a) {
      saw_a = row.state == block_status::allocated &&
              row.tag == static_cast<std::uint8_t>(alloc_tag::torch) && row.stream == stream_a &&
              row.kind == segment_type::small;
    }
    if (row.ptr == b) {
      saw_b = row.state == block_status::waiting &&
              row.tag == static_cast<std::uint8_t>(alloc_tag::numba);
    }
    if (row.ptr == c) {
      saw_c = row.state == block_status::allocated && row.kind == c_kind && row.size == big;
    }
  }
  CHECK_EQ(expect, 0u);
  CHECK(saw_a);
  CHECK(saw_b);
  CHECK(saw_c);
  CHECK_EQ(segments, 2u);  // a's and b's small one, c's
  CHECK_EQ(segments, f->stats().segments);
  // A growable segment's blocks tile its whole address reservation, of which only the mapped
  // pages count as reserved (pool_layout.hpp); host_driver counts the reservation and the
  // mapped bytes apart from its segments (0 on the fixed run).
  auto const d = f.drv.stats();
  CHECK_EQ(covered_fixed, d.bytes_reserved);
  CHECK_EQ(covered, covered_fixed + d.bytes_address_reserved);
  CHECK_EQ(covered_fixed + d.bytes_mapped, f->stats().bytes_reserved);
  f->deallocate(a, stream_a);
  f->deallocate(c, stream_b);
}

// ---- segment events (a memory history's segment actions) ----------------------------------------

TEST(segment_events_record_what_the_driver_gave_and_took_back)
{
  // Fixed segments made and released: small ones on both runs, large ones on the fixed run
  // (the growable segment's pages: the next test). `fill` requests of n bytes fill a segment.
  struct kind_case {
    std::size_t n;
    int fill;
    std::size_t segment_size;
    segment_type type;
  };
  std::vector<kind_case> cases{{MiB, 2, 2 * MiB, segment_type::small}};
  if (!test::growable_run()) { cases.push_back({big, 1, big, segment_type::large}); }
  for (auto const& k : cases) {
    fixture f;
    std::vector<device_ptr> a, b;
    for (int i = 0; i < k.fill; ++i) {  // before: not recorded
      a.push_back(f->allocate(k.n, stream_a, alloc_tag::cupy));
    }
    f.observers().set_segment_events(true);
    for (int i = 0; i < k.fill; ++i) {  // a segment of their own
      b.push_back(f->allocate(k.n, stream_a, alloc_tag::torch));
    }
    for (auto p : a) { f->deallocate(p, stream_a); }
    for (auto p : b) { f->deallocate(p, stream_a); }
    f.drv.complete_all_events();
    CHECK_EQ(f->trim(), 2 * k.segment_size);
    auto const events = f.observers().take_segment_events();
    REQUIRE(events.size() == 3u);
    CHECK(events[0].what == segment_event::kind::made && events[0].address == b[0] &&
          events[0].size == k.segment_size &&
          events[0].tag == static_cast<std::uint8_t>(alloc_tag::torch) &&
          events[0].type == k.type);
    for (std::size_t i = 1; i < events.size(); ++i) {
      CHECK(events[i].what == segment_event::kind::released);
      CHECK_EQ(events[i].size, k.segment_size);
      CHECK(events[i].type == k.type);
    }
    CHECK((events[1].address == a[0] && events[2].address == b[0]) ||
          (events[1].address == b[0] && events[2].address == a[0]));
    CHECK(f.observers().take_segment_events().empty());  // taken
    f.observers().set_segment_events(false);
    (void)f->allocate(k.n);
    (void)f->allocate(big);  // pages on the growable run: not recorded either
    CHECK(f.observers().take_segment_events().empty());  // off: nothing kept
  }
}

// Growable segments asked for: on the fixed run pool_fixture would make them fixed.
TEST_ONLY(segment_events_record_the_pages_a_growable_segment_maps_and_unmaps, "")
{
  pool_options o;
  o.segments = segment_kind::growable;
  fixture f{o};
  REQUIRE(f->growable());
  f.observers().set_segment_events(true);
  auto const p = f->allocate(big, stream_a, alloc_tag::torch);
  f->deallocate(p, stream_a);
  f.drv.complete_all_events();
  (void)f->trim();
  std::size_t mapped = 0, unmapped = 0;
  for (auto const& e : f.observers().take_segment_events()) {
    CHECK(e.type == segment_type::growable);
    if (e.what == segment_event::kind::mapped) {
      mapped += e.size;
      CHECK_EQ(e.tag, static_cast<std::uint8_t>(alloc_tag::torch));
    }
    if (e.what == segment_event::kind::unmapped) { unmapped += e.size; }
  }
  CHECK_EQ(mapped, big);  // the one page that p fills
  CHECK_EQ(unmapped, mapped);  // every page mapped went back with the trim
  CHECK_EQ(f->stats().bytes_reserved, 0u);
}
