// Which private pool (a CUDA graph's, a cudagraph tree's, a torch.cuda.MemPool's) each of
// PyTorch's requests goes to, and PyTorch's private-pool calls passed on to emmpool's
// (emmpool/private_pools.hpp: which block serves what, when blocks go back, checkpoints; tested
// over the host driver). What stays here is what only PyTorch's types can say: which
// allocation goes to which pool (the filters PyTorch passes to beginAllocateToPool), the
// allocators of MemPools made with their own, and the checkpoint object cudagraph trees keep.
// Part of the one translation unit allocator.cpp.
#pragma once

#include "entry_points.hpp"

#include <emmpool/round_up.hpp>

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

void delete_block(void* ctx);  // the allocator's deleter (raw_deleter()), defined with it

// A pool's live blocks, as cudagraph trees checkpoint them.
struct pool_checkpoint final : cca::AllocatorState {
  int device{};
  MempoolId id{};
  std::vector<std::uint64_t> live;
};

class pool_routes {
 public:
  // Whether any pool is being allocated to (one atomic load on the allocation path).
  bool active() const noexcept { return active_.load(std::memory_order_acquire) != 0; }

  // The private pool this allocation goes to, if any: the newest begun whose filter takes it.
  bool pool_for(int device, cudaStream_t stream, MempoolId* id)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto it = begun_.rbegin(); it != begun_.rend(); ++it) {
      if (it->device == device && it->filter(stream)) {
        *id = it->id;
        return true;
      }
    }
    return false;
  }

  void* allocate(std::size_t size, int device, MempoolId id, cudaStream_t stream)
  {
    check_size(size);
    std::shared_ptr<cca::CUDAAllocator> source;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto it = allocators_.find(id);
      if (it != allocators_.end()) { source = it->second; }
    }
    // emmpool's own CUDA calls (growth) must not be refused by the capture's strictness, as
    // PyTorch's allocator relaxes it around cudaMalloc.
    c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
    if (source) {
      if (void* p = api.emmpool_private_take(private_id(id), size, device, stream)) { return p; }
      return allocate_outside(*source, id, size, device, stream);
    }
    emmpool_error error{EMMPOOL_FAILED_OTHER, {}};
    void* p = api.emmpool_private_allocate(private_id(id), size, device, stream, &error);
    if (p == nullptr) { fail(error, size, device); }
    return p;
  }

  void* allocate_on_oom(std::size_t size, int device, cudaStream_t stream)
  {
    return api.emmpool_private_allocate_on_oom(size, device, stream);
  }

  void record_stream(void* p) { api.emmpool_private_record_stream(p); }

  void create_or_incref(int device, MempoolId id, std::shared_ptr<cca::CUDAAllocator> allocator)
  {
    if (allocator) {
      std::lock_guard<std::mutex> lock{mutex_};
      allocators_[id] = std::move(allocator);
    }
    api.emmpool_private_create_or_incref(device, private_id(id));
  }

  int use_count(MempoolId id) { return api.emmpool_private_use_count(private_id(id)); }

  void set_use_on_oom(MempoolId id, bool on)
  {
    emmpool_error error{};
    if (api.emmpool_private_set_use_on_oom(private_id(id), on ? 1 : 0, &error) != 0) {
      raise(error.message);
    }
  }

  void set_no_split(MempoolId id)
  {
    emmpool_error error{};
    if (api.emmpool_private_set_no_split(private_id(id), &error) != 0) { raise(error.message); }
  }

  void begin(int device, MempoolId id, std::function<bool(cudaStream_t)> filter)
  {
    // Before the capture begins (PyTorch calls this first): emmpool then makes no call a
    // capture forbids until the matching end.
    emmpool_error error{};
    if (api.emmpool_private_begin(device, private_id(id), &error) != 0) { raise(error.message); }
    std::lock_guard<std::mutex> lock{mutex_};
    begun_.push_back(route{device, id, std::move(filter)});
    active_.store(static_cast<int>(begun_.size()), std::memory_order_release);
  }

  void end(int device, MempoolId id)
  {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto it = std::find_if(begun_.begin(), begun_.end(),
                             [&](route const& r) { return r.device == device && r.id == id; });
      if (it != begun_.end()) { begun_.erase(it); }
      active_.store(static_cast<int>(begun_.size()), std::memory_order_release);
    }
    api.emmpool_private_end(device, private_id(id));
    delete_returned();
  }

  void release(MempoolId id)
  {
    api.emmpool_private_release(private_id(id));
    delete_returned();
  }

  void empty_cache(MempoolId id)
  {
    api.emmpool_private_empty_cache(private_id(id));
    delete_returned();
  }

  void free(void* p)
  {
    api.emmpool_private_free(p);
    delete_returned();
  }

  // The device of a private block, -1 if p is not one.
  int device_of(void* p) { return api.emmpool_private_device_of(p); }

  bool live_blocks_are(MempoolId id, std::unordered_set<void*> const& expected)
  {
    std::vector<std::uint64_t> ptrs;
    ptrs.reserve(expected.size());
    for (void* p : expected) { ptrs.push_back(reinterpret_cast<std::uint64_t>(p)); }
    return api.emmpool_private_live_blocks_are(private_id(id), ptrs.data(), ptrs.size()) == 1;
  }

  std::shared_ptr<pool_checkpoint> checkpoint(int device, MempoolId id)
  {
    auto state    = std::make_shared<pool_checkpoint>();
    state->device = device;
    state->id     = id;
    state->live   = live_blocks(id);
    return state;
  }

  // The pool's live blocks become exactly the checkpoint's: every block live now is freed
  // (ptrs_freed), every block live then is allocated again and handed back as a DataPtr with
  // the allocator's deleter (dataptrs_allocd), which cudagraph trees give to their storages.
  cca::CheckpointDelta restore(pool_checkpoint const& state)
  {
    cca::CheckpointDelta delta;
    for (auto p : live_blocks(state.id)) { delta.ptrs_freed.push_back(reinterpret_cast<void*>(p)); }
    emmpool_error error{};
    if (api.emmpool_private_restore(private_id(state.id), state.live.data(), state.live.size(),
                                    &error) != 0) {
      raise(std::string{"emmpool: setCheckpointPoolState: "} + error.message);
    }
    c10::Device const where{c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(state.device)};
    for (auto p : state.live) {
      void* ptr = reinterpret_cast<void*>(p);
      delta.dataptrs_allocd.emplace_back(ptr, context_of(ptr, state.device, true), &delete_block,
                                         where);
    }
    return delta;
  }

 private:
  struct route {
    int device;
    MempoolId id;
    std::function<bool(cudaStream_t)> filter;
  };

  static std::vector<std::uint64_t> live_blocks(MempoolId id)
  {
    return rows_of<std::uint64_t>([id](std::uint64_t* out, std::size_t n) {
      return api.emmpool_private_live_blocks(private_id(id), out, n);
    });
  }

  // A block of a MemPool made with another allocator: that allocator's memory, counted
  // against emmpool's cap on the device first (PyTorch's allocator counts such a pool's
  // segments against its memory fraction too). Of the size emmpool's own block would have, which
  // the private pool records: a later request it serves fits.
  static void* allocate_outside(cca::CUDAAllocator& source, MempoolId id, std::size_t size,
                                int device, cudaStream_t stream)
  {
    std::size_t const rounded = emmpool::round_up(size, EMMPOOL_BLOCK_ALIGNMENT);
    auto const n              = static_cast<long long>(rounded);
    emmpool_error error{};
    int const counted = api.emmpool_torch_reserve_outside(device, n, &error);
    if (counted == 1) {
      fail_out_of_memory(size, device, "The pool's cap leaves no room for this block of a "
                                       "MemPool made with another allocator");
    }
    if (counted != 0) { raise(std::string{"emmpool: "} + error.message); }
    void* p = nullptr;
    try {
      p = source.raw_alloc_with_stream(rounded, stream);
    } catch (...) {
      (void)api.emmpool_torch_reserve_outside(device, -n, nullptr);
      throw;
    }
    if (p == nullptr) {  // as PyTorch takes a pool allocator's null: out of memory
      (void)api.emmpool_torch_reserve_outside(device, -n, nullptr);
      fail_out_of_memory(size, device, "The MemPool's own allocator returned no memory");
    }
    int const adopted =
      api.emmpool_private_adopt_foreign(private_id(id), p, rounded, device, stream, &error);
    if (adopted != 0) {
      // Refused: give it back to its allocator, unless a private block holds that address
      // already (the allocator handed it out twice): deleting it would free that block's
      // memory under it, so it is left alone.
      if (api.emmpool_private_device_of(p) < 0) { source.raw_delete(p); }
      (void)api.emmpool_torch_reserve_outside(device, -n, nullptr);
      raise(std::string{"emmpool: "} + error.message);
    }
    return p;
  }

  // Foreign blocks emmpool's pools are done with: deleted by their pools' allocators, and
  // counted off the cap. Never throws (called from destructors).
  void delete_returned() noexcept
  {
    auto const back = drain<emmpool_private_block>([](emmpool_private_block* out, std::size_t n) {
      return api.emmpool_private_returned_foreign(out, n);
    });
    for (auto const& b : back) {
      std::shared_ptr<cca::CUDAAllocator> source;
      {
        std::lock_guard<std::mutex> lock{mutex_};
        auto it = allocators_.find(mempool_id(b.pool));
        if (it != allocators_.end()) { source = it->second; }
      }
      try {
        if (source) { source->raw_delete(reinterpret_cast<void*>(b.ptr)); }
      } catch (...) {
      }
      (void)api.emmpool_torch_reserve_outside(b.device, -static_cast<long long>(b.size), nullptr);
    }
  }

  std::mutex mutex_;
  std::atomic<int> active_{0};  // begun_.size()
  std::vector<route> begun_;     // pools being allocated to, the newest last
  // The allocators of MemPools made with their own: kept for as long as the process may
  // return a block to one (a pool's id is never reused).
  std::map<MempoolId, std::shared_ptr<cca::CUDAAllocator>> allocators_;
};

}  // namespace
