// Tests of detail::free_lists on its own: best fit, split, coalesce, over hand-made segments
// (no driver, no pool). The device pool's tests cover it in use; these pin down its contract.
#include "check.hpp"

#include <emmpool/detail/free_list.hpp>

#include <algorithm>
#include <random>
#include <vector>

using namespace emmpool;
using detail::block;
using detail::block_kind;
using detail::block_state;

namespace {

constexpr std::size_t KiB = 1024;

// One segment [base, base + size) as a single free block, inserted.
struct segment_fixture {
  detail::block_arena arena;
  detail::free_lists lists{arena};
  std::vector<detail::segment> segments = std::vector<detail::segment>(8);
  std::size_t used = 0;

  block* add_segment(device_ptr base, std::size_t size, bool small = false)
  {
    auto& seg = segments.at(used++);
    seg.base  = base;
    seg.size  = size;
    seg.small = small;
    auto* blk = arena.make();
    blk->ptr  = base;
    blk->size = size;
    blk->seg  = &seg;
    seg.first = blk;
    lists.insert(blk);
    return blk;
  }
  // Take `size` bytes by best fit and split, as the pool does.
  block* take(std::size_t size, block_kind kind = block_kind::large)
  {
    auto* blk = lists.take(size, kind, 256);
    if (blk != nullptr) { blk->state = block_state::allocated; }
    return blk;
  }
  // The blocks of a segment in address order: contiguous, linked both ways, covering it.
  [[nodiscard]] bool well_formed(detail::segment const& seg) const
  {
    device_ptr at     = seg.base;
    block const* prev = nullptr;
    for (auto const* b = seg.first; b != nullptr; prev = b, b = b->next) {
      if (b->ptr != at || b->prev != prev || b->seg != &seg) { return false; }
      // Two free neighbours would have been coalesced.
      if (prev != nullptr && prev->state == block_state::free && b->state == block_state::free) {
        return false;
      }
      at += b->size;
    }
    return at == seg.base + seg.size;
  }
};

}  // namespace

TEST(free_list_best_fit_takes_the_smallest_block_that_fits)
{
  segment_fixture f;
  f.add_segment(0x100000, 64 * KiB);
  f.add_segment(0x200000, 16 * KiB);
  f.add_segment(0x300000, 32 * KiB);
  CHECK_EQ(f.lists.bytes(), 112 * KiB);
  CHECK_EQ(f.lists.largest(), 64 * KiB);
  auto* b = f.lists.take_best_fit(20 * KiB, block_kind::large);
  REQUIRE(b != nullptr);
  CHECK_EQ(b->ptr, device_ptr{0x300000});  // 32 KiB: the smallest of those >= 20 KiB
  CHECK_EQ(f.lists.bytes(), 80 * KiB);
  CHECK(f.lists.take_best_fit(65 * KiB, block_kind::large) == nullptr);
  // Equal sizes: the lowest address first.
  f.add_segment(0x050000, 16 * KiB);
  auto* c = f.lists.take_best_fit(16 * KiB, block_kind::large);
  REQUIRE(c != nullptr);
  CHECK_EQ(c->ptr, device_ptr{0x050000});
}

TEST(free_list_small_and_large_sets_never_mix)
{
  segment_fixture f;
  f.add_segment(0x100000, 2048 * KiB, true);
  CHECK(f.lists.take_best_fit(KiB, block_kind::large) == nullptr);  // a small segment only
  auto* b = f.lists.take_best_fit(KiB, block_kind::small);
  REQUIRE(b != nullptr);
  CHECK(b->seg->small);
}

TEST(free_list_split_leaves_the_rest_free_and_coalesce_restores_the_segment)
{
  segment_fixture f;
  auto* whole = f.add_segment(0x100000, 64 * KiB);
  auto& seg   = f.segments[0];
  auto* a     = f.take(4 * KiB);
  auto* b     = f.take(8 * KiB);
  auto* c     = f.take(4 * KiB);
  REQUIRE(a != nullptr && b != nullptr && c != nullptr);
  CHECK_EQ(seg.first, a);
  CHECK_EQ(whole->ptr, device_ptr{0x100000 + 16 * KiB});  // the free rest keeps its record
  CHECK_EQ(whole->size, 48 * KiB);
  CHECK(whole->prev == c && whole->state == block_state::free);
  CHECK_EQ(a->ptr, device_ptr{0x100000});
  CHECK_EQ(b->ptr, device_ptr{0x100000 + 4 * KiB});
  CHECK_EQ(c->ptr, device_ptr{0x100000 + 12 * KiB});
  CHECK_EQ(f.lists.bytes(), 48 * KiB);
  CHECK(f.well_formed(seg));

  // b back: no free neighbour, stays apart.
  CHECK_EQ(f.lists.coalesce(b), b);
  CHECK_EQ(f.lists.bytes(), 56 * KiB);
  CHECK(f.well_formed(seg));
  // a back: merges with b (above).
  auto* ab = f.lists.coalesce(a);
  CHECK_EQ(ab->ptr, device_ptr{0x100000});
  CHECK_EQ(ab->size, 12 * KiB);
  CHECK(f.well_formed(seg));
  // c back: merges with both neighbours: one block spanning the segment again.
  auto* all = f.lists.coalesce(c);
  CHECK_EQ(all, seg.first);
  CHECK_EQ(all->size, 64 * KiB);
  CHECK(all->next == nullptr && all->prev == nullptr);
  CHECK_EQ(f.lists.bytes(), 64 * KiB);
  CHECK_EQ(f.lists.largest(), 64 * KiB);
}

