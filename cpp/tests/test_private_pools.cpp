// Tests of PyTorch's private pools (private_pools.hpp) over the device pool and host_driver:
// what a CUDA graph's pool and a MemPool may reuse, when their blocks go back, checkpoints,
// and that nothing goes back to the device pool while a pool is being allocated to.
//
// The PyTorch extension allocates a block from the device pool (or its own allocator) and then
// adopts it into its private pool; these tests do the same by hand.
#include "check.hpp"
#include "pool_fixture.hpp"

#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/private_pools.hpp>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <vector>

using namespace emmpool;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr stream_handle stream_a = 0x5000;
constexpr stream_handle stream_b = 0x6000;
constexpr private_pool_id graph{1, 0};
constexpr private_pool_id mempool{0, 1};

/// A device pool over host_driver and the private pools over it.
struct world {
  test::pool_fixture f;
  private_pools pools{f.drv, [this](int) -> device_pool& { return *f.pool; }};

  /// A new block of `id` from the device pool, as the extension makes one.
  device_ptr allocate(private_pool_id id, std::size_t size, stream_handle stream = stream_a)
  {
    if (auto p = pools.take(id, size, stream)) { return p->ptr; }
    auto const p = f->allocate(size, legacy_stream, alloc_tag::torch);
    pools.adopt(id, p, size, 0, stream, false);
    return p;
  }
  std::size_t in_use() { return f->stats().bytes_in_use; }
};

}  // namespace

TEST(a_freed_block_serves_its_pool_on_its_stream_only)
{
  world w;
  w.pools.begin(0, graph);
  CHECK(w.pools.active() && w.f.controls().capturing());
  auto const p = w.allocate(graph, MiB);
  CHECK(w.pools.owns(p) && w.pools.device_of(p) == 0);
  w.pools.free(p);
  CHECK(w.in_use() >= MiB);  // still the pool's
  CHECK(!w.pools.take(graph, MiB, stream_b));          // another stream: never
  CHECK(!w.pools.take(mempool, MiB, stream_a));        // another pool: never
  CHECK(!w.pools.take(graph, 3 * MiB, stream_a));      // too small
  CHECK(!w.pools.take(graph, MiB / 4, stream_a));      // more than twice the request
  auto const near = w.pools.take(graph, MiB - 512, stream_a);  // a near fit, whole
  CHECK(near && near->ptr == p && near->size == MiB);
  w.pools.end(0, graph);
  CHECK(!w.pools.active() && !w.f.controls().capturing());
  CHECK_EQ(w.pools.use_count(graph), 1);
}

TEST(begin_twice_is_refused_and_an_end_without_begin_does_nothing)
{
  world w;
  w.pools.begin(0, graph);
  CHECK_THROWS(w.pools.begin(0, graph), pool_error);
  w.pools.end(0, mempool);  // never begun: nothing, and the capture goes on
  CHECK(w.f.controls().capturing());
  w.pools.end(0, graph);
  CHECK(!w.f.controls().capturing());
  CHECK_THROWS(w.pools.set_use_on_oom(private_pool_id{7, 7}, true), pool_error);
}

TEST(release_gives_free_blocks_back_after_a_device_sync_and_live_ones_when_freed)
{
  world w;
  w.pools.create_or_incref(0, mempool);
  auto const a = w.allocate(mempool, MiB);
  auto const b = w.allocate(mempool, 2 * MiB);
  w.pools.free(a);
  auto const syncs = w.f.drv.stats().device_syncs;
  w.pools.release(mempool);
  CHECK(w.f.drv.stats().device_syncs > syncs);  // a replay of a destroyed graph may still run
  CHECK(!w.pools.owns(a));
  CHECK_EQ(w.in_use(), 2 * MiB);  // a went back to the device pool
  w.pools.free(b);                 // its pool is gone: straight back
  CHECK_EQ(w.in_use(), 0u);
  CHECK(!w.pools.owns(b));
  CHECK_EQ(w.pools.use_count(mempool), 0);
}

TEST(nothing_goes_back_while_a_pool_is_being_allocated_to)
{
  world w;
  w.pools.create_or_incref(0, mempool);
  auto const a = w.allocate(mempool, MiB);
  w.pools.free(a);
  w.pools.begin(0, graph);  // a capture under way
  auto const syncs = w.f.drv.stats().device_syncs;
  w.pools.release(mempool);
  CHECK_EQ(w.f.drv.stats().device_syncs, syncs);  // no synchronization during a capture
  CHECK_EQ(w.in_use(), MiB);                       // held for the capture's end
  w.pools.end(0, graph);
  w.pools.empty_cache(private_pool_id{});  // a later call gives back what waited
  CHECK_EQ(w.in_use(), 0u);
}

