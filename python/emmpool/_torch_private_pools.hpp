// PyTorch's private pools over emmpool: the memory of CUDA graphs (torch.cuda.graph, the
// cudagraph trees of torch.compile(mode="reduce-overhead")) and of torch.cuda.MemPool. Part of
// the one translation unit _torch_allocator.cpp.
//
// What PyTorch's own allocator promises, and this keeps (c10/cuda/CUDACachingAllocator.cpp,
// Note [Interaction with CUDA graph capture]):
// - While a pool is being allocated to (beginAllocateToPool .. endAllocateToPool), allocations
//   that its filter accepts (the capturing stream, or the current thread for MemPool and
//   cudagraph trees' warm-up) come from the pool.
// - A pool's blocks keep their addresses for as long as the pool lives: a graph replays into
//   them. A block freed within the pool serves a later allocation of the same pool on the same
//   stream only (replays follow capture order on that stream), and never if record_stream said
//   another stream used it.
// - The pool lives while its use count is above zero (createOrIncrefPool, each begin and
//   MemPool, against releasePool); then its free blocks go back, its live ones when freed.
// - cudagraph trees checkpoint a pool's live blocks and restore them (getCheckpointState,
//   setCheckpointPoolState), and ask whether the live blocks are exactly the tensors they track
//   (checkPoolLiveAllocations).
//
// The blocks come from emmpool's pool on that device (one budget per GPU; a MemPool made with
// another allocator gets them from that allocator). A block is never split: freeing and reusing
// whole blocks is enough for capture order, and keeps the checkpoint a list of live blocks.
//
// During a capture nothing here calls what a capture forbids: emmpool's pool is told
// (capture_begin: no event query, record or synchronization, nothing given back) from the
// first begin to the last end, and a block returns to emmpool only after a device
// synchronization, which waits until no pool is being allocated to.
#pragma once

#include "_torch_entry_points.hpp"

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

void delete_block(void* ctx);  // the allocator's deleter (raw_deleter()), defined with it

