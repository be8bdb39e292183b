// The layers under the pools, each on its own over host_driver: the fence queue (batches,
// events, record_stream's two fences, dormant batches; detail/fence_queue.hpp) and the stream
// lanes (each stream's pending blocks: take, split, merge, join, absorb;
// detail/stream_lanes.hpp). Blocks here are records of one hand-made segment: no pool above.
//
// host_driver's events complete only when a test calls complete_all_events() (or a call waits
// for them), so "not before the fence completed" is checked exactly.
#include "check.hpp"

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/fence_queue.hpp>
#include <emmpool/detail/free_list.hpp>
#include <emmpool/detail/stream_key.hpp>
#include <emmpool/detail/stream_lanes.hpp>
#include <emmpool/host_driver.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

using namespace emmpool;
using namespace emmpool::detail;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr stream_ref legacy{legacy_stream, 0};
constexpr stream_ref null_stream{0, 0};

/// A driver, a fence queue over it, and one large segment carved into `n` adjacent blocks of
/// `size` bytes, all allocated (as a pool hands them out).
struct world {
  host_driver drv{1, std::size_t{1} << 30};
  fence_queue fences{drv, 0, std::size_t{1} << 20};
  block_arena arena;
  free_lists free{arena};
  segment seg;
  std::vector<block*> blocks;
  stream_ref a, b;  // two live named streams

  explicit world(std::size_t n = 4, std::size_t size = 64 * KiB)
  {
    seg.base = 1 << 20;
    seg.size = n * size;
    for (std::size_t i = 0; i < n; ++i) {
      auto* blk  = arena.make();
      blk->ptr   = seg.base + i * size;
      blk->size  = size;
      blk->seg   = &seg;
      blk->kind  = block_kind::large;
      blk->state = block_state::allocated;
      blk->prev  = i ? blocks.back() : nullptr;
      if (i) { blocks.back()->next = blk; }
      blocks.push_back(blk);
    }
    seg.first       = blocks.front();
    seg.live_blocks = n;
    stream_keys keys{drv, 0};
    a = keys.of_alive(drv.create_stream());
    b = keys.of_alive(drv.create_stream());
  }

  std::vector<fenced_block> poll(stream_ref alive = {})
  {
    std::vector<fenced_block> done;
    fences.poll(alive, done);
    return done;
  }
};

bool contains(std::vector<fenced_block> const& done, block const* blk, bool requeued = false)
{
  return std::any_of(done.begin(), done.end(),
                     [&](auto const& f) { return f.blk == blk && f.requeued == requeued; });
}

}  // namespace

// ---- the fence queue ----------------------------------------------------------------------------

TEST(fence_queue_hands_a_block_back_only_after_its_event_completed)
{
  world w;
  auto* x = w.blocks[0];
  w.fences.push(x, legacy);
  CHECK_EQ(x->state, block_state::pending);
  CHECK_EQ(w.fences.waiting_bytes(), x->size);
  CHECK_EQ(w.fences.open_bytes(), x->size);
  CHECK(w.poll().empty());  // its event is recorded now, not yet complete
  CHECK_EQ(w.fences.batches_closed(), 1u);
  CHECK_EQ(w.drv.stats().event_records, 1u);
  CHECK(w.poll().empty());  // nothing completed, nothing recorded again
  CHECK_EQ(w.drv.stats().event_records, 1u);
  w.drv.complete_all_events();
  auto done = w.poll();
  REQUIRE(done.size() == 1u);
  CHECK(done[0].blk == x && done[0].stream == legacy && !done[0].requeued);
  CHECK(x->owner == nullptr);
  CHECK_EQ(w.fences.waiting_bytes(), 0u);
  CHECK(!w.fences.has_waiting());
}