TEST(a_record_stream_block_never_serves_its_pool_again)
{
  world w;
  w.pools.create_or_incref(0, graph);
  auto const p = w.allocate(graph, MiB);
  w.pools.record_stream(p);
  w.pools.free(p);
  CHECK(!w.pools.take(graph, MiB, stream_a));
  CHECK(w.pools.owns(p));  // held until the pool is released
  w.pools.release(graph);
  CHECK_EQ(w.in_use(), 0u);
}

TEST(a_checkpoint_restores_the_live_blocks_of_its_pool)
{
  world w;
  w.pools.create_or_incref(0, graph);
  auto const a = w.allocate(graph, MiB);
  auto const b = w.allocate(graph, MiB);
  auto const checkpoint = w.pools.live_blocks(graph);
  CHECK(checkpoint == std::vector<device_ptr>({std::min(a, b), std::max(a, b)}));
  CHECK(w.pools.live_blocks_are(graph, {b, a}));
  CHECK(!w.pools.live_blocks_are(graph, {a}));
  w.pools.free(a);
  auto const c = w.allocate(graph, 4 * MiB);
  CHECK(w.pools.live_blocks_are(graph, {b, c}));
  w.pools.restore(graph, checkpoint);
  CHECK(w.pools.live_blocks_are(graph, {a, b}));
  CHECK(w.pools.take(graph, 4 * MiB, stream_a)->ptr == c);  // free within the pool again
  CHECK_THROWS(w.pools.restore(graph, {c + 256}), pool_error);  // not a block of the pool
  auto const other = w.allocate(mempool, MiB);
  CHECK_THROWS(w.pools.restore(graph, {other}), pool_error);  // another pool's
  w.pools.release(graph);
  CHECK_THROWS(w.pools.restore(graph, checkpoint), pool_error);  // no longer alive
}

TEST(an_out_of_memory_elsewhere_may_take_a_use_on_oom_pools_free_block)
{
  world w;
  w.pools.create_or_incref(0, mempool);
  auto const p = w.allocate(mempool, MiB);
  w.pools.free(p);
  CHECK(!w.pools.take_on_oom(MiB, 0, stream_a));  // not asked for
  w.pools.set_use_on_oom(mempool, true);
  CHECK(!w.pools.take_on_oom(MiB, 1, stream_a));  // another device's pools only
  CHECK(w.pools.take_on_oom(MiB, 0, stream_a)->ptr == p);
  CHECK(w.pools.live_blocks_are(mempool, {p}));  // still its pool's
}

TEST(foreign_blocks_go_back_to_the_caller_and_count_apart)
{
  world w;
  w.pools.create_or_incref(0, mempool);
  device_ptr const foreign = 0x7000'0000;  // another allocator's memory
  w.pools.adopt(mempool, foreign, 3 * MiB, 0, stream_a, true);
  auto const own = w.allocate(mempool, MiB);
  w.pools.free(own);
  auto const t = w.pools.totals(0);
  CHECK_EQ(t.foreign_bytes, 3 * MiB);
  CHECK_EQ(t.cached_bytes, MiB);
  CHECK_EQ(t.cached_blocks, 1u);
  CHECK_EQ(w.pools.blocks_of(0).size(), 2u);
  CHECK(w.pools.blocks_of(1).empty());
  w.pools.free(foreign);
  w.pools.release(mempool);
  auto const back = w.pools.take_returned_foreign();
  REQUIRE(back.size() == 1u);
  CHECK(back[0].ptr == foreign && back[0].size == 3 * MiB && back[0].foreign);
  CHECK(w.pools.take_returned_foreign().empty());
  CHECK_EQ(w.in_use(), 0u);  // the device pool's block went back to it
  CHECK_EQ(w.pools.totals(0).foreign_bytes, 0u);
}

TEST(a_null_or_held_block_is_refused_and_nothing_changes)
{
  world w;
  w.pools.create_or_incref(0, mempool);
  device_ptr const foreign = 0x7000'0000;
  CHECK_THROWS(w.pools.adopt(mempool, 0, MiB, 0, stream_a, true), std::invalid_argument);
  w.pools.adopt(mempool, foreign, 3 * MiB, 0, stream_a, true);
  CHECK_THROWS(w.pools.adopt(mempool, foreign, MiB, 0, stream_a, true), std::invalid_argument);
  CHECK_EQ(w.pools.totals(0).foreign_bytes, 3 * MiB);
  CHECK_EQ(w.pools.blocks_of(0).size(), 1u);
  w.pools.free(foreign);
  w.pools.release(mempool);
  auto const back = w.pools.take_returned_foreign();
  REQUIRE(back.size() == 1u);  // once, at its first size
  CHECK_EQ(back[0].size, 3 * MiB);
}
