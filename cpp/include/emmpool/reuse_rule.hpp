/**
 * @file reuse_rule.hpp
 * @brief When a freed block may be handed out again: the rule (the pool's safety argument),
 * and its stateless thresholds and predicates, in one place. The code that enforces it is in
 * layers, each knowing nothing of those above it:
 *
 *   device_pool (host_pool)  the only code that moves a block between allocated, pending and
 *                            free: a free goes stream key -> off the books -> lanes or fences;
 *                            the blocks the fences report complete leave the lanes and join the
 *                            free lists
 *   detail/stream_lanes.hpp  each named stream's pending blocks by best fit: take, split,
 *                            merge, join, absorb (uses the fence queue, never used by it)
 *   detail/fence_queue.hpp   pending batches and their events: push, close, poll, drain,
 *                            abandon, record_stream's two fences; knows no free list or lane
 *   detail/stream_key.hpp    how a stream is named, and when it may be asked (stream lifetime)
 *
 * THE REUSE RULE (the pool's safety argument, in one place)
 * ----------------------------------------------------------
 * A block freed at time t may still be read or written by GPU work issued before t, on any
 * stream: Numba frees from garbage-collection finalizers while kernels run, and its memalloc()
 * carries no stream. A block is therefore handed to a new owner only after a fence that
 * follows the free has completed:
 *
 *  1. A free appends the block to the open batch of `stream` (legacy_stream for
 *     Numba's frees, which carry none; allocation_stream: the stream named when the block was
 *     allocated, as CuPy's and PyTorch's pools do). No CUDA call but the stream's id (below).
 *  2. The fence queue records one event per open batch on that batch's stream. Events on
 *     the legacy default stream complete only after all work issued earlier to every blocking
 *     stream of the context (default, per-thread default and ordinary streams alike). Recording
 *     later than the free is always safe: it only covers more work.
 *  3. Its poll() hands back the blocks of batches whose event has completed
 *     (cuEventQuery: never blocks). Only then do they join the free lists.
 *
 * Not covered: work on a *non-blocking* stream that is not the stream passed to free(). Such
 * users must say so with record_stream(block, stream) (as PyTorch's record_stream): the free
 * then fences the block twice, first on that stream (an event recorded in the free itself),
 * then, once that completed, on the stream of the free. Only after both is it handed back.
 *
 * The one exception, stream order: a block freed on a stream S that the caller *named* (CuPy's
 * current stream, PyTorch's stream; never legacy_stream, which stands for "no stream named")
 * may go at once to a new allocation on the same S (stream_lanes::take). Work on one stream
 * runs in issue order, so everything the old owner issued to S precedes whatever the new owner
 * issues to S. This is the contract of CuPy's and PyTorch's own pools: memory used on another
 * stream must be synchronized with S by the user, or declared with record_stream (such a block
 * is never taken this way).
 *
 * Such blocks (pending on S, no record_stream fence: "takeable", indexed in S's lane by best
 * fit over every batch of S) may also change shape while they wait, as in PyTorch's pool,
 * where a block freed on S is S's at once (so that a GPU running behind the program, whose
 * fences complete late, costs S no more memory than it costs PyTorch):
 *  - split (stream_lanes::take, stream_lanes::split): S takes the front of a larger one;
 *    the rest stays in the same batch, so it waits for exactly the fence it waited for: no
 *    other stream, and no Numba request, gets it before that fence completed.
 *  - merge (free on S): a block freed on S absorbs its physical neighbours (same segment)
 *    that are takeable on S, in any batch of S, and the result joins S's *open* batch. Each
 *    neighbour was freed on S earlier; the work that may still touch it was issued to S before
 *    its free, hence before this free, and events on one stream complete in issue order: S's
 *    next event covers it as well as the one it waited for. A merged block therefore waits
 *    longer, never less.
 *  - absorb (free on the null stream, PyTorch's and CuPy's default): it also absorbs its
 *    *free* neighbours of a fixed segment (taken off the pool's free lists). No work may touch
 *    a free block, so any fence covers it; it is the null stream's until that fence completes
 *    (every allocation that misses records it: a context stream), then everyone's again.
 *    Another stream's batch may wait dormant, so it never hides free bytes. Never merged or
 *    absorbed: blocks of another stream, Numba's (legacy) blocks (but see "join" below),
 *    record_stream blocks (two fences), blocks of another segment. On the growable segment
 *    only pending neighbours: a pending block's pages are mapped and stay so (only pages
 *    wholly inside free blocks are unmapped, so a free one may have none), and a merge there
 *    turns no pending byte free.
 *
 * Join (no stream order needed): a block freed on a stream that does not order (legacy_stream:
 * Numba's frees) merges with its physical neighbours pending in that stream's *open* batch
 * (stream_lanes::join_open). All of them wait for that batch's fence, not recorded yet, so recorded after
 * every one of their frees: the merged block waits for exactly the fence each part waited
 * for. Neighbouring frees since the last fence then come back as one block, coalesced once.
 *
 * STREAM LIFETIME: a stream handle reaches CUDA only while it is certain to be alive
 * --------------------------------------------------------------------------------------
 * Clients destroy their streams whenever they like: CuPy destroys a Stream when its Python
 * object dies, often before the arrays made on it are freed; torch.cuda.ExternalStream and RMM
 * streams may dangle too. Their own pools never touch a stream after its allocations, so such
 * programs are correct there, and must be here. Using a destroyed stream's handle is undefined
 * (cuEventRecord on one crashes), and a new stream may get the same handle. So:
 *
 *  - A stream is named by a stream_ref (its key): its handle and the driver's unique stream id
 *    (cuStreamGetId), taken when the stream is certain to be alive: during an allocation on it
 *    (stream_keys::of_allocation: no client allocates on a dead stream), or during a free or record_stream
 *    whose caller passes it explicitly and so vouches for it. A stream_ref stored with a block
 *    (the allocation's stream, for the frees of CuPy and PyTorch, which name none or that one)
 *    is never passed to CUDA afterwards on its own say-so. A free that passes the allocation's
 *    handle (cuda.core and RMM pass the stream they allocated on) is fenced on that stored key,
 *    unasked: if the handle is another stream's by now, the key's stream is dead, and its
 *    batch waits for the device synchronization below, which covers the new stream's work too.
 *  - Batches are keyed by stream_ref, so a new stream that reuses a dead stream's handle is
 *    another stream: it can neither take a dead stream's blocks in "stream order" (whose
 *    work it does not follow) nor have events recorded for them.
 *  - The fence queue's poll(alive) records events only on context streams (null, legacy: they live
 *    as long as the context) and on `alive`, the stream of the allocation being served, which
 *    its caller guarantees alive at that moment. The open batch of any other stream is
 *    *dormant*: its stream may be dead. It is fenced at the next allocation on that stream, or
 *    else by one cuCtxSynchronize (every stream's work, destroyed streams'
 *    included, done: the only fence that covers a stream nobody can name any more), which
 *    the pool does only when dormant frees pile up past a limit, and on the out-of-memory
 *    ladder, trim and reset, which wait for everything anyway.
 *  - record_stream(block, S): S is the caller's, alive until the free by the same contract as
 *    PyTorch's record_stream; its fence is therefore recorded in the free itself, never later.
 *  - A block freed by a reset's retirement, or in a forked child, never gets here: its stream
 *    may have gone with the context.
 *
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/stream_key.hpp>

#include <cstddef>

namespace emmpool::reuse_rule {

/// A block freed on a stream goes back to that stream's request whole if it is at most this
/// fraction larger (1/8), else its front is cut off: cutting a sliver that the stream's next
/// free merges back would cost a split and a merge per pair in a loop that frees and
/// allocates one size next to a smaller pending block (bench_core's stream-ordered pairs
/// measure it).
[[nodiscard]] constexpr bool near_fit(std::size_t have, std::size_t size) noexcept
{
  return have - size <= size / 8;
}

/// Open batches of streams that may be dead ("dormant") kept at most before one device
/// synchronization fences them: the fence queue searches its open batches linearly, and a
/// program that drops a stream per task would grow them unbounded.
inline constexpr std::size_t max_dormant = 32;

/// Lanes kept at most before the empty ones go (streams come and go: a stream per task).
inline constexpr std::size_t lanes_kept = 8;

/// Emptied batches kept for reuse (with their events): one per stream in use, roughly; more
/// would be hoarding.
inline constexpr std::size_t spare_batches_kept = 16;

/// @brief Whether blocks freed on `s` may go back to `s` unfenced: a named (never
/// legacy_stream, "no stream named"), identified stream, where the pool reuses in stream order.
[[nodiscard]] constexpr bool orders(detail::stream_ref s, bool in_stream_order) noexcept
{
  return in_stream_order && s.handle != legacy_stream && s.identified();
}

/// @brief Whether two keys are fenced by one event: the null stream and the legacy one are the
/// same CUDA stream. (No key holds the per-thread handle: stream_keys makes it the legacy one.)
[[nodiscard]] constexpr bool same_fence(detail::stream_ref a, detail::stream_ref b) noexcept
{
  return a == b || (a.is_context() && b.is_context());
}

/// @brief Whether a block of kind `blk` may serve a request of kind `request`: its own kind;
/// a growable request large fixed blocks too (initial_pool_size's; never the other way: a
/// large request is fixed only where the growable segment is off).
[[nodiscard]] constexpr bool serves(detail::block_kind request, detail::block_kind blk) noexcept
{
  return blk == request ||
         (request == detail::block_kind::growable && blk == detail::block_kind::large);
}

/// @brief Whether a free of `blk` from `stream` calls no CUDA: a context stream or the
/// allocation's (no id to ask), and no record_stream fence to record.
[[nodiscard]] constexpr bool free_is_local(detail::block const& blk, stream_handle stream) noexcept
{
  return (is_context_stream(stream) ||
          detail::stream_keys::frees_on_allocation_stream(blk.alloc_stream, stream)) &&
         blk.also_fence.is_none();
}

/// @brief Whether a block freed on `key` absorbs its free neighbours of a fixed segment: on
/// the null stream only (PyTorch's and CuPy's default), whose batch every allocation's miss
/// fences (a context stream): free bytes absorbed by another stream's batch could wait,
/// dormant, hidden from every other stream and from Numba, until that stream allocates again.
[[nodiscard]] constexpr bool absorbs_free(detail::block_kind kind, detail::stream_ref key,
                                          bool in_stream_order) noexcept
{
  return kind != detail::block_kind::growable && key.is_context() && orders(key, in_stream_order);
}

}  // namespace emmpool::reuse_rule