TEST(fence_queue_records_only_on_streams_alive_now)
{
  // A named stream's batch is fenced only when that stream is named alive (an allocation on
  // it): it may be dead otherwise ("stream lifetime").
  world w;
  w.fences.push(w.blocks[0], w.a);
  (void)w.poll(w.b);  // another stream alive: a's batch stays open, dormant
  CHECK_EQ(w.drv.stats().event_records, 0u);
  CHECK_EQ(w.fences.open_bytes(), w.blocks[0]->size);
  (void)w.poll(w.a);
  CHECK_EQ(w.drv.stats().event_records, 1u);
  w.drv.complete_all_events();
  CHECK(contains(w.poll(), w.blocks[0]));
  CHECK_EQ(w.drv.stats().dead_stream_uses, 0u);
}

TEST(fence_queue_fences_dormant_batches_with_one_device_sync_past_its_limit)
{
  world w{40, 64 * KiB};
  w.fences.push(w.blocks[0], w.a);
  CHECK(!w.fences.fence_due());
  for (std::size_t i = 1; i < w.blocks.size(); ++i) { w.fences.push(w.blocks[i], w.a); }
  CHECK(w.fences.fence_due());  // 40 x 64 KiB open past the 1 MiB limit
  auto done = w.poll(w.b);      // a is not alive here: only a device sync covers its frees
  CHECK_EQ(done.size(), w.blocks.size());
  CHECK_EQ(w.drv.stats().device_syncs, 1u);
  CHECK_EQ(w.fences.dormant_fences(), 1u);
  CHECK_EQ(w.fences.open_bytes(), 0u);
  CHECK_EQ(w.fences.waiting_blocks(), 0u);
}

TEST(fence_queue_record_stream_fences_twice_and_requeues_between)
{
  world w;
  auto* x       = w.blocks[1];
  x->also_fence = w.b;                   // record_stream(x, b), then a free on a
  CHECK(!w.fences.push_recorded(x, w.a));  // fenced on b first, recorded in the free
  CHECK_EQ(w.drv.stats().event_records, 1u);
  CHECK(w.poll().empty());
  w.drv.complete_all_events();
  auto first = w.poll();  // b's fence completed: now it waits for a's, as any block freed on a
  REQUIRE(first.size() == 1u);
  CHECK(first[0].requeued && first[0].stream == w.a);
  CHECK(x->also_fence.is_none() && x->state == block_state::pending);
  CHECK_EQ(w.fences.waiting_blocks(), 1u);
  (void)w.poll(w.a);  // a alive: its fence recorded
  w.drv.complete_all_events();
  CHECK(contains(w.poll(), x));
  // On the stream of the free itself: one fence.
  auto* y       = w.blocks[2];
  y->also_fence = w.a;
  CHECK(w.fences.push_recorded(y, w.a));
  CHECK(y->also_fence.is_none());
}

TEST(fence_queue_drain_waits_for_everything_and_abandon_touches_no_cuda)
{
  world w;
  w.fences.push(w.blocks[0], legacy);
  w.fences.push(w.blocks[1], w.a);  // dormant
  w.blocks[2]->also_fence = w.b;
  (void)w.fences.push_recorded(w.blocks[2], w.a);
  std::vector<fenced_block> done;
  w.fences.drain(done);
  for (int i = 0; i < 3; ++i) { CHECK(contains(done, w.blocks[i])); }
  CHECK(!w.fences.has_waiting());

  world v;
  v.fences.push(v.blocks[0], v.a);
  v.fences.push(v.blocks[1], legacy);
  auto const calls = v.drv.stats();
  auto abandoned   = v.fences.abandon();
  CHECK_EQ(abandoned.size(), 2u);
  CHECK_EQ(v.drv.stats().event_records, calls.event_records);
  CHECK_EQ(v.drv.stats().device_syncs, calls.device_syncs);
  CHECK(abandoned[0].stream == v.a || abandoned[1].stream == v.a);  // with their batches' streams
  CHECK_EQ(v.fences.waiting_bytes(), 0u);
}

