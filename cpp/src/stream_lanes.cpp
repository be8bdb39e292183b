#include <emmpool/detail/stream_lanes.hpp>

#include <algorithm>
#include <new>
#include <utility>

namespace emmpool::detail {

stream_lanes::stream_lanes(driver& drv, int device, std::size_t open_batch_limit,
                           block_arena& arena, bool enabled)
  : fences_{drv, device, open_batch_limit}, arena_{&arena}, enabled_{enabled}
{
}

stream_lanes::lane::lane(stream_ref s, node_cache* nodes)
  : stream{s},
    sets{block_set{by_size{}, cached_allocator<block*>{nodes}},
         block_set{by_size{}, cached_allocator<block*>{nodes}},
         block_set{by_size{}, cached_allocator<block*>{nodes}}}
{
}

bool stream_lanes::lane::empty() const noexcept
{
  return newest == nullptr &&
         std::all_of(sets.begin(), sets.end(), [](auto const& set) { return set.empty(); });
}

// ---- the index ------------------------------------------------------------------------------

void stream_lanes::index_in_sets(stream_ref s, block* blk)
{
  auto* l = lane_of(s);
  if (l == nullptr) {
    try {
      // Streams come and go (a stream per task): lanes left empty go before a new one comes.
      if (lanes_.size() >= reuse_rule::lanes_kept) {
        lanes_.erase(
          std::remove_if(lanes_.begin(), lanes_.end(), [](lane const& x) { return x.empty(); }),
          lanes_.end());
      }
      l = &lanes_.emplace_back(s, &nodes_);
    } catch (std::bad_alloc const&) {
      return;  // not takeable: it waits for its fence like any other block
    }
  }
  if (auto* older = std::exchange(l->newest, blk)) {
    try {
      l->sets[static_cast<std::size_t>(older->kind)].insert(older);
    } catch (std::bad_alloc const&) {
      older->takeable = false;  // likewise
    }
  }
  blk->takeable = true;
}

void stream_lanes::erase_from_sets(lane& l, block* blk) noexcept
{
  l.sets[static_cast<std::size_t>(blk->kind)].erase(blk);
}

void stream_lanes::take_out(block* blk, lane* l)
{
  if (blk->takeable) { unindex(l != nullptr ? *l : *lane_of(blk->owner->stream), blk); }
  fences_.detach(blk);
}

void stream_lanes::clear() noexcept
{
  for (auto& l : lanes_) {
    if (l.newest != nullptr) { l.newest->takeable = false; }
    for (auto& set : l.sets) {
      for (auto* b : set) { b->takeable = false; }
    }
  }
  lanes_.clear();
}

// ---- fences completed -----------------------------------------------------------------------

void stream_lanes::settle(std::vector<block*>& released)
{
  // First the lanes, in the order reported (a block requeued for its second fence may be
  // released later in the same list): no block stays takeable once out of its batch. The
  // room first, so that nothing below throws.
  released.reserve(released.size() + fenced_.size());
  for (auto const& f : fenced_) {
    if (!f.requeued) {
      forget(f.blk, f.stream);
      released.push_back(f.blk);
    } else if (orders(f.stream)) {  // now in the batch of the stream of its free
      index(f.stream, f.blk);
    }
  }
  fenced_.clear();
}

void stream_lanes::poll(stream_ref alive, std::vector<block*>& released)
{
  try {
    fences_.poll(alive, fenced_);
  } catch (...) {
    settle(released);  // what completed before the failure is reusable all the same
    throw;
  }
  settle(released);
}

void stream_lanes::drain(std::vector<block*>& released, std::optional<stream_ref> only)
{
  try {
    if (only) {
      fences_.wait_for(*only, fenced_);
    } else {
      fences_.drain(fenced_);
    }
  } catch (...) {
    settle(released);
    throw;
  }
  settle(released);
}

void stream_lanes::drain_or_abandon(std::vector<block*>& released)
{
  fences_.drain_or_abandon(fenced_);
  settle(released);
}

void stream_lanes::abandon() noexcept
{
  (void)fences_.abandon();
  fenced_.clear();
  clear();
}

// ---- an allocation --------------------------------------------------------------------------

block* stream_lanes::best_fit(lane& l, std::size_t size, block_kind kind)
{
  block* best   = nullptr;
  auto consider = [&](block* b) {
    if (b->size >= size && (best == nullptr || b->size < best->size)) { best = b; }
  };
  if (auto* n = l.newest; n != nullptr && reuse_rule::serves(kind, n->kind)) {
    if (n->size == size) { return n; }  // nothing fits better (a loop of frees and allocations)
    consider(n);
  }
  auto from_set = [&](block_kind k) {
    auto& set = l.sets[static_cast<std::size_t>(k)];
    if (set.empty()) { return; }
    if (auto it = detail::best_fit(set, size); it != set.end()) { consider(*it); }
  };
  from_set(kind);
  if (kind == block_kind::growable) { from_set(block_kind::large); }
  return best;
}

block* stream_lanes::take_from_lane(stream_ref stream, std::size_t size, block_kind kind,
                                    cut how, free_lists const* free)
{
  // Lanes exist only for streams that order (a named, identified stream: never legacy_stream,
  // "no stream named", nor an unidentified one, which may be a new stream under a dead one's
  // handle), and hold only blocks without a record_stream fence pending.
  auto* l = lane_of(stream);
  if (l == nullptr) { return nullptr; }
  auto* blk = best_fit(*l, size, kind);
  if (blk == nullptr) { return nullptr; }
  // The free lists' block instead, if it fits tighter: what is cut off a free block stays
  // free, what a block handed out whole holds beyond the request is lost while it lives.
  if (how == cut::near_fit && blk->size != size &&
      free_fits_tighter(*free, blk->size, size, kind)) {
    return nullptr;
  }
  if (!reuse_rule::near_fit(blk->size, size)) {
    // Before the ladder's first step only a kind whose free lists free_fits_tighter() asked:
    // a growable request first sees what that step completes, coalesced.
    return how == cut::any || weighs_free(kind) ? take_split(*l, blk, size) : nullptr;
  }
  take_out(blk, l);
  ++reuses_;
  return blk;
}

block* stream_lanes::take_split(lane& l, block* blk, std::size_t size)
{
  // The free lists' rule (device_pool): a rest of at least one alignment. Here always more.
  auto* front = arena_->make();  // may throw: before anything changed
  // blk keeps the rest, where it is: in its batch (the fence it waited for is the one it
  // still waits for, so another stream gets it only once that fence completed) and in l.
  resize_pending(&l, blk, [&] { carve_front(blk, size, front); });
  ++reuses_;
  return front;  // not pending: the pool counts it in its segment's live blocks
}

bool stream_lanes::free_fits_tighter(free_lists const& free, std::size_t have, std::size_t size,
                                     block_kind kind)
{
  if (!weighs_free(kind)) { return false; }
  auto const fit = free.best_fit_size(size, kind);
  return fit != 0 && fit < have;
}

// ---- merges ---------------------------------------------------------------------------------

template <class Resize>
void stream_lanes::resize_pending(lane* l, block* blk, Resize&& resize)
{
  block_set* set = nullptr;  // blk's, if in one (a lane's newest block is in none)
  block_set::const_iterator it;
  if (l != nullptr && l->newest != blk) {
    set = &l->sets[static_cast<std::size_t>(blk->kind)];
    it  = set->find(blk);  // by its size before
  }
  auto const before = blk->size;
  resize();
  fences_.resized(blk, before);
  if (set != nullptr && it != set->end()) {
    reseat(*set, it, blk->size > before ? moved::higher : moved::lower);
  }
}

void stream_lanes::merge_pending(lane* l, block* keep, block* blk, block* other)
{
  --blk->seg->live_blocks;  // blk's record goes into keep's
  resize_pending(l, keep, [&] { merge_into(keep, blk, other); });
  arena_->recycle(blk);
  if (other != nullptr) { arena_->recycle(other); }
}

bool stream_lanes::join_open(block* blk, stream_ref key)
{
  // Only neighbours that wait for key's next fence and nothing else (no record_stream fence):
  // the one blk waits for ("join" in reuse_rule.hpp). Both, if any, are in that open batch.
  auto joinable = [&](block const* n) {
    return n != nullptr && n->state == block_state::pending && n->owner->open &&
           n->owner->stream == key && n->also_fence.is_none();
  };
  auto* const prev = blk->prev;
  auto* const next = blk->next;
  bool const below = joinable(prev);
  bool const above = joinable(next);
  if (!below && !above) { return false; }
  // The neighbour kept grows where it is, in its batch; a second one, above, leaves the batch.
  auto* const keep  = below ? prev : next;
  auto* const other = below && above ? next : nullptr;
  if (other != nullptr) {
    fences_.detach(other);  // its bytes out of the batch: keep's growth counts them back in
    --other->seg->live_blocks;
  }
  merge_pending(nullptr, keep, blk, other);  // no lane
  return true;
}

block* stream_lanes::merge_neighbours(block* blk, stream_ref key)
{
  // Why a merged block may wait for key's newest fence alone: its pending neighbour was freed
  // on key too (a takeable block of key's lane: no record_stream fence pending), earlier, so
  // the work that may still touch it was issued to key before that free. Work on one stream
  // completes in issue order, so an event recorded on key after this free (the open batch's)
  // completes only after the older batch's would have: it fences both parts. The merged block
  // waits longer than its older part would have, never less. A free neighbour needs no fence
  // at all. Only the physical neighbours in the segment's block list: never across segments,
  // nor with another stream's, a Numba (legacy) or a record_stream block. On the growable
  // segment pending ones only: a pending block's pages are all mapped and stay so
  // (growable_space unmaps only pages wholly inside free blocks), and merging turns no byte
  // from pending to free.
  bool const free_too = reuse_rule::absorbs_free(blk->kind, key, enabled_);
  auto ours           = [&](block const* n) {  // pending on key, merge-wise
    return n != nullptr && n->takeable && n->owner->stream == key;
  };
  auto off_its_list = [&](block* n) {  // n leaves its batch or free list, if it may
    if (ours(n)) {
      take_out(n);  // key's open batch may be left empty: the merged block refills it
      --n->seg->live_blocks;  // two records allocated-or-pending become one
      return true;
    }
    // Free: the pool took it off its free lists (absorbs_free); its bytes become pending
    // ones, which blk's batch counts.
    return free_too && n != nullptr && n->state == block_state::free;
  };
  // A neighbour in key's open batch takes blk (and the other neighbour) in, where it is: in
  // that batch, whose fence is recorded after this free, and in key's lane. A loop that
  // allocates and frees on one stream (cutting a pending block, freeing next to its rest)
  // then moves no record.
  auto* host = ours(blk->next) && blk->next->owner->open   ? blk->next
               : ours(blk->prev) && blk->prev->owner->open ? blk->prev
                                                           : nullptr;
  if (host == nullptr) {
    if (auto* prev = blk->prev; off_its_list(prev)) {
      absorb(prev, blk);
      arena_->recycle(blk);
      blk = prev;
    }
    if (auto* next = blk->next; off_its_list(next)) {
      absorb(blk, next);
      arena_->recycle(next);
    }
    return blk;
  }
  // The other neighbour leaves its list before host changes size: it may share host's set.
  auto* other       = host == blk->next ? blk->prev : blk->next;
  bool const merges = off_its_list(other);
  merge_pending(lane_of(key), host, blk, merges ? other : nullptr);
  return nullptr;
}

}  // namespace emmpool::detail
