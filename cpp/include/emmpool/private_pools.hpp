/**
 * @file private_pools.hpp
 * @brief PyTorch's private pools over the device pools: the memory of CUDA graphs
 * (torch.cuda.graph, the cudagraph trees of torch.compile(mode="reduce-overhead")) and of
 * torch.cuda.MemPool. The PyTorch extension translates PyTorch's allocator interface to this;
 * everything that decides which block goes where is here, tested over the host driver.
 *
 * What PyTorch's own allocator promises, and this keeps (c10/cuda/CUDACachingAllocator.cpp,
 * Note [Interaction with CUDA graph capture]):
 * - While a pool is being allocated to (begin .. end), allocations that PyTorch routes to it
 *   (the capturing stream, or the current thread for MemPool and cudagraph trees' warm-up)
 *   come from the pool: a free block of it (take), else a new block (adopt).
 * - A pool's blocks keep their addresses for as long as the pool lives: a graph replays into
 *   them. A block freed within the pool serves a later allocation of the same pool on the same
 *   stream only (replays follow capture order on that stream), and never if record_stream said
 *   another stream used it.
 * - The pool lives while its use count is above zero (create_or_incref, each begin, against
 *   release); then its free blocks go back, its live ones when freed.
 * - cudagraph trees checkpoint a pool's live blocks and restore them (live_blocks, restore),
 *   and ask whether the live blocks are exactly the tensors they track (live_blocks_are).
 *
 * Blocks come from the device pool of their device (adopted after the caller allocated them,
 * so that the out-of-memory hook and the caller's lock rules of the entry points apply), or,
 * for a MemPool made with another allocator ("foreign"), from that allocator: such blocks are
 * handed back to the caller to delete (take_returned_foreign), since only it knows that
 * allocator. A block is never split: freeing and reusing whole blocks is enough for capture
 * order, and keeps a checkpoint a list of live blocks.
 *
 * During a capture nothing here calls what a capture forbids: the device pool is told
 * (capture_begin: no event query, record or synchronization, nothing given back) from the
 * first begin to the last end, and a block returns to the device pool only after a device
 * synchronization, which waits until no pool is being allocated to: a replay of a destroyed
 * graph may still run (cudaGraphExecDestroy does not wait) on a stream the pool was never
 * told of.
 *
 * Thread-safe: one mutex; no device pool is called with it held.
 */
#pragma once

#include <emmpool/device_pool.hpp>
#include <emmpool/driver.hpp>

#include <atomic>
#include <cstdint>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emmpool {

/// @brief A private pool's id (PyTorch's MempoolId_t).
struct private_pool_id {
  std::uint64_t first{};
  std::uint64_t second{};
  friend bool operator==(private_pool_id a, private_pool_id b) noexcept
  {
    return a.first == b.first && a.second == b.second;
  }
  friend bool operator!=(private_pool_id a, private_pool_id b) noexcept { return !(a == b); }
  friend bool operator<(private_pool_id a, private_pool_id b) noexcept
  {
    return a.first != b.first ? a.first < b.first : a.second < b.second;
  }
};

/// @brief A private block, as statistics and a memory snapshot see it.
struct private_block {
  device_ptr ptr{};
  std::size_t size{};
  int device{};
  stream_handle stream{};  ///< the allocation's: a freed block serves this stream only
  private_pool_id pool{};
  bool live{};
  bool foreign{};          ///< from the pool's own allocator, not a device pool
};

class private_pools {
 public:
  /// `pool_of(device)`: the device pool a device's blocks come from and go back to.
  private_pools(driver& drv, std::function<device_pool&(int)> pool_of);
  private_pools(private_pools const&)            = delete;
  private_pools& operator=(private_pools const&) = delete;

  // ---- a pool's life --------------------------------------------------------------------------

  /// @brief One more user of pool `id` on `device` (made if new; alive again if it was
  /// released).
  void create_or_incref(int device, private_pool_id id);
  /// @brief Users of pool `id` (0 if unknown).
  [[nodiscard]] int use_count(private_pool_id id) const;
  /// @brief Whether an allocation outside the private pools that runs out of memory may take
  /// a free block of pool `id` (MemPool(use_on_oom=True)). @throws pool_error if unknown
  void set_use_on_oom(private_pool_id id, bool on);
  /// @brief MemPool(no_split=True): blocks are never split here; only checks the pool exists.
  void set_no_split(private_pool_id id);
  /// @brief The caller no longer needs the pool's addresses (its graphs and MemPool are
  /// gone): one user less; at none, free blocks go back now, live ones when freed.
  void release(private_pool_id id);
  /// @brief torch.cuda.empty_cache() ({0, 0}: every pool nobody uses) or a MemPool's
  /// destructor: the free blocks of such pools go back; so do blocks held for a capture's end.
  void empty_cache(private_pool_id id);

  // ---- allocating to a pool -------------------------------------------------------------------

  /// @brief Pool `id` is allocated to on `device` until end() (one more user meanwhile); the
  /// device pool enters capture mode. @throws pool_error if it is being allocated to already
  void begin(int device, private_pool_id id);
  /// @brief The matching end (also after a failed capture); nothing if begin() was not called.
  void end(int device, private_pool_id id);
  /// @brief Whether any pool is being allocated to: one atomic load.
  [[nodiscard]] bool active() const noexcept { return active_.load(std::memory_order_acquire) != 0; }

  // ---- blocks ---------------------------------------------------------------------------------