std::string pool_name(MempoolId id)
{
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

// A pool's live blocks, as cudagraph trees checkpoint them.
struct private_pool_state final : cca::AllocatorState {
  int device{};
  MempoolId id{};
  std::vector<void*> live;
};

class private_pools {
 public:
  // What a memory snapshot shows of a private block.
  struct block_view {
    void* ptr;
    std::size_t size;
    MempoolId pool;
    bool live;
    cudaStream_t stream;
  };

  bool active() const noexcept { return active_.load(std::memory_order_acquire) != 0; }
  bool holds_any() const noexcept { return held_.load(std::memory_order_acquire) != 0; }

  // The private pool this allocation goes to, if any.
  bool pool_for(int device, cudaStream_t stream, MempoolId* id)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto it = allocating_.rbegin(); it != allocating_.rend(); ++it) {
      if (it->device == device && it->filter(stream)) {
        *id = it->id;
        return true;
      }
    }
    return false;
  }

  void* allocate(std::size_t size, int device, MempoolId id, cudaStream_t stream)
  {
    std::size_t const rounded = (size + 255) / 256 * 256;
    std::shared_ptr<cca::CUDAAllocator> source;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto& pool = pools_[id];
      if (void* p = take_free(pool, rounded, stream)) { return p; }
      source = pool.allocator;
    }
    // emmpool's own CUDA calls (growth) must not be refused by the capture's strictness, as
    // PyTorch's allocator relaxes it around cudaMalloc. No stream is named: nothing is
    // recorded on the capturing stream.
    c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
    void* p = source ? allocate_outside(*source, rounded, size, device, stream)
                     : allocate_or_throw(rounded, device, no_stream);
    std::lock_guard<std::mutex> lock{mutex_};
    blocks_[p] = block{id, rounded, device, stream, true, false, source != nullptr};
    pools_[id].blocks += 1;
    held_.fetch_add(1, std::memory_order_release);
    return p;
  }

  // An allocation outside the private pools ran out of memory: a free block of a MemPool made
  // with use_on_oom, freed on this stream, if one fits (as PyTorch's allocator does). The block
  // stays its pool's.
  void* allocate_on_oom(std::size_t size, int device, cudaStream_t stream)
  {
    std::size_t const rounded = (size + 255) / 256 * 256;
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto& [id, pool] : pools_) {
      if (!pool.use_on_oom || pool.device != device) { continue; }
      if (void* p = take_free(pool, rounded, stream)) { return p; }
    }
    return nullptr;
  }

  // tensor.record_stream() on a private block: it never serves its pool again (PyTorch defers
  // such blocks until the capture ends); it is held until the pool is released.
  void record_stream(void* p)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = blocks_.find(p);
    if (it != blocks_.end()) { it->second.shared = true; }
  }

  void create_or_incref(int device, MempoolId id, std::shared_ptr<cca::CUDAAllocator> allocator)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto& pool = incref(device, id);
    if (allocator) { pool.allocator = std::move(allocator); }
  }

  int use_count(MempoolId id)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = pools_.find(id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }

  void set_use_on_oom(MempoolId id, bool on)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    known(id).use_on_oom = on;
  }

  // MemPool(no_split=True): blocks are never split here.
  void set_no_split(MempoolId id)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    (void)known(id);
  }

  void begin(int device, MempoolId id, std::function<bool(cudaStream_t)> filter)
  {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      for (auto const& a : allocating_) {
        if (a.device == device && a.id == id) {
          raise("emmpool: already allocating to private pool " + pool_name(id) + " on device " +
                std::to_string(device));
        }
      }
      (void)incref(device, id);
      allocating_.push_back(allocating{device, id, std::move(filter)});
      active_.store(static_cast<int>(allocating_.size()), std::memory_order_release);
    }
    // Before the capture begins (PyTorch calls this first): emmpool makes no call a capture
    // forbids until the matching end.
    (void)api.capture(device, 1);
  }

  void end(int device, MempoolId id)
  {
    bool found = false;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      for (auto it = allocating_.begin(); it != allocating_.end(); ++it) {
        if (it->device == device && it->id == id) {
          allocating_.erase(it);
          found = true;
          break;
        }
      }
      active_.store(static_cast<int>(allocating_.size()), std::memory_order_release);
    }
    if (found) { (void)api.capture(device, 0); }
  }

  // PyTorch no longer needs the pool's addresses (its graphs and MemPool are gone): free
  // blocks go back now, live ones when they are freed.
  void release(MempoolId id)
  {
    std::vector<block_ref> give_back;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto it = pools_.find(id);
      if (it == pools_.end() || it->second.use_count == 0) { return; }
      if (--it->second.use_count > 0) { return; }
      it->second.released = true;
      collect_free(it, give_back);
    }
    return_blocks(std::move(give_back));
  }

  // torch.cuda.MemPool's destructor, empty_cache(): the free blocks of a pool nobody uses any
  // more ({0, 0}: of every such pool), and blocks whose return waited for a capture's end.
  void empty_cache(MempoolId id)
  {
    std::vector<block_ref> give_back;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      for (auto it = pools_.begin(); it != pools_.end();) {
        auto next = std::next(it);
        if ((id == MempoolId{0, 0} || it->first == id) && it->second.use_count == 0) {
          collect_free(it, give_back);
        }
        it = next;
      }
    }
    return_blocks(std::move(give_back));
  }

  void free(void* p)
  {
    std::vector<block_ref> give_back;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto it = blocks_.find(p);
      if (it == blocks_.end()) { return; }
      auto pool = pools_.find(it->second.pool);
      it->second.live = false;
      if (pool != pools_.end() && !pool->second.released) {
        if (!it->second.shared) { pool->second.free_blocks.emplace(it->second.size, p); }
        return;
      }
      // A block of a released pool: its last users may be a replay of the destroyed graph.
      give_back.push_back(unlink(it, pool));
    }
    return_blocks(std::move(give_back));
  }

  bool owns(void* p)
  {
    if (!holds_any()) { return false; }
    std::lock_guard<std::mutex> lock{mutex_};
    return blocks_.count(p) != 0;
  }

  int device_of(void* p)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = blocks_.find(p);
    return it == blocks_.end() ? 0 : it->second.device;
  }

  // Whether the pool's live blocks are exactly `expected` (cudagraph trees' check).
  bool live_blocks_are(MempoolId id, std::unordered_set<void*> const& expected)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    std::size_t live = 0;
    for (auto const& [p, b] : blocks_) {
      if (b.pool == id && b.live) {
        if (expected.count(p) == 0) { return false; }
        ++live;
      }
    }
    return live == expected.size();
  }

  std::shared_ptr<private_pool_state> checkpoint(int device, MempoolId id)
  {
    auto state    = std::make_shared<private_pool_state>();
    state->device = device;
    state->id     = id;
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto const& [p, b] : blocks_) {
      if (b.pool == id && b.live) { state->live.push_back(p); }
    }
    std::sort(state->live.begin(), state->live.end());
    return state;
  }

  // The pool's live blocks become exactly the checkpoint's: every block live now is freed
  // (ptrs_freed), every block live then is allocated again and handed back as a DataPtr with
  // the allocator's deleter (dataptrs_allocd), which cudagraph trees give to their storages.
  cca::CheckpointDelta restore(private_pool_state const& state)
  {
    cca::CheckpointDelta delta;
    std::lock_guard<std::mutex> lock{mutex_};
    auto pool = pools_.find(state.id);
    if (pool == pools_.end() || pool->second.released) {
      raise("emmpool: setCheckpointPoolState: private pool " + pool_name(state.id) +
            " is no longer alive");
    }
    for (void* p : state.live) {
      if (blocks_.count(p) == 0) {
        raise("emmpool: setCheckpointPoolState: a block of the checkpoint left private pool " +
              pool_name(state.id));
      }
    }
    pool->second.free_blocks.clear();
    for (auto& [p, b] : blocks_) {
      if (b.pool != state.id) { continue; }
      if (b.live) { delta.ptrs_freed.push_back(p); }
      b.live = false;
    }
    for (void* p : state.live) { blocks_.at(p).live = true; }
    for (auto& [p, b] : blocks_) {
      if (b.pool == state.id && !b.live && !b.shared) { pool->second.free_blocks.emplace(b.size, p); }
    }
    c10::Device const where{c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(state.device)};
    for (void* p : state.live) {
      delta.dataptrs_allocd.emplace_back(p, context_of(p, state.device, true), &delete_block, where);
    }
    return delta;
  }

  // On a device: the free blocks the pools keep that came from emmpool's pool (to emmpool they
  // are allocated, to PyTorch cached, as a freed block of PyTorch's own private pools is:
  // memory_allocated() leaves them out), and the bytes of the blocks that MemPools made with
  // another allocator hold (PyTorch counts them as reserved).
  struct device_totals {
    std::size_t cached_bytes{};
    std::size_t cached_blocks{};
    std::size_t foreign_bytes{};
  };
  device_totals totals(int device)
  {
    device_totals t;
    if (!holds_any()) { return t; }
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto const& [p, b] : blocks_) {
      if (b.device != device) { continue; }
      if (b.foreign) {
        t.foreign_bytes += b.size;
      } else if (!b.live) {
        t.cached_bytes += b.size;
        t.cached_blocks += 1;
      }
    }
    return t;
  }

  // Every private block, for a memory snapshot.
  std::vector<block_view> blocks_of(int device)
  {
    std::vector<block_view> out;
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto const& [p, b] : blocks_) {
      if (b.device == device) { out.push_back(block_view{p, b.size, b.pool, b.live, b.stream}); }
    }
    return out;
  }

 private:
  struct allocating {
    int device;
    MempoolId id;
    std::function<bool(cudaStream_t)> filter;
  };
  struct block {
    MempoolId pool;
    std::size_t size;
    int device;
    cudaStream_t stream;  // the allocation's: a freed block serves this stream only
    bool live;
    bool shared;          // record_stream'd: never reused within its pool
    bool foreign;         // from the pool's own allocator (MemPool(allocator=...))
  };
  struct pool {
    int device{};
    int use_count{0};
    bool released{false};
    bool use_on_oom{false};
    std::size_t blocks{0};
    std::shared_ptr<cca::CUDAAllocator> allocator;  // null: emmpool
    std::multimap<std::size_t, void*> free_blocks;
  };
  struct block_ref {
    void* ptr;
    int device;
    std::size_t size;
    std::shared_ptr<cca::CUDAAllocator> allocator;  // null: emmpool's
  };
  using pool_map = std::map<MempoolId, pool>;

  // A block of a MemPool made with another allocator: that allocator's memory, counted
  // against emmpool's cap on the device first (PyTorch's allocator counts such a pool's
  // segments against its memory fraction too).
  static void* allocate_outside(cca::CUDAAllocator& source, std::size_t rounded, std::size_t size,
                                int device, cudaStream_t stream)
  {
    auto const n = static_cast<long long>(rounded);
    char why[error_length];
    why[0] = '\0';
    int const counted = api.reserve_outside(device, n, why, sizeof why);
    if (counted == 1) {
      fail(0, size, device, "The pool's cap leaves no room for this block of a MemPool "
                            "made with another allocator");
    }
    if (counted != 0) { raise(std::string{"emmpool: "} + why); }
    try {
      return source.raw_alloc_with_stream(rounded, stream);
    } catch (...) {
      (void)api.reserve_outside(device, -n, nullptr, 0);
      throw;
    }
  }

  // One more user of the pool (made if new; alive again if it was released). mutex_ held.
  pool& incref(int device, MempoolId id)
  {
    auto& pool     = pools_[id];
    pool.device    = device;
    pool.use_count += 1;
    pool.released  = false;
    return pool;
  }

  pool& known(MempoolId id)
  {
    auto it = pools_.find(id);
    if (it == pools_.end()) { raise("emmpool: no private pool " + pool_name(id)); }
    return it->second;
  }

  // A free block of the pool freed on `stream`, at most twice the size (a best fit that wastes
  // little), now live; null if none. mutex_ held.
  void* take_free(pool& pool, std::size_t rounded, cudaStream_t stream)
  {
    for (auto it = pool.free_blocks.lower_bound(rounded);
         it != pool.free_blocks.end() && it->first <= 2 * rounded; ++it) {
      auto& b = blocks_.at(it->second);
      if (b.stream != stream) { continue; }
      void* p = it->second;
      pool.free_blocks.erase(it);
      b.live = true;
      return p;
    }
    return nullptr;
  }

  // The block leaves the books (and its pool, once empty and released). mutex_ held.
  block_ref unlink(std::unordered_map<void*, block>::iterator it, pool_map::iterator pool)
  {
    block_ref ref{it->first, it->second.device, it->second.size, nullptr};
    if (it->second.foreign && pool != pools_.end()) { ref.allocator = pool->second.allocator; }
    blocks_.erase(it);
    if (pool != pools_.end() && --pool->second.blocks == 0 && pool->second.released) {
      pools_.erase(pool);
    }
    return ref;
  }

  // A released pool's free blocks out of the books (the pool too, once it holds none).
  // mutex_ held.
  void collect_free(pool_map::iterator pool, std::vector<block_ref>& out)
  {
    auto const id = pool->first;
    pool->second.free_blocks.clear();
    for (auto b = blocks_.begin(); b != blocks_.end();) {
      if (b->second.pool == id && !b->second.live) {
        out.push_back(block_ref{b->first, b->second.device, b->second.size,
                                b->second.foreign ? pool->second.allocator : nullptr});
        b = blocks_.erase(b);
        --pool->second.blocks;
      } else {
        ++b;
      }
    }
    if (pool->second.blocks == 0 && pool->second.released) { pools_.erase(pool); }
  }

  // Blocks go back after a device synchronization: a replay of a destroyed graph may still
  // run (cudaGraphExecDestroy does not wait), on a stream emmpool was never told of. None is
  // possible while a pool is being allocated to (it would break a capture): they wait for a
  // later release, free or empty_cache.
  void return_blocks(std::vector<block_ref> blocks)
  {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      held_.fetch_sub(static_cast<int>(blocks.size()), std::memory_order_release);
      if (active() || (blocks.empty() && deferred_.empty())) {
        deferred_.insert(deferred_.end(), blocks.begin(), blocks.end());
        return;
      }
      blocks.insert(blocks.end(), deferred_.begin(), deferred_.end());
      deferred_.clear();
    }
    std::vector<int> synced;
    for (auto const& b : blocks) {
      if (std::find(synced.begin(), synced.end(), b.device) == synced.end()) {
        synced.push_back(b.device);
        try {
          c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(b.device)};
          C10_CUDA_CHECK_WARN(cudaDeviceSynchronize());
        } catch (...) {
          // called from destructors (CUDAGraph::reset, a tensor's deleter): never throw
        }
      }
      try {
        if (b.allocator) {
          b.allocator->raw_delete(b.ptr);
          (void)api.reserve_outside(b.device, -static_cast<long long>(b.size), nullptr, 0);
        } else {
          api.free(b.ptr, 0, b.device, nullptr);
        }
      } catch (...) {
      }
    }
  }

  std::mutex mutex_;
  std::atomic<int> active_{0};
  std::atomic<int> held_{0};  // blocks_ entries (counted with those awaiting return)
  std::vector<allocating> allocating_;
  pool_map pools_;
  std::unordered_map<void*, block> blocks_;
  std::vector<block_ref> deferred_;
};

}  // namespace