TEST(fence_queue_counts_a_pending_blocks_bytes_as_it_changes)
{
  world w;
  w.fences.push(w.blocks[0], legacy);
  auto const before = w.blocks[0]->size;
  CHECK_EQ(w.fences.waiting_bytes(), before);
  w.blocks[0]->size -= 256;
  w.fences.resized(w.blocks[0], before);
  CHECK_EQ(w.fences.waiting_bytes(), before - 256);
  w.blocks[0]->size += 512;
  w.fences.resized(w.blocks[0], before - 256);
  CHECK_EQ(w.fences.waiting_bytes(), before + 256);
  w.fences.detach(w.blocks[0]);
  CHECK_EQ(w.fences.waiting_bytes(), 0u);
}

// ---- the stream lanes ---------------------------------------------------------------------------

// Lanes own their fence queue: the world's stands for it only in the fence queue tests above.
stream_lanes lanes_of(world& w, bool enabled = true)
{
  return stream_lanes{w.drv, 0, std::size_t{1} << 20, w.arena, enabled};
}

TEST(lanes_give_a_stream_its_own_pending_blocks_unfenced)
{
  world w;
  auto lanes = lanes_of(w);
  auto* x = w.blocks[0];
  CHECK(lanes.orders(w.a) && !lanes.orders(legacy));
  lanes.pend(x, w.a);
  CHECK(x->takeable);
  CHECK(lanes.take(w.b, x->size, block_kind::large, w.free) == nullptr);  // another stream: never
  CHECK(lanes.take(w.a, x->size, block_kind::small, w.free) == nullptr);  // another kind: never
  CHECK(lanes.take(w.a, x->size, block_kind::large, w.free) == x);
  CHECK(!x->takeable && x->owner == nullptr);  // out of the lane and of its batch
  CHECK_EQ(lanes.fences().waiting_bytes(), 0u);
  CHECK_EQ(lanes.reuses(), 1u);
  CHECK_EQ(w.drv.stats().event_records, 0u);  // no fence
}

TEST(lanes_split_a_larger_block_and_the_rest_keeps_its_fence)
{
  world w{2, 256 * KiB};
  auto lanes = lanes_of(w);
  auto* x = w.blocks[0];
  lanes.pend(x, w.a);
  auto* front = lanes.take(w.a, 64 * KiB, block_kind::large, w.free);  // 4x: cut, not whole
  REQUIRE(front != nullptr);
  CHECK(front != x && front->size == 64 * KiB && front->ptr == w.seg.base);
  CHECK(x->size == 192 * KiB && x->takeable && x->owner != nullptr);  // still pending on a
  CHECK_EQ(lanes.fences().waiting_bytes(), 192 * KiB);
  // A near fit (at most 1/8 larger) goes whole.
  CHECK(lanes.take(w.a, 180 * KiB, block_kind::large, w.free) == x);
}

TEST(lanes_leave_a_block_to_a_tighter_free_fit)
{
  world w{3, 256 * KiB};
  auto lanes = lanes_of(w);
  auto* x = w.blocks[0];
  lanes.pend(x, w.a);
  auto* y   = w.blocks[2];  // made a free block of 192 KiB: a tighter fit for 190 KiB than x
  auto* cut = w.arena.make();
  split_off(y, 192 * KiB, cut);
  cut->state = block_state::allocated;  // y's record is free now, cut's allocated: as many live
  y->state   = block_state::free;
  w.free.insert(y);
  CHECK(lanes.take(w.a, 190 * KiB, block_kind::large, w.free) == nullptr);
  CHECK(x->takeable);
  // A split comes once the free lists missed: it does not weigh them.
  CHECK(lanes.split(w.a, 190 * KiB, block_kind::large) != nullptr);
}

