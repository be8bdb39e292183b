#include <emmpool/reuse_policy.hpp>

#include <emmpool/error.hpp>
#include <emmpool/pool_options.hpp>

#include <algorithm>
#include <new>
#include <utility>

namespace emmpool {

reuse_policy::reuse_policy(driver& drv, int device, reuse_options options,
                           detail::block_arena* arena, detail::free_lists* free)
  : driver_{&drv}, device_{device}, options_{options}, arena_{arena}, free_{free}
{
  EMMPOOL_EXPECTS(!options_.reuse_in_stream_order || (options_.stream_order && arena != nullptr),
                  "reuse in stream order needs stream_order and a block arena");
}

reuse_policy::lane::lane(stream_ref s, detail::node_cache* nodes)
  : stream{s},
    sets{detail::block_set{detail::by_size{}, detail::cached_allocator<detail::block*>{nodes}},
         detail::block_set{detail::by_size{}, detail::cached_allocator<detail::block*>{nodes}},
         detail::block_set{detail::by_size{}, detail::cached_allocator<detail::block*>{nodes}}}
{
}

reuse_policy::~reuse_policy()
{
  // Batches still here belong to a pool being destroyed, which has drained or abandoned them.
  release_events();
}

namespace {

// The null stream and the legacy one are the same CUDA stream: one fence serves both. (No
// stream_ref holds the per-thread handle: ref_of() makes it the legacy one.)
constexpr bool same_fence(detail::stream_ref a, detail::stream_ref b) noexcept
{
  return a == b || (a.is_context() && b.is_context());
}

}  // namespace

void reuse_policy::enqueue(detail::block* blk, stream_ref key)
{
  if (blk->also_fence.is_none() && (options_.stream_order || key.is_context())) {
    // The common case: one fence, at the next allocation on a live stream.
    if (joins_open(key)) {
      if (!join_open(blk, key)) { push(blk, key); }
    } else if (!may_merge(blk, key)) {
      push(blk, key);
    } else if (auto* merged = merge_neighbours(blk, key)) {
      push(merged, key);
    }
    return;
  }
  queue_freed(blk, key);
}

void reuse_policy::queue_freed(detail::block* blk, stream_ref key)
{
  if (!blk->also_fence.is_none() && !same_fence(blk->also_fence, key)) {
    // Fence 1, on the recorded stream, now: record_stream's caller keeps that stream alive
    // until the free, not after it ("stream lifetime"). release_batch() queues fence 2.
    blk->freed_on = key;
    push(blk, blk->also_fence);
    close_now(blk->also_fence);
    return;
  }
  blk->also_fence = stream_ref::none();
  push(blk, key);
  // Without stream order a named stream is never seen alive again: fence it now.
  if (!options_.stream_order && !key.is_context()) { close_now(key); }
}

void reuse_policy::record_stream(detail::block* blk, stream_handle stream) const
{
  EMMPOOL_EXPECTS(stream != allocation_stream, "allocation_stream names no stream to record");
  // 0, the CUDA runtime's name for the default stream, means the legacy stream here.
  blk->also_fence = ref_of(stream == 0 ? legacy_stream : stream);
}

// ---- batches ------------------------------------------------------------------------------

reuse_policy::batch& reuse_policy::open_new_batch(stream_ref stream)
{
  auto b     = new_batch();
  b->stream  = stream;
  b->open    = true;
  b->ordered = orders(stream);
  open_.push_back(std::move(b));
  return *open_.back();
}

reuse_policy::batch_ptr reuse_policy::new_batch()
{
  if (spare_batches_.empty()) { return std::make_unique<batch>(); }
  auto b = std::move(spare_batches_.back());
  spare_batches_.pop_back();
  return b;
}

void reuse_policy::recycle(batch_ptr b) noexcept
{
  constexpr std::size_t keep = 16;  // one per stream in use, roughly; more would be hoarding
  try {
    if (b->event != 0) { spare_events_.push_back(b->event); }
    b->event = 0;
    if (spare_batches_.size() < keep) {
      b->blocks.clear();
      b->bytes = 0;
      b->open  = false;
      spare_batches_.push_back(std::move(b));
    }
  } catch (...) {
    // No room to keep it: it is freed here (an event it still holds leaks: harmless).
  }
}

// ---- stream order ---------------------------------------------------------------------------

bool reuse_policy::lane::empty() const noexcept
{
  return newest == nullptr &&
         std::all_of(sets.begin(), sets.end(), [](auto const& set) { return set.empty(); });
}

void reuse_policy::index_in_sets(stream_ref s, detail::block* blk)
{
  auto* l = lane_of(s);
  if (l == nullptr) {
    try {
      // Streams come and go (a stream per task): lanes left empty go before a new one comes.
      constexpr std::size_t few = 8;
      if (lanes_.size() >= few) {
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

void reuse_policy::erase_from_sets(lane& l, detail::block* blk) noexcept
{
  l.sets[static_cast<std::size_t>(blk->kind)].erase(blk);
}

namespace {

// A request serves from blocks of its own kind; a growable one from large fixed blocks too
// (never the other way: Numba's blocks stay off the growable segment, for IPC).
constexpr bool serves(detail::block_kind request, detail::block_kind blk) noexcept
{
  return blk == request ||
         (request == detail::block_kind::growable && blk == detail::block_kind::large);
}

}  // namespace

detail::block* reuse_policy::best_fit(lane& l, std::size_t size, detail::block_kind kind)
{
  detail::block* best = nullptr;
  auto consider        = [&](detail::block* b) {
    if (b->size >= size && (best == nullptr || b->size < best->size)) { best = b; }
  };
  if (auto* n = l.newest; n != nullptr && serves(kind, n->kind)) {
    if (n->size == size) { return n; }  // nothing fits better (a loop of frees and allocations)
    consider(n);
  }
  auto from_set = [&](detail::block_kind k) {
    auto& set = l.sets[static_cast<std::size_t>(k)];
    if (set.empty()) { return; }
    if (auto it = detail::best_fit(set, size); it != set.end()) { consider(*it); }
  };
  from_set(kind);
  if (kind == detail::block_kind::growable) { from_set(detail::block_kind::large); }
  return best;
}

detail::block* reuse_policy::take_from_lane(stream_ref stream, std::size_t size,
                                            detail::block_kind kind, bool split)
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
  if (!split && blk->size != size && free_fits_tighter(blk->size, size, kind)) { return nullptr; }
  // A near fit goes whole, as before splitting existed: cutting off a sliver that this
  // stream's next free merges back would cost a split and a merge per pair in a loop that
  // frees and allocates one size next to a smaller pending block (bench_core's stream-ordered
  // 64 KiB pair: 41 -> 62 ns).
  if (blk->size - size > size / 8) {
    // Before the ladder's first step only a kind whose free lists free_fits_tighter() asked:
    // a growable request first sees what that step completes, coalesced.
    return split || weighs_free(kind) ? take_split(*l, blk, size) : nullptr;
  }
  detach(blk, l);
  ++stream_order_reuses_;
  return blk;
}

detail::block* reuse_policy::take_split(lane& l, detail::block* blk, std::size_t size)
{
  // The free lists' rule (device_pool): a rest of at least one alignment. Here always more.
  auto* front = arena_->make();  // may throw: before anything changed
  // blk keeps the rest, where it is: in its batch (the fence it waited for is the one it
  // still waits for, so another stream gets it only once that fence completed) and in l.
  resize_pending(&l, blk, [&] { detail::carve_front(blk, size, front); });
  ++stream_order_reuses_;
  return front;  // not pending: hand_out() counts it in its segment's live blocks
}

template <class Resize>
void reuse_policy::resize_pending(lane* l, detail::block* blk, Resize&& resize)
{
  detail::block_set* set = nullptr;  // blk's, if in one (a lane's newest block is in none)
  detail::block_set::const_iterator it;
  if (l != nullptr && l->newest != blk) {
    set = &l->sets[static_cast<std::size_t>(blk->kind)];
    it  = set->find(blk);  // by its size before
  }
  auto const before = blk->size;
  resize();
  bool const grew = blk->size > before;
  count_bytes(*blk->owner, grew ? blk->size - before : before - blk->size, grew);
  if (set != nullptr && it != set->end()) { detail::reseat(*set, it, grew); }
}

void reuse_policy::merge_pending(lane* l, detail::block* keep, detail::block* blk,
                                 detail::block* other)
{
  --blk->seg->live_blocks;  // blk's record goes into keep's
  resize_pending(l, keep, [&] { detail::merge_into(keep, blk, other); });
  arena_->recycle(blk);
  if (other != nullptr) { arena_->recycle(other); }
}

bool reuse_policy::free_fits_tighter(std::size_t have, std::size_t size,
                                     detail::block_kind kind) const
{
  if (!weighs_free(kind)) { return false; }
  auto const fit = free_->best_fit_size(size, kind == detail::block_kind::small);
  return fit != 0 && fit < have;
}

bool reuse_policy::join_open(detail::block* blk, stream_ref key)
{
  // Only neighbours that wait for key's next fence and nothing else (no record_stream fence):
  // the one blk waits for ("join" in the header). Both, if any, are in that one open batch.
  auto joinable = [&](detail::block const* n) {
    return n != nullptr && n->state == detail::block_state::pending && n->owner->open &&
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
    detach(other);  // counts its bytes out of the batch: keep's growth counts them back in
    --other->seg->live_blocks;
  }
  merge_pending(nullptr, keep, blk, other);  // no lane
  return true;
}

detail::block* reuse_policy::merge_neighbours(detail::block* blk, stream_ref key)
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
  bool const free_too = absorbs_free(blk, key);
  auto ours           = [&](detail::block const* n) {  // pending on key, merge-wise
    return n != nullptr && n->takeable && n->owner->stream == key;
  };
  auto off_its_list = [&](detail::block* n) {  // n leaves its batch or free list, if it may
    if (ours(n)) {
      detach(n);  // key's open batch may be left empty: the merged block refills it
      --n->seg->live_blocks;  // two records allocated-or-pending become one
      return true;
    }
    if (free_too && n != nullptr && n->state == detail::block_state::free) {
      free_->erase(n);  // free bytes become pending ones (blk's batch counts them)
      return true;
    }
    return false;
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
      detail::absorb(prev, blk);
      arena_->recycle(blk);
      blk = prev;
    }
    if (auto* next = blk->next; off_its_list(next)) {
      detail::absorb(blk, next);
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

event_handle reuse_policy::take_event()
{
  if (!spare_events_.empty()) {
    auto e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return driver_->create_event(device_);
}

void reuse_policy::close(std::vector<batch_ptr>::iterator it)
{
  auto& b = **it;
  if (b.event == 0) { b.event = take_event(); }
  try {
    driver_->record_event(device_, b.event, b.stream.handle);
  } catch (cuda_error const&) {
    if (b.stream.handle == legacy_stream) { throw; }  // the batch stays open with its event
    driver_->synchronize_device(device_);            // all work done, that stream's included
    driver_->record_event(device_, b.event, legacy_stream);
  }
  closed_.push_back(std::move(*it));  // may throw: then it stays open, fenced twice later
  open_.erase(it);
  b.open = false;
  open_bytes_ -= b.bytes;
  ++batches_closed_;
  ++version_;
}

std::size_t reuse_policy::close_open_batches(stream_ref alive)
{
  // Only streams certain to be alive now: context streams, and `alive` (see "stream
  // lifetime" in the header). The rest stay open, dormant.
  std::size_t closed = 0;
  for (std::size_t i = open_.size(); i-- > 0;) {
    auto const b  = open_.begin() + static_cast<std::ptrdiff_t>(i);
    auto const& s = (*b)->stream;
    if ((*b)->blocks.empty()) {
      // Emptied by stream-order takes (kept open till now: a stream that frees and allocates
      // in turn would reopen it at once): nothing to fence, on any stream.
      recycle(std::move(*b));
      open_.erase(b);
      continue;
    }
    if (!s.is_context() && (s != alive || !s.identified())) { continue; }
    close(b);
    ++closed;
  }
  return closed;
}

void reuse_policy::close_now(stream_ref alive)
{
  if (!alive.identified()) { return; }  // its batch may hold a dead stream's frees: dormant
  for (auto b = open_.begin(); b != open_.end(); ++b) {
    if ((*b)->stream == alive) {
      close(b);
      return;
    }
  }
}

std::vector<detail::block*> reuse_policy::abandon()
{
  ++version_;
  std::vector<detail::block*> blocks;
  blocks.reserve(waiting_blocks_);
  auto take = [&](batch_ptr& b) {
    for (auto* blk : b->blocks) {
      blk->also_fence = stream_ref::none();
      blk->takeable   = false;
      blk->owner      = nullptr;
    }
    blocks.insert(blocks.end(), b->blocks.begin(), b->blocks.end());
    recycle(std::move(b));
  };
  for (auto& b : open_) { take(b); }
  for (auto& b : closed_) { take(b); }
  open_.clear();
  closed_.clear();
  lanes_.clear();
  waiting_bytes_  = 0;
  waiting_blocks_ = 0;
  open_bytes_     = 0;
  return blocks;
}

void reuse_policy::drop_events() noexcept
{
  for (auto& b : open_) { b->event = 0; }
  for (auto& b : closed_) { b->event = 0; }
  spare_events_.clear();
}

void reuse_policy::release_events() noexcept
{
  if (!process_is_exiting()) {
    for (auto e : spare_events_) {
      try {
        driver_->destroy_event(device_, e);
      } catch (...) {
        // The context may already be gone; a leaked event handle is harmless.
      }
    }
  }
  spare_events_.clear();
}

}  // namespace emmpool