  /// @brief A cached block handed out again, and its bytes (up to twice what was asked).
  struct taken {
    device_ptr ptr;
    std::size_t size;
  };
  /// @brief A free block of pool `id` freed on `stream`, of at least `size` bytes and at most
  /// twice that (a best fit that wastes little), live again; nothing if none.
  [[nodiscard]] std::optional<taken> take(private_pool_id id, std::size_t size,
                                          stream_handle stream);
  /// @brief An allocation outside the private pools ran out of memory: a free block of a
  /// use_on_oom pool of `device` freed on `stream`, if one fits (it stays its pool's).
  [[nodiscard]] std::optional<taken> take_on_oom(std::size_t size, int device,
                                                 stream_handle stream);
  /// @brief `ptr` (`size` bytes on `device`, allocated for `stream`) is a new live block of
  /// pool `id`: from `device`'s pool, or `foreign` (the pool's own allocator). Made if new.
  /// @throws std::invalid_argument for a null `ptr` or one a private pool holds already
  /// (nothing changes)
  void adopt(private_pool_id id, device_ptr ptr, std::size_t size, int device,
             stream_handle stream, bool foreign);
  /// @brief tensor.record_stream() on a private block: it never serves its pool again (PyTorch
  /// defers such blocks until the capture ends); held until the pool is released.
  void record_stream(device_ptr ptr);
  /// @brief A private block is freed: free within its pool, or, if its pool was released,
  /// back (foreign: to take_returned_foreign). Nothing for a pointer that is not one.
  void free(device_ptr ptr);

  /// @brief Whether `ptr` is a private block (one atomic load while there are none).
  [[nodiscard]] bool owns(device_ptr ptr) const;
  /// @brief The device of a private block; std::nullopt if `ptr` is not one.
  [[nodiscard]] std::optional<int> device_of(device_ptr ptr) const;

  /// @brief Foreign blocks whose pool is done with them, the oldest, at most `max`: the caller
  /// deletes each with the pool's allocator (and counts its bytes off the device pool's
  /// reserve_outside()).
  [[nodiscard]] std::vector<private_block> take_returned_foreign(std::size_t max = SIZE_MAX);

  // ---- checkpoints (cudagraph trees) ----------------------------------------------------------

  /// @brief Whether pool `id`'s live blocks are exactly `expected`.
  [[nodiscard]] bool live_blocks_are(private_pool_id id, std::vector<device_ptr> expected) const;
  /// @brief Pool `id`'s live blocks, in address order (a checkpoint).
  [[nodiscard]] std::vector<device_ptr> live_blocks(private_pool_id id) const;
  /// @brief Pool `id`'s live blocks become exactly `live` (blocks of the pool, a checkpoint
  /// taken earlier): every other block of it is free within the pool (record_stream'd ones
  /// held). @throws pool_error if the pool was released, or a block of `live` left it
  void restore(private_pool_id id, std::vector<device_ptr> const& live);

  // ---- what statistics and snapshots show -----------------------------------------------------

  /// On a device: the free blocks the pools keep that came from its device pool (to the device
  /// pool allocated, to PyTorch cached), and the bytes foreign blocks hold.
  struct device_totals {
    std::size_t cached_bytes{};   ///< free blocks of the device's pool the private pools keep
    std::size_t cached_blocks{};
    std::size_t foreign_bytes{};  ///< blocks of pools' own allocators, live or cached
    std::size_t foreign_live_bytes{};  ///< of those, the live ones (PyTorch's in use)
    std::size_t foreign_live_blocks{};
  };
  [[nodiscard]] device_totals totals(int device) const;
  /// @brief Every private block of `device`.
  [[nodiscard]] std::vector<private_block> blocks_of(int device) const;

 private:
  struct pool {
    int device{};
    int use_count{};
    bool released{};
    bool use_on_oom{};
    std::size_t blocks{};
    std::multimap<std::size_t, device_ptr> free_blocks;  // by size
  };
  struct block {
    private_pool_id pool;
    std::size_t size;
    int device;
    stream_handle stream;
    bool live;
    bool shared;   // record_stream'd: never reused within its pool
    bool foreign;
  };
  using pool_map  = std::map<private_pool_id, pool>;
  using block_map = std::unordered_map<device_ptr, block>;

  // All expect mutex_ held.
  pool& incref(int device, private_pool_id id);
  pool& known(private_pool_id id);
  std::optional<taken> take_free(pool& p, std::size_t rounded, stream_handle stream);
  private_block unlink(block_map::iterator it, pool_map::iterator p);
  void collect_free(pool_map::iterator p, std::vector<private_block>& out);
  [[nodiscard]] static private_block view(device_ptr ptr, block const& b);

  // Called without mutex_: back to the device pools after a device synchronization, unless a
  // pool is being allocated to (then they wait for a later call).
  void give_back(std::vector<private_block> blocks);

  driver* driver_;
  std::function<device_pool&(int)> pool_of_;
  mutable std::mutex mutex_;
  std::atomic<int> active_{0};
  std::atomic<int> held_{0};  // blocks_ entries, with those awaiting their return
  std::vector<std::pair<int, private_pool_id>> allocating_;  // (device, id): begun, not ended
  pool_map pools_;
  block_map blocks_;
  std::vector<private_block> deferred_;  // to give back once no pool is allocated to
  std::vector<private_block> foreign_;   // to hand back to the caller
};

}  // namespace emmpool