TEST(free_list_split_keeps_a_remainder_below_the_minimum)
{
  segment_fixture f;
  f.add_segment(0x100000, 4 * KiB);
  auto* b = f.lists.take_best_fit(4 * KiB - 128, block_kind::large);
  REQUIRE(b != nullptr);
  CHECK_EQ(f.lists.split(b, 4 * KiB - 128, 256), b);
  CHECK_EQ(b->size, 4 * KiB);  // 128 bytes would be too small a block: not split off
  CHECK(b->next == nullptr);
  CHECK_EQ(f.lists.bytes(), 0u);
}

TEST(free_list_coalesce_stays_within_its_segment)
{
  segment_fixture f;
  // Two segments back to back in the address space: separate driver allocations.
  f.add_segment(0x100000, 8 * KiB);
  f.add_segment(0x100000 + 8 * KiB, 8 * KiB);
  auto* a = f.take(8 * KiB);
  auto* b = f.take(8 * KiB);
  REQUIRE(a != nullptr && b != nullptr);
  f.lists.coalesce(a);
  f.lists.coalesce(b);
  CHECK_EQ(f.lists.largest(), 8 * KiB);  // never one 16 KiB block
  CHECK_EQ(f.lists.bytes(), 16 * KiB);
}

TEST(free_list_erase_and_insertion_count)
{
  segment_fixture f;
  auto* whole = f.add_segment(0x100000, 64 * KiB);
  auto const n = f.lists.insertions();
  f.lists.erase(whole);  // a wholly free segment going back to the driver
  CHECK_EQ(f.lists.bytes(), 0u);
  CHECK(f.lists.take_best_fit(256, block_kind::large) == nullptr);
  CHECK_EQ(f.lists.insertions(), n);  // erasing makes no search succeed
  f.lists.insert(whole);
  CHECK_EQ(f.lists.insertions(), n + 1);
}

TEST(free_list_random_split_and_coalesce_keep_segments_whole)
{
  segment_fixture f;
  constexpr std::size_t size = 1024 * KiB;
  f.add_segment(0x1000000, size);
  std::mt19937_64 rng{42};
  std::vector<block*> taken;
  for (int step = 0; step < 20000; ++step) {
    if (taken.empty() || (rng() % 3 != 0 && f.lists.bytes() > 64 * KiB)) {
      std::size_t const n = (1 + rng() % 64) * 256;
      if (auto* b = f.take(n)) { taken.push_back(b); }
    } else {
      std::size_t const i = rng() % taken.size();
      f.lists.coalesce(taken[i]);
      taken[i] = taken.back();
      taken.pop_back();
    }
    if (step % 1000 == 0) { REQUIRE(f.well_formed(f.segments[0])); }
  }
  std::size_t in_use = 0;
  for (auto* b : taken) { in_use += b->size; }
  CHECK_EQ(f.lists.bytes() + in_use, size);
  for (auto* b : taken) { f.lists.coalesce(b); }
  CHECK(f.well_formed(f.segments[0]));
  CHECK_EQ(f.lists.largest(), size);
}

namespace {

// The best fit by brute force: the smallest free block of at least `size` bytes, lowest
// address among equals, over every segment of `kind` (small or not); null if none.
block const* brute_best_fit(segment_fixture const& f, std::size_t size, bool small)
{
  block const* best = nullptr;
  for (std::size_t i = 0; i < f.used; ++i) {
    if (f.segments[i].small != small) { continue; }
    for (auto const* b = f.segments[i].first; b != nullptr; b = b->next) {
      if (b->state != block_state::free || b->size < size) { continue; }
      if (best == nullptr || b->size < best->size ||
          (b->size == best->size && b->ptr < best->ptr)) {
        best = b;
      }
    }
  }
  return best;
}

}  // namespace

// take() shrinks and coalesce() grows a block in place in its size-ordered set whenever its
// order there allows; a block left out of order would be found late or never. Against a
// brute-force best fit over every block, with sizes that collide (equal sizes, the tie broken
// by address) and segments whose rests overtake each other.
TEST(free_list_best_fit_stays_exact_while_blocks_change_size_in_place)
{
  segment_fixture f;
  f.add_segment(0x1000000, 256 * KiB);
  f.add_segment(0x2000000, 256 * KiB);
  f.add_segment(0x3000000, 64 * KiB);
  f.add_segment(0x4000000, 512 * KiB);
  std::size_t const total = 1088 * KiB;
  std::mt19937_64 rng{7};
  std::vector<block*> taken;
  for (int step = 0; step < 40000; ++step) {
    if (taken.empty() || rng() % 2 == 0) {
      std::size_t const n = (1 + rng() % 32) * 1024;
      auto const* want    = brute_best_fit(f, n, false);
      device_ptr const at = want != nullptr ? want->ptr : 0;
      auto* b             = f.take(n);
      REQUIRE((b == nullptr) == (want == nullptr));
      if (b != nullptr) {
        CHECK_EQ(b->ptr, at);
        taken.push_back(b);
      }
    } else {
      std::size_t const i = rng() % taken.size();
      f.lists.coalesce(taken[i]);
      taken[i] = taken.back();
      taken.pop_back();
    }
    if (step % 500 == 0) {
      for (std::size_t s = 0; s < f.used; ++s) { REQUIRE(f.well_formed(f.segments[s])); }
    }
  }
  for (auto* b : taken) { f.lists.coalesce(b); }
  for (std::size_t s = 0; s < f.used; ++s) { CHECK(f.well_formed(f.segments[s])); }
  CHECK_EQ(f.lists.bytes(), total);
  CHECK_EQ(f.lists.largest(), 512 * KiB);
}
