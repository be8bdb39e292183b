#include <emmpool/detail/free_list.hpp>

#include <algorithm>
#include <iterator>

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

block* free_lists::take_best_fit(std::size_t size, block_kind kind)
{
  auto& s = set_of(kind);
  auto it = best_fit(s, size);
  return it != s.end() ? erase_at(s, it) : nullptr;
}

block* free_lists::erase_at(set& s, set::const_iterator it)
{
  auto* blk = *it;
  s.erase(it);
  bytes_ -= blk->size;
  return blk;
}

block* free_lists::take(std::size_t size, block_kind kind, std::size_t min_rest)
{
  auto& s = set_of(kind);
  auto it = best_fit(s, size);
  return it != s.end() ? take_at(s, it, size, min_rest) : nullptr;
}

block* free_lists::take_at(set& s, set::const_iterator it, std::size_t size, std::size_t min_rest)
{
  auto* blk = *it;
  if (blk->size - size < min_rest) { return erase_at(s, it); }  // handed out whole
  auto* front = arena_->make();  // may throw: before anything changed
  carve_front(blk, size, front);
  bytes_ -= size;
  reseat(s, it, moved::lower);  // blk, smaller: stays put unless the one before sorts higher
  return front;
}

void reseat(block_set& s, block_set::const_iterator it, moved way)
{
  // Only the side it moved toward can be out of order: a block that grew sorts no lower.
  // Only that side's neighbour is looked up: each step through the tree is a call.
  auto const less = s.key_comp();
  if (way == moved::higher) {
    if (auto const next = std::next(it); next == s.end() || less(*it, *next)) { return; }
  } else if (it == s.begin() || less(*std::prev(it), *it)) {
    return;
  }
  auto* blk = *it;
  s.insert(s.erase(it), blk);  // hinted where it was: it moved only a little, most often
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
  auto* prev          = blk->prev;
  auto* next          = blk->next;
  bool const free_below = prev != nullptr && prev->state == block_state::free;
  bool const free_above = next != nullptr && next->state == block_state::free;
  if (!free_below && !free_above) {
    insert(blk);
    return blk;
  }
  // A free neighbour grows over blk in place (its set's position found before its size
  // changes); a second one, above, leaves the set.
  auto* keep  = free_below ? prev : next;
  auto* other = free_below && free_above ? next : nullptr;
  auto& s     = set_of(keep);
  auto it     = s.find(keep);
  if (other != nullptr) { s.erase(other); }
  merge_into(keep, blk, other);
  bytes_ += blk->size;
  ++insertions_;
  arena_->recycle(blk);
  if (other != nullptr) { arena_->recycle(other); }
  reseat(s, it, moved::higher);  // larger: stays put unless the block after it sorts lower
  return keep;
}

std::size_t free_lists::largest() const noexcept
{
  std::size_t best = 0;
  if (!small_.empty()) { best = (*small_.rbegin())->size; }
  if (!large_.empty()) { best = std::max(best, (*large_.rbegin())->size); }
  return best;
}

}  // namespace emmpool::detail
