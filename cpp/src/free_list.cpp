#include <emmpool/detail/free_list.hpp>

#include <algorithm>

namespace emmpool::detail {

void free_lists::insert(block* blk)
{
  blk->state = block_state::free;
  set_of(blk).insert(blk);
  bytes_ += blk->size;
  ++insertions_;
}

void free_lists::erase(block* blk)
{
  set_of(blk).erase(blk);
  bytes_ -= blk->size;
}

void free_lists::erase_all_of(segment const& seg)
{
  for (auto* b = seg.first; b != nullptr; b = b->next) {
    if (b->state == block_state::free) { erase(b); }
  }
}

block* free_lists::take_best_fit(std::size_t size, bool small)
{
  auto& s = small ? small_ : large_;
  auto it = best_fit(s, size);
  if (it == s.end()) { return nullptr; }
  auto* blk = *it;
  s.erase(it);
  bytes_ -= blk->size;
  return blk;
}

block* free_lists::split(block* blk, std::size_t size, std::size_t min_rest)
{
  if (blk->size - size < min_rest) { return blk; }
  auto* rest = arena_->make();
  split_off(blk, size, rest);
  insert(rest);
  return blk;
}

block* free_lists::coalesce(block* blk)
{
  if (auto* prev = blk->prev; prev != nullptr && prev->state == block_state::free) {
    erase(prev);
    absorb(prev, blk);
    arena_->recycle(blk);
    blk = prev;
  }
  if (auto* next = blk->next; next != nullptr && next->state == block_state::free) {
    erase(next);
    absorb(blk, next);
    arena_->recycle(next);
  }
  insert(blk);
  return blk;
}

std::size_t free_lists::largest() const noexcept
{
  std::size_t best = 0;
  if (!small_.empty()) { best = (*small_.rbegin())->size; }
  if (!large_.empty()) { best = std::max(best, (*large_.rbegin())->size); }
  return best;
}

}  // namespace emmpool::detail