TEST(lanes_merge_a_free_with_its_pending_neighbours_of_the_same_stream)
{
  world w;
  auto lanes = lanes_of(w);
  auto *x = w.blocks[0], *y = w.blocks[1], *z = w.blocks[2];
  lanes.pend(x, w.a);
  lanes.pend(z, w.b);  // another stream's: never merged
  CHECK(lanes.may_merge(y, w.a));
  CHECK(lanes.merge_neighbours(y, w.a) == nullptr);  // into x, in its open batch, in place
  CHECK(x->size == 128 * KiB && x->next == z);
  CHECK_EQ(lanes.fences().waiting_bytes(), 128 * KiB + z->size);
  CHECK_EQ(w.seg.live_blocks, 3u);  // y's record went into x's
  CHECK(lanes.take(w.a, 128 * KiB, block_kind::large, w.free) == x);
}

TEST(lanes_join_numba_frees_in_the_open_batch_and_forget_what_completed)
{
  world w;
  auto lanes = lanes_of(w);
  CHECK(lanes.joins_open(legacy) && !lanes.joins_open(w.a));
  auto *x = w.blocks[0], *y = w.blocks[1];
  lanes.pend(x, legacy);
  CHECK(lanes.join_open(y, legacy));  // y into x: both wait for the one fence not yet recorded
  CHECK(x->size == 128 * KiB && !x->takeable);
  CHECK(!lanes.join_open(w.blocks[3], legacy));  // no pending neighbour in that batch
  // What the fences hand back leaves its lane, and comes back as a list.
  lanes.pend(w.blocks[2], null_stream);
  std::vector<block*> released;
  lanes.poll({}, released);
  CHECK(released.empty());  // recorded now, not completed
  w.drv.complete_all_events();
  lanes.poll({}, released);
  CHECK(std::find(released.begin(), released.end(), w.blocks[2]) != released.end());
  CHECK(std::find(released.begin(), released.end(), x) != released.end());
  CHECK(!w.blocks[2]->takeable);
  CHECK(lanes.take(null_stream, 64 * KiB, block_kind::large, w.free) == nullptr);
}

TEST(lanes_requeue_a_record_stream_block_in_the_batch_of_its_free)
{
  world w;
  auto lanes = lanes_of(w);
  auto* x = w.blocks[0];
  x->also_fence = w.b;  // record_stream(x, b), freed on a
  x->freed_on   = w.a;
  lanes.pend_recorded(x, w.a);
  CHECK(!x->takeable);  // two fences: never taken before the first completed
  std::vector<block*> released;
  w.drv.complete_all_events();
  lanes.poll({}, released);
  CHECK(released.empty() && x->takeable);  // now in a's batch, a's like any block freed there
  CHECK(lanes.take(w.a, x->size, block_kind::large, w.free) == x);
}

TEST(lanes_null_stream_absorbs_free_neighbours_and_disabled_lanes_do_nothing)
{
  world w;
  auto lanes = lanes_of(w);
  auto *x = w.blocks[0], *y = w.blocks[1];
  x->state = block_state::free;
  --w.seg.live_blocks;
  w.free.insert(x);
  CHECK(lanes.may_merge(y, null_stream) && !lanes.may_merge(y, w.a));  // the null stream only
  CHECK(lanes.absorbs_free(y, null_stream) && !lanes.absorbs_free(y, w.a));
  w.free.erase(x);  // the pool's part: the lanes never touch the free lists
  auto* merged = lanes.merge_neighbours(y, null_stream);
  REQUIRE(merged == x);  // y absorbed into x's record
  CHECK(merged->size == 128 * KiB);
  lanes.pend(merged, null_stream);
  CHECK_EQ(lanes.fences().waiting_bytes(), 128 * KiB);

  world v;
  auto off = lanes_of(v, false);  // passthrough: no stream order
  CHECK(!off.orders(v.a) && !off.joins_open(legacy) && !off.may_merge(v.blocks[1], v.a));
  CHECK(off.take(v.a, 64 * KiB, block_kind::large, v.free) == nullptr);
}
