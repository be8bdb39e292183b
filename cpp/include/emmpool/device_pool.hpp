/**
 * @file device_pool.hpp
 * @brief A stream-safe pool of device memory for one GPU.
 *
 * Segments come from the driver (cuMemAlloc). Requests up to `small_request` bytes are served
 * from small segments, larger ones from large segments, each by best fit, splitting blocks and
 * coalescing neighbours on return (detail/free_list.hpp). Freed blocks come back to the free
 * lists only once the reuse rule allows (reuse_rule.hpp). This class is the only code that
 * moves a block between allocated, pending and free, and calls the layers below it one way:
 * a free goes stream key (detail/stream_key.hpp) -> off the books -> the stream's lane
 * (detail/stream_lanes.hpp: merged, joined) or the fence queue (detail/fence_queue.hpp); a
 * miss polls the fence queue, and each block it reports complete leaves its lane and joins
 * the free lists. Besides: growth and caps, the out-of-memory ladder, reset (what outlives
 * it: detail/retired_segments.hpp), IPC and statistics.
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
#include <emmpool/detail/fence_queue.hpp>
#include <emmpool/detail/free_list.hpp>
#include <emmpool/detail/growable_space.hpp>
#include <emmpool/detail/pool_lifecycle.hpp>
#include <emmpool/detail/retired_segments.hpp>
#include <emmpool/detail/stream_key.hpp>
#include <emmpool/detail/stream_lanes.hpp>
#include <emmpool/detail/trace_log.hpp>
#include <emmpool/reuse_rule.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/pool_options.hpp>
#include <emmpool/stats.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace emmpool {

/// @brief One block of a pool's segments, as a memory snapshot shows it (device_pool::layout()).
/// The blocks of a segment tile it, in address order.
struct layout_block {
  device_ptr segment;         ///< the segment's base
  std::size_t segment_size;
  device_ptr ptr;
  std::size_t size;
  std::uint8_t state;         ///< 0 free, 1 allocated, 2 freed and waiting for its fence
  std::uint8_t tag;           ///< the library that allocated it (alloc_tag; meaningful if not free)
  std::uint8_t kind;          ///< 0 small segment, 1 large, 2 growable (address space: its free
                              ///< blocks may be unmapped in part)
  stream_handle stream;       ///< the stream named at allocation (legacy_stream: none)
};

/// @brief Where a pooled block lies in its segment, for IPC.
struct ipc_info {
  ipc_bytes handle;          ///< the segment's handle
  device_ptr segment_base;
  std::size_t segment_size;
  std::size_t offset;        ///< block address - segment base
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

  /**
   * @brief Allocate `bytes` (rounded up to 256; 0 gives a distinct 256-byte block).
   * @param stream the stream the caller uses the block on; legacy_stream: none named. On a
   *        named stream, a block freed on that same stream may be handed out again at once
   *        (stream order; see reuse_rule.hpp). per_thread_stream counts as none. The
   *        stream is alive during the call (its id is asked: cuStreamGetId).
   * @throws out_of_memory after the out-of-memory ladder: promote completed frees, grow, wait
   *         for pending frees, release wholly free segments, grow again.
   */
  [[nodiscard]] device_ptr allocate(std::size_t bytes, stream_handle stream = legacy_stream,
                                    alloc_tag tag = alloc_tag::other,
                                    std::uint64_t* generation_out = nullptr);

  /**
   * @brief allocate(), when that takes neither a wait for the pool's lock nor a CUDA call that
   * may wait for the GPU (a named stream's id is asked: that never waits); a block on the free
   * lists, or one in stream order; std::nullopt otherwise: then call
   * allocate(). For callers holding a lock of their own (Python's GIL), who must not wait for
   * a thread that, holding the pool's lock, may be waiting for the GPU.
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
   * @throws pool_error if ptr is not a live block of this pool.
   */
  void deallocate(device_ptr ptr, stream_handle stream = legacy_stream);

  /**
   * @brief Free a block allocated in reset generation `generation` (see generation()). A free
   * from before a reset() never touches a block allocated after it, even at the same address.
   */
  void deallocate(device_ptr ptr, stream_handle stream, std::uint64_t generation);

  /// @brief That free without waiting for the pool's lock and without a CUDA call (the block is
  /// of the current generation, has no record_stream fence, and `stream` is a context stream
  /// or the allocation's); false if it could not be done so: then call deallocate().
  [[nodiscard]] bool try_deallocate(device_ptr ptr, stream_handle stream,
                                    std::uint64_t generation)
  {
    return try_free(ptr, stream, &generation, -1);
  }

  /// @brief Free a block for a caller that knows its library but not its reset generation
  /// (the CuPy and PyTorch entry points): a retired block of that library at `ptr` is taken
  /// first, then a live one; a block of another library is never touched.
  void deallocate_tagged(device_ptr ptr, stream_handle stream, alloc_tag tag);

  /// @brief deallocate_tagged() as try_deallocate() does it: false (then call
  /// deallocate_tagged()) unless it takes no wait for the lock and no CUDA call. No block
  /// retired by a reset may be live, since the free would look among them first.
  [[nodiscard]] bool try_deallocate_tagged(device_ptr ptr, stream_handle stream, alloc_tag tag)
  {
    return try_free(ptr, stream, nullptr, static_cast<std::uint8_t>(tag));
  }

  /// @brief Incremented by every reset(); callers that may outlive a reset remember it.
  using pool_lifecycle::generation;

  /// @brief Declare that `stream` (e.g. a non-blocking stream) uses the block: its free then
  /// also waits for the work issued to `stream` before the free. As with PyTorch's
  /// record_stream, `stream` must stay alive until the block is freed: the free records an
  /// event on it. @throws pool_error
  void record_stream(device_ptr ptr, stream_handle stream);

  /// @brief Whether ptr is a live block of this pool (the start of one).
  [[nodiscard]] bool owns(device_ptr ptr) const;

  /// @brief The live block containing ptr (which may point inside it), as {address, size};
  /// std::nullopt if no live block of this pool holds ptr. What "the allocation" of an array
  /// is for a caller that asks the driver (Numba's device_extents: cuMemGetAddressRange would
  /// answer with the whole segment, which other arrays share).
  [[nodiscard]] std::optional<std::pair<device_ptr, std::size_t>> live_extent(device_ptr ptr);

  /// @brief IPC description of the block containing ptr (which may point inside it);
  /// std::nullopt if the pool did not allocate it. A segment is never released to the driver
  /// while a block in it is live, exported or not.
  /// @throws pool_error for a block of a growable segment (cuIpcGetMemHandle cannot export
  /// VMM memory; Numba's blocks never live there)
  [[nodiscard]] std::optional<ipc_info> ipc_handle(device_ptr ptr);

  /// @brief Whether requests above small_request (other than Numba's) use a growable
  /// segment: asked for in the options and supported by the driver and device.
  [[nodiscard]] bool growable() const noexcept { return growable_.enabled(); }

  /// @brief Release wholly free segments to the driver (unless cleanup is deferred).
  /// @return bytes released
  std::size_t trim();

  /// @brief Wait for every pending free and make those blocks reusable.
  void synchronize();

  /// @brief The context is about to be reset: wait for pending frees, release everything free,
  /// retire segments that still hold live blocks (never reused, freed when empty, and only if
  /// the driver still knows them), and drop cached events.
  void reset();

  /// @brief While deferred (calls nest), nothing is returned to the driver; blocks still flow
  /// back into the pool.
  void defer_cleanup_begin();
  void defer_cleanup_end();

  /// @brief A CUDA graph may be captured on this device until the matching capture_end()
  /// (PyTorch's private pools say when; calls nest). Meanwhile the pool makes no CUDA call that
  /// a capture forbids or would record into the graph: no event query, record or
  /// synchronization, no segment or page given back (cuMemFree synchronizes). Frees still
  /// return blocks to their stream's order; those with a record_stream fence wait, unfenced,
  /// until the last capture_end(); what waits for a fence waits until then too. Growth still
  /// asks the driver: a capturing thread relaxes its capture mode around its own calls.
  void capture_begin();
  /// @throws pool_error without a matching capture_begin()
  void capture_end();
  [[nodiscard]] bool capturing() const;

  /// @brief Change the cap on bytes reserved (what maximum_size set; 0: none but the device's
  /// memory). Wholly free segments go back to the driver until reserved fits, if they can;
  /// otherwise the cap only stops growth. Frees waiting for their fence are waited for first
  /// (not during a capture). @throws pool_error if more than `bytes` is still in use
  void set_maximum_size(std::size_t bytes);
  /// @brief The cap on bytes reserved (SIZE_MAX: none).
  [[nodiscard]] std::size_t maximum_size() const;

  /// @brief Bytes that another allocator reserves for this pool's clients on the device (a
  /// PyTorch MemPool made with its own allocator) change by `delta`: they count against the cap
  /// as the pool's own segments do, so that the device keeps one budget. An increase that
  /// would pass the cap first gives wholly free segments back (not during a capture or a
  /// deferral). @returns false, counting nothing, if the increase still does not fit
  [[nodiscard]] bool reserve_outside(std::ptrdiff_t delta);
  /// @brief What reserve_outside() counts now.
  [[nodiscard]] std::size_t reserved_outside() const;

  /// @brief Every block of every segment, in address order (a memory snapshot). A growable
  /// segment counts only its mapped pages in reserved; its free blocks are reported whole.
  [[nodiscard]] std::vector<layout_block> layout() const;

  /// @brief Start or stop recording allocations and frees (off: one branch per call).
  void set_tracing(bool on);
  /// @brief The records since the last call, oldest first; the trace keeps running.
  [[nodiscard]] std::vector<trace_record> take_trace();

  [[nodiscard]] pool_stats stats() const;
  void reset_peaks();
  /// @brief A one-line description of what the pool holds, for error messages.
  [[nodiscard]] std::string describe() const;

  /// @brief Whether this is a copy of the pool in a forked child (see above).
  using pool_lifecycle::forked;

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] pool_options const& options() const noexcept { return options_; }

 private:
  using block      = detail::block;
  using segment    = detail::segment;
  using stream_ref = detail::stream_ref;

  // All private members expect mutex_ held.
  // ---- allocation
  block* take_without_cuda(std::size_t rounded, stream_ref stream);  // stream order, best fit
  block* take_growable_without_cuda(std::size_t rounded, stream_ref stream);  // maps no page
  // best fit and split; a growable request maps pages only if may_map
  block* take_best_fit(std::size_t rounded, bool growable = false, bool may_map = true);
  block* take_growable(std::size_t rounded, bool may_map);  // room made first, then mapped
  // which segments serve a request (a segment serves one kind)
  [[nodiscard]] detail::block_kind kind_of(std::size_t rounded, bool growable) const noexcept;
  device_ptr hand_out(block* blk, std::size_t bytes, stream_ref stream, alloc_tag tag);
  /// The last try_allocate() that searched and missed, so that the allocate() after it neither
  /// checks the same request nor searches again while the batches (fence_queue::version) and
  /// the free lists (insertions: taking a block out cannot make best fit succeed) are as then.
  struct missed_request {
    std::size_t bytes{};
    stream_handle stream{};
    alloc_tag tag{};
    std::size_t rounded{};
    stream_ref key{};
    std::uint64_t insertions{}, version{};  // the state searched
  };
  std::optional<missed_request> missed_;
  // ---- growth and giving memory back
  block* grow(std::size_t rounded, bool exact, bool growable = false);
  // At a new peak (growing by `need`): large segments only, and few pages (growable_space).
  std::size_t release_free_segments(bool at_peak = false, std::size_t need = 0);
  void release_segment(segment* seg);
  // The segment that holds ptr, if it has a live block (IPC, live_extent); else null.
  [[nodiscard]] segment* segment_with_live_blocks(device_ptr ptr) const;
  // ---- frees
  void free_live(device_ptr ptr, stream_handle stream, int tag = -1);  // of library tag (>= 0)
  // try_deallocate(_tagged): of that generation (null: none retired), of library tag (>= 0).
  bool try_free(device_ptr ptr, stream_handle stream, std::uint64_t const* generation, int tag);
  using live_map = detail::live_map;
  void off_books(live_map::iterator it, stream_ref key);  // a freed block: stats, trace
  // Off the books: to its lane or the fences. Out of line: inlined into every free, the key
  // stayed in memory, and the pair paid a stalled reload.
  [[gnu::noinline]] void settle_freed(block* blk, stream_ref key);
  void pend(block* blk, stream_ref key);          // into key's batch, takeable if key orders
  void settle_fenced();                           // fenced_: out of lanes, into the free lists
  void release_block(block* blk);                 // every fence done: into the free lists
  void maintain(stream_ref alive);
  void drain();  // wait for every pending free
  void settle_held_for_capture();  // held_for_capture_ fenced now
  void release_held_back();        // the last deferral ended: passthrough's free segments
  [[nodiscard]] pool_stats stats_locked() const;  // the full snapshot
  // The cap less what other allocators reserve for the pool's clients: what growth may reach.
  [[nodiscard]] std::size_t growth_cap() const noexcept
  {
    return max_reserved_ - std::min(max_reserved_, reserved_outside_);
  }
  // Whether `n` more bytes reserved stay within growth_cap().
  [[nodiscard]] bool fits_cap(std::size_t n) const noexcept
  {
    std::size_t const cap = growth_cap();
    return n <= cap && stats_.bytes_reserved <= cap - n;
  }
  [[nodiscard]] std::string describe_locked() const;

  driver* driver_;
  int device_;
  pool_options options_;
  std::size_t max_reserved_{};
  detail::stream_keys keys_{*driver_, device_};
  detail::fence_queue fences_{*driver_, device_, options_.open_batch_limit};
  std::map<device_ptr, std::unique_ptr<segment>> segments_;  // by base: IPC lookups
  live_map live_;                                             // allocated blocks by address
  detail::block_arena blocks_;
  detail::free_lists free_{blocks_};
  detail::stream_lanes lanes_{fences_, blocks_, free_, options_.mode == pool_mode::pool};
  detail::retired_segments retired_{*driver_, device_, blocks_};  // outlived a reset()
  pool_stats stats_{};
  detail::trace_log trace_;
  std::vector<detail::fenced_block> fenced_;  // what the fences reported, until settled
  int captures_{};  // capture_begin() calls not ended: no CUDA call a capture forbids
  // Freed with a record_stream fence during a capture: settled at the last capture_end().
  std::vector<std::pair<block*, stream_ref>> held_for_capture_;
  std::size_t reserved_outside_{};  // reserve_outside(): counted against the cap
  // Last: the members above keep the layout (cache lines) of fixed segments' hot path.
  detail::growable_space growable_{*driver_, device_, blocks_, stats_};
};

}  // namespace emmpool
