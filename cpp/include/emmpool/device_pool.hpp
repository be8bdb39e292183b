/**
 * @file device_pool.hpp
 * @brief A stream-safe pool of device memory for one GPU.
 *
 * Segments come from the driver (cuMemAlloc). Requests up to `small_request` bytes are served
 * from small segments, larger ones from large segments (or pages of a growable segment), each
 * by best fit, splitting blocks and coalescing neighbours on return (detail/free_list.hpp).
 * Freed blocks come back to the free lists only once the reuse rule allows (reuse_rule.hpp).
 *
 * Its public members are what a caller needs to allocate and free. What else a caller asks of
 * a pool goes through a view of its own, made over the pool where it is needed, each in its
 * own header: pool_controls.hpp (the cap, captures, deferred cleanup, reset), pool_queries.hpp
 * (which block holds an address, the layout), pool_sharing.hpp (IPC handles, pages, holds),
 * pool_observers.hpp (traces, segment events).
 *
 * This class is the only code that moves a block between allocated, pending and free. It calls
 * the layers below it one way, each with one job:
 *   detail/stream_key.hpp      how the stream of a request or a free is named
 *   detail/stream_lanes.hpp    the blocks that wait for their fence (the fence queue's batches)
 *                              and stream order over them: pend, merge, join, take, poll
 *   detail/free_list.hpp       best fit, split and coalesce of the blocks free now
 *   detail/growable_space.hpp  the growable segment and its pages (detail/page_policy.hpp:
 *                              when it maps, keeps, moves and gives back)
 *   detail/segment_index.hpp   segments and live blocks by address, and the questions asked of
 *                              them (owns, live_extent, ipc, layout)
 *   detail/pool_ledger.hpp     what it holds from the driver: reserved, peak, segments, pages
 *   detail/pool_cap.hpp        the cap, and what another allocator reserves against it
 *   pool_options.hpp           how big a segment to make (segment_size: the growth policy)
 *   detail/capture_mode.hpp    deferred cleanup and CUDA graph captures: what may not be done
 *   detail/retired_segments.hpp  what outlives a reset
 * Its bodies are in device_pool.cpp: an allocation's ladder, growth, a free, statistics.
 *
 * In passthrough mode every allocation is its own segment, released to the driver once its
 * fence has completed: the mode for compute-sanitizer and for code that assumes one allocation
 * per cuMemAlloc.
 *
 * Thread-safe: one mutex per pool. Frees call CUDA only to identify a stream the caller names
 * and to record a record_stream fence; those of Numba, CuPy and PyTorch do neither.
 *
 * Fork: CUDA cannot be used in a child forked after its parent used the GPU. Every pool takes
 * its mutex around fork() (so the child never inherits one held by another thread); in the
 * child it turns inert: allocations raise pool_error saying why, frees (finalizers of
 * inherited arrays) do nothing, and nothing ever calls the driver — the memory is the parent's.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/capture_mode.hpp>
#include <emmpool/detail/free_list.hpp>
#include <emmpool/detail/growable_space.hpp>
#include <emmpool/detail/pool_cap.hpp>
#include <emmpool/detail/pool_ledger.hpp>
#include <emmpool/detail/pool_lifecycle.hpp>
#include <emmpool/detail/retired_segments.hpp>
#include <emmpool/detail/segment_index.hpp>
#include <emmpool/detail/segment_log.hpp>
#include <emmpool/detail/stream_key.hpp>
#include <emmpool/detail/stream_lanes.hpp>
#include <emmpool/detail/trace_log.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/pool_layout.hpp>
#include <emmpool/pool_options.hpp>
#include <emmpool/reuse_rule.hpp>
#include <emmpool/stats.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace emmpool {

/// @brief Who frees a block, and so which block a free may take: the pointer alone does not
/// say, once a reset has retired blocks whose addresses the driver may hand out again.
class block_owner {
 public:
  /// The live block at the pointer, whoever allocated it (a caller that outlives no reset).
  [[nodiscard]] static constexpr block_owner any() noexcept { return {}; }
  /// The block the caller allocated in reset generation `g` (device_pool::generation(); Numba's
  /// finalizers): a free from before a reset never touches a block allocated after it.
  [[nodiscard]] static constexpr block_owner of_generation(std::uint64_t g) noexcept
  {
    block_owner o;
    o.generation_ = g;
    o.has_generation_ = true;
    return o;
  }
  /// A block of library `tag`, for a caller that knows its library but not its generation
  /// (CuPy, PyTorch, RMM, cuda.core): a retired block of that library at the pointer is taken
  /// first (newest generation first), then a live one; another library's is never touched.
  [[nodiscard]] static constexpr block_owner of_library(alloc_tag tag) noexcept
  {
    block_owner o;
    o.tag_ = static_cast<int>(tag);
    return o;
  }

  [[nodiscard]] constexpr bool has_generation() const noexcept { return has_generation_; }
  [[nodiscard]] constexpr std::uint64_t generation() const noexcept { return generation_; }
  [[nodiscard]] constexpr bool has_library() const noexcept { return tag_ >= 0; }
  [[nodiscard]] constexpr std::uint8_t library() const noexcept
  {
    return static_cast<std::uint8_t>(tag_);
  }

 private:
  constexpr block_owner() noexcept = default;
  std::uint64_t generation_{};
  bool has_generation_{};
  int tag_{-1};
};

class device_pool : private detail::pool_lifecycle {
 public:
  static constexpr std::size_t alignment = block_alignment;

  /// @throws std::invalid_argument if the options are inconsistent
  device_pool(driver& drv, int device, pool_options options);
  /// Returns every segment to the driver, unless the process is exiting (then it leaks: the
  /// driver may be gone).
  ~device_pool();
  device_pool(device_pool const&)            = delete;
  device_pool& operator=(device_pool const&) = delete;

  // ---- allocation and free --------------------------------------------------------------------

  /**
   * @brief Allocate `bytes` (rounded up to 256; 0 gives a distinct 256-byte block).
   * @param stream the stream the caller uses the block on; legacy_stream: none named. On a
   *        named stream, a block freed on that same stream may be handed out again at once
   *        (stream order; see reuse_rule.hpp). per_thread_stream counts as none. The
   *        stream is alive during the call (its id is asked: cuStreamGetId).
   * @param generation_out where given, the reset generation the block belongs to (to free it
   *        with: block_owner::of_generation), read under the same lock.
   * @throws out_of_memory after the out-of-memory ladder (allocate() in device_pool.cpp).
   */
  [[nodiscard]] device_ptr allocate(std::size_t bytes, stream_handle stream = legacy_stream,
                                    alloc_tag tag = alloc_tag::other,
                                    std::uint64_t* generation_out = nullptr);

  /**
   * @brief allocate(), when that takes neither a wait for the pool's lock nor a CUDA call that
   * may wait for the GPU (a named stream's id is asked: that never waits); a block on the free
   * lists, or one in stream order; std::nullopt otherwise: then call allocate(). For callers
   * holding a lock of their own (Python's GIL), who must not wait for a thread that, holding
   * the pool's lock, may be waiting for the GPU.
   */
  [[nodiscard]] std::optional<device_ptr> try_allocate(std::size_t bytes, stream_handle stream,
                                                       alloc_tag tag,
                                                       std::uint64_t* generation_out = nullptr);

  /**
   * @brief Free a block. It becomes reusable once an event recorded on `stream` after this call
   * has completed (legacy_stream: after all blocking-stream work issued before the free), or at
   * once for an allocation on that same named stream. `allocation_stream`: the stream named
   * when the block was allocated (which may be gone by now: it is never passed to CUDA on
   * this free's account); so is a stream with that stream's handle. Any other stream must be
   * alive during the call (its id is asked).
   * Calls CUDA only for that id, and to record a record_stream fence (see record_stream).
   * @param owner which block a free may take (block_owner).
   * @throws pool_error if ptr is not a live block of this pool for `owner`.
   */
  void deallocate(device_ptr ptr, stream_handle stream = legacy_stream,
                  block_owner owner = block_owner::any());

  /// @brief deallocate() when that takes no wait for the pool's lock and no CUDA call (a block
  /// of the current generation, no record_stream fence, `stream` a context stream or the
  /// allocation's, and for a library's free no retired block left); false if it could not be
  /// done so: then call deallocate().
  [[nodiscard]] bool try_deallocate(device_ptr ptr, stream_handle stream, block_owner owner);

  /// @brief Incremented by every reset(); callers that may outlive a reset remember it.
  using pool_lifecycle::generation;

  /// @brief Declare that `stream` (e.g. a non-blocking stream) uses the block: its free then
  /// also waits for the work issued to `stream` before the free. As with PyTorch's
  /// record_stream, `stream` must stay alive until the block is freed: the free records an
  /// event on it. @throws pool_error
  void record_stream(device_ptr ptr, stream_handle stream);

  // ---- giving memory back ---------------------------------------------------------------------

  /// @brief Release wholly free segments and pages to the driver (unless cleanup is deferred:
  /// pool_controls), after waiting for every pending free. @return bytes released
  std::size_t trim();

  /// @brief Wait for every pending free and make those blocks reusable.
  void synchronize();

  // ---- what it holds --------------------------------------------------------------------------

  [[nodiscard]] pool_stats stats() const;

  /// @brief Whether requests above small_request use a growable segment: asked for in the
  /// options and supported by the driver and device.
  [[nodiscard]] bool growable() const noexcept { return growable_.enabled(); }

  /// @brief Whether this is a copy of the pool in a forked child (see above).
  using pool_lifecycle::forked;

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] pool_options const& options() const noexcept { return options_; }

 private:
  // The pool's other faces, each a view made where it is needed, over this state and lock
  // (their headers say what each is for); the pool never calls them.
  friend class pool_controls;
  friend class pool_queries;
  friend class pool_sharing;
  friend class pool_observers;

  using block      = detail::block;
  using segment    = detail::segment;
  using stream_ref = detail::stream_ref;

  // All private members expect mutex_ held.

  // ---- an allocation's ladder (device_pool.cpp)
  enum class peak_wait : std::uint8_t { none, due, done };
  /// One allocation, as the ladder's steps see it.
  struct request {
    std::size_t bytes{};    ///< as asked (the trace's size)
    std::size_t rounded{};  ///< as served
    stream_ref key{};
    alloc_tag tag{};
    bool growable{};        ///< served by the growable segment (growable_space::serves)
    /// The new-peak wait (detail/page_policy.hpp): `due` once map_pages() found that new
    /// pages would pass the peak while the stream's own frees could cover them, `done` once
    /// wait_for_own_frees() waited (a request waits so at most once).
    mutable peak_wait at_peak{peak_wait::none};
  };
  /// How much a fixed segment holds: what several requests of its kind share
  /// (pool_options::segment_size), or the request alone (the out-of-memory ladder's last try).
  enum class growth : std::uint8_t { shared, exact };
  /// What giving memory back takes: every wholly free segment and page, or (at a fixed
  /// segment's new peak) the wholly free large segments only.
  enum class give_back : std::uint8_t { all, large_at_peak };
  // The ladder's steps, in order (allocate() in device_pool.cpp says what each does); each
  // returns the block or null and runs no other step.
  block* take_cached(request const& r);
  block* fence_and_retake(request const& r);
  block* map_pages(request const& r);
  block* wait_for_own_frees(request const& r);
  block* grow_for(request const& r);
  block* wait_and_retake(request const& r);
  block* give_back_and_grow(request const& r);
  block* passthrough_allocate(request const& r);  // passthrough: a segment of its own
  [[noreturn]] void fail(request const& r);
  // What the steps share: a free block (mapping its pages only if allowed), and the growable
  // segment's claim of a block and map of its pages.
  block* take_free(request const& r, detail::mapping m);
  block* claim_and_map(request const& r);
  // which segments serve a request (a segment serves one kind)
  [[nodiscard]] detail::block_kind kind_of(request const& r) const noexcept;
  // Whether pages may be unmapped now (no capture, no deferred cleanup).
  [[nodiscard]] detail::unmapping unmapping() const noexcept;
  device_ptr hand_out(block* blk, std::size_t bytes, stream_ref stream, alloc_tag tag);

  // ---- growth and giving memory back (device_pool.cpp)
  // A fixed segment for the request (pool_options::segment_size), null at the cap or out of
  // memory.
  block* grow(request const& r, growth g);
  // The driver's segment, on the books; null if the driver is out of memory.
  block* make_segment(std::size_t size, bool small, alloc_tag tag);
  // Wholly free fixed segments and pages back to the driver. @return bytes released
  std::size_t release_free_segments(give_back what);
  void release_segment(segment* seg);

  // ---- frees (device_pool.cpp)
  // The live block at ptr that `owner` may free; throws pool_error saying why not.
  [[nodiscard]] detail::live_map::iterator live_block_of(device_ptr ptr, block_owner owner);
  // a freed block: stats, trace, its share key
  void off_books(detail::live_map::iterator it, stream_ref key);
  // Off the books: to its lane or the fences. Out of line: inlined into every free, it keeps
  // the key in memory, and the allocate + free pair pays a stalled reload.
  [[gnu::noinline]] void settle_freed(block* blk, stream_ref key);
  void absorb_free_neighbours(block* blk);  // off the free lists, for a merge to take them
  void settle_released();                   // released_: into the free lists
  void release_block(block* blk);           // every fence done: into the free lists
  void maintain(stream_ref alive);
  // Wait for every pending free, or `only` that stream's (stream_lanes::drain).
  void drain(std::optional<stream_ref> only = std::nullopt);
  void settle_held_for_capture();  // what capture_mode held, fenced now
  void release_held_back();        // the last deferral ended: passthrough's free segments
  [[nodiscard]] pool_stats stats_locked() const;  // the full snapshot
  [[nodiscard]] std::string describe_locked() const;

  driver* driver_;
  int device_;
  pool_options options_;
  detail::pool_cap cap_;
  detail::stream_keys keys_{*driver_, device_};
  detail::segment_index index_;  // segments by base, allocated blocks by address
  detail::block_arena blocks_;
  detail::free_lists free_{blocks_};
  detail::stream_lanes lanes_{*driver_, device_, options_.open_batch_limit, blocks_,
                              options_.mode == pool_mode::pool};
  detail::retired_segments retired_{*driver_, device_, blocks_};  // outlived a reset()
  pool_stats stats_{};          // in use, allocations and frees, fences; the rest: ledger_
  detail::pool_ledger ledger_;  // what the pool holds from the driver
  detail::trace_log trace_;
  detail::segment_log segment_log_;
  std::vector<block*> released_;  // what the fences reported complete, until settled
  // Held blocks (pool_sharing::hold), by address: how many holds, and the key of a free that
  // came while held (none: not freed yet).
  struct hold_state {
    block* blk{};
    std::size_t count{};
    std::optional<stream_ref> freed_on;
  };
  std::map<device_ptr, hold_state> holds_;
  void settle_unheld(hold_state const& h);  // its last hold went: a free that came settles
  void release_holds();                      // a reset: every hold goes
  // Shared growable blocks' keys (pool_sharing::share_pages), by block address: forgotten
  // when the block is freed, or, held, when its last hold goes: a block at the same address
  // later is another block, whose pages no old handle reaches.
  std::map<device_ptr, share_key> shares_;
  void forget_share(device_ptr at)
  {
    if (!shares_.empty()) { shares_.erase(at); }
  }
  detail::capture_mode capture_;
  // Last: the members above keep the layout (cache lines) of fixed segments' hot path.
  detail::growable_space growable_{*driver_, device_, blocks_, ledger_, cap_, segment_log_};
};

}  // namespace emmpool
