/**
 * @file device_pool.hpp
 * @brief A stream-safe pool of device memory for one GPU.
 *
 * Segments come from the driver (cuMemAlloc). Requests up to `small_request` bytes are served
 * from small segments, larger ones from large segments, each by best fit over a size-ordered
 * set (O(log n)), splitting blocks and coalescing neighbours on return. Freed blocks go through
 * the deferred_free_queue (see its header for the reuse rule) before they can be reused.
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

#include <emmpool/deferred_free_queue.hpp>
#include <emmpool/detail/block.hpp>
#include <emmpool/detail/growable_segment.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/stats.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace emmpool {

/// As the stream of a free: fence it on the stream named when the block was allocated (the
/// CuPy entry point, whose free carries no stream, uses this). Never reaches the driver.
inline constexpr stream_handle allocation_stream = ~stream_handle{0};

enum class pool_mode : std::uint8_t { pool, passthrough };

/// How pool mode gets memory for requests above small_request. `growable`: one address
/// reservation whose pages are mapped on demand and unmapped when wholly free
/// (detail/growable_segment.hpp), where the device supports virtual memory management (fixed
/// elsewhere). Numba's blocks stay on fixed segments either way: Numba's IPC
/// (cuIpcGetMemHandle) cannot export VMM memory.
enum class segment_kind : std::uint8_t { fixed, growable };

/// @brief How a pool grows and what it keeps.
struct pool_options {
  pool_mode mode{pool_mode::pool};
  std::size_t initial_size{0};          ///< bytes reserved when the pool is created
  std::size_t maximum_size{0};          ///< cap on bytes reserved; 0: no cap but the device's
  double maximum_fraction{0.0};         ///< cap as a fraction of the device's memory; 0: unused
  std::size_t small_request{1u << 20};  ///< requests up to this size use small segments
  std::size_t small_segment{2u << 20};  ///< size of a small segment
  std::size_t large_segment{20u << 20}; ///< minimum size of a large segment
  std::size_t open_batch_limit{64u << 20};  ///< fence freed blocks past this many bytes
                                            ///< unfenced (dormant streams: one device sync)
  bool trace{false};                    ///< record every allocation and free (set_tracing)
  segment_kind segments{segment_kind::fixed};  ///< see segment_kind
  std::size_t growable_reserve{0};      ///< address space of a growable segment; 0: the
                                        ///< device's memory (at most the cap)
  std::size_t growable_room{20u << 20};  ///< growth maps up to this much of the free block
                                         ///< it carves (room for the next requests); 0: only
                                         ///< the pages the request needs
  std::size_t pinned_limit{0};          ///< host_pool: cap on pinned bytes held; 0: RAM / 4
};

/// @brief One allocation or free, as the optional trace records it.
struct trace_record {
  std::uint64_t time_ns;  ///< steady clock
  device_ptr ptr;
  std::size_t size;       ///< bytes requested (allocation) or held (free)
  stream_handle stream;
  char op;                ///< 'a' allocation, 'f' free
  std::uint8_t tag;       ///< alloc_tag
};

/// @brief Where a pooled block lies in its segment, for IPC.
struct ipc_info {
  ipc_bytes handle;          ///< the segment's handle
  device_ptr segment_base;
  std::size_t segment_size;
  std::size_t offset;        ///< block address - segment base
};

class device_pool {
 public:
  static constexpr std::size_t alignment = 256;

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
   *        (stream order; see deferred_free_queue.hpp). per_thread_stream counts as none. The
   *        stream is alive during the call (its id is asked: cuStreamGetId).
   * @throws out_of_memory after the out-of-memory ladder: promote completed frees, grow, wait
   *         for pending frees, release wholly free segments, grow again.
   */
  [[nodiscard]] device_ptr allocate(std::size_t bytes, stream_handle stream = legacy_stream,
                                    alloc_tag tag = alloc_tag::other);

  /**
   * @brief allocate(), when that takes neither a wait for the pool's lock nor a CUDA call that
   * may wait for the GPU (a named stream's id is asked: that never waits); a block on the free
   * lists, or one in stream order; std::nullopt otherwise: then call
   * allocate(). For callers holding a lock of their own (Python's GIL), who must not wait for
   * a thread that, holding the pool's lock, may be waiting for the GPU.
   */
  [[nodiscard]] std::optional<device_ptr> try_allocate(std::size_t bytes, stream_handle stream,
                                                       alloc_tag tag);

  /**
   * @brief Free a block. It becomes reusable once an event recorded on `stream` after this call
   * has completed (legacy_stream: after all blocking-stream work issued before the free), or at
   * once for an allocation on that same named stream. `allocation_stream`: the stream named
   * when the block was allocated (which may be gone by now: it is never passed to CUDA on
   * this free's account). Any other stream must be alive during the call (its id is asked).
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
  /// or allocation_stream); false if it could not be done so: then call deallocate().
  [[nodiscard]] bool try_deallocate(device_ptr ptr, stream_handle stream,
                                    std::uint64_t generation);

  /// @brief Free a block for a caller that knows its library but not its reset generation
  /// (the CuPy and PyTorch entry points): a retired block of that library at `ptr` is taken
  /// first, then a live one; a block of another library is never touched.
  void deallocate_tagged(device_ptr ptr, stream_handle stream, alloc_tag tag);

  /// @brief Incremented by every reset(); callers that may outlive a reset remember it.
  [[nodiscard]] std::uint64_t generation() const;

  /// @brief Declare that `stream` (e.g. a non-blocking stream) uses the block: its free then
  /// also waits for the work issued to `stream` before the free. As with PyTorch's
  /// record_stream, `stream` must stay alive until the block is freed: the free records an
  /// event on it. @throws pool_error
  void record_stream(device_ptr ptr, stream_handle stream);

  /// @brief Whether ptr is a live block of this pool (the start of one).
  [[nodiscard]] bool owns(device_ptr ptr) const;

  /// @brief IPC description of the block containing ptr (which may point inside it);
  /// std::nullopt if the pool did not allocate it. Marks the segment exported: it is never
  /// released to the driver while a block in it is live.
  /// @throws pool_error for a block of a growable segment (cuIpcGetMemHandle cannot export
  /// VMM memory; Numba's blocks never live there)
  [[nodiscard]] std::optional<ipc_info> ipc_handle(device_ptr ptr);

  /// @brief Whether requests above small_request (other than Numba's) use a growable
  /// segment: asked for in the options and supported by the driver and device.
  [[nodiscard]] bool growable() const noexcept { return vmm_page_ != 0; }

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

  /// @brief Start or stop recording allocations and frees (off: one branch per call).
  void set_tracing(bool on);
  /// @brief The records since the last call, oldest first; the trace keeps running.
  [[nodiscard]] std::vector<trace_record> take_trace();

  [[nodiscard]] pool_stats stats() const;
  void reset_peaks();
  /// @brief A one-line description of what the pool holds, for error messages.
  [[nodiscard]] std::string describe() const;

  /// @brief Whether this is a copy of the pool in a forked child (see above).
  [[nodiscard]] bool forked() const;

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] pool_options const& options() const noexcept { return options_; }

 private:
  using block      = detail::block;
  using segment    = detail::segment;
  using stream_ref = detail::stream_ref;
  struct by_size {
    bool operator()(block const* a, block const* b) const noexcept
    {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  using free_set = std::set<block*, by_size>;

  // All private members expect mutex_ held.
  [[nodiscard]] std::size_t max_reserved() const noexcept { return max_reserved_; }
  [[nodiscard]] free_set& free_list_for(std::size_t rounded) noexcept;
  block* take_best_fit(std::size_t rounded);
  block* take_without_cuda(std::size_t rounded, stream_ref stream, bool growable = false);
  /// More bytes wait unfenced in open batches than options().open_batch_limit, or more streams
  /// than deferred_free_queue::max_dormant have open batches.
  [[nodiscard]] bool fence_due() const noexcept
  {
    return queue_.dormant_due(options_.open_batch_limit);
  }
  block* split(block* blk, std::size_t rounded);
  block* grow(std::size_t rounded, bool exact, bool growable = false);
  // Growable segments (detail/growable_segment.hpp).
  [[nodiscard]] bool uses_growable(std::size_t rounded, alloc_tag tag) const noexcept
  {
    return vmm_page_ != 0 && rounded > options_.small_request && tag != alloc_tag::numba;
  }
  [[nodiscard]] free_set& list_of(segment const* seg) noexcept
  {
    return seg->growable ? growable_free_ : seg->small ? small_free_ : large_free_;
  }
  block* take_growable(std::size_t rounded, bool may_map);  // best fit; maps its pages
  bool map_for(device_ptr ptr, std::size_t rounded,          // false: cap or out of memory
               std::size_t available);                       // (bytes free from ptr)
  block* grow_growable(std::size_t rounded);                 // makes the segment first
  std::size_t unmap_free_pages();                            // wholly free pages; bytes
  void drop_growable(bool release);                          // segment gone (reset, dtor)
  device_ptr hand_out(block* blk, stream_ref stream, alloc_tag tag);  // free or pending
  void release_block(block* blk);             // from the queue: coalesce into free lists
  void maintain(stream_ref alive);            // fence frees (alive: the allocating stream)
  std::size_t release_free_segments(bool large_only = false);
  void release_segment(segment* seg);
  void erase_free(block* blk);
  void insert_free(block* blk);
  [[nodiscard]] std::string describe_locked() const;

  driver* driver_;
  int device_;
  pool_options options_;
  std::size_t max_reserved_{};
  mutable std::mutex mutex_;
  deferred_free_queue queue_;
  /// The stream_ref a free is queued on; std::nullopt: the block's allocation stream. Asks the
  /// driver for a named stream's id: only for a live block's free, never a retired one's.
  [[nodiscard]] std::optional<stream_ref> free_stream(stream_handle stream) const;
  void deallocate_locked(block* blk, std::optional<stream_ref> stream);
  block* take_live_locked(device_ptr ptr);  // off live_, or pool_error if not live
  void free_live_locked(device_ptr ptr, stream_handle stream);  // a current-generation free
  void free_retired(block* blk);

  std::map<device_ptr, std::unique_ptr<segment>> segments_;  // by base: IPC lookups
  std::unordered_map<device_ptr, block*> live_;               // allocated blocks by address
  // Segments that outlived a reset, and their live blocks, per generation they belong to.
  std::vector<std::unique_ptr<segment>> retired_segments_;
  std::map<std::pair<std::uint64_t, device_ptr>, block*> retired_live_;
  std::uint64_t generation_{};
  free_set small_free_;
  free_set large_free_;
  free_set growable_free_;                          // address space, mapped or not
  std::size_t vmm_page_{};                          // 0: fixed segments only
  std::unique_ptr<detail::growable_pages> pages_;   // the growable segment's pages
  segment* growable_seg_{};
  std::vector<std::unique_ptr<detail::growable_pages>> retired_pages_;  // left mapped
  detail::block_arena blocks_;
  int cleanup_deferrals_{};
  pool_stats stats_{};
  bool tracing_{};
  bool forked_{};  // this process is a fork() child of the one that made the pool
  std::vector<trace_record> trace_;
  void record(char op, device_ptr ptr, std::size_t size, stream_handle stream, std::uint8_t tag);
};

}  // namespace emmpool
