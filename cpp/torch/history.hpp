// PyTorch's memory history over emmpool (torch.cuda.memory._record_memory_history): the trace
// of PyTorch's allocations, frees, segments and out-of-memory errors, with the stack each was
// made from, in PyTorch's TraceEntry format, and the stack that allocated each live block. Part
// of the one translation unit allocator.cpp.
//
// The context function PyTorch hands over gathers Python and C++ stacks (it takes the GIL): it
// is called before anything is recorded, with no lock of emmpool's or of this file held, so a
// thread that holds the GIL and waits for one of those locks never blocks it. Segments are
// emmpool's, which every library shares: while the history is on, the pools record their
// segment events (made, released, pages mapped and unmapped: emmpool_torch_watch_segments),
// which are taken here at each allocation and free and written as segment_alloc,
// segment_free, segment_map and segment_unmap.
#pragma once

#include "entry_points.hpp"

#include <c10/util/ApproximateClock.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using cca::RecordContext;
using cca::TraceEntry;
using context_ptr = std::shared_ptr<c10::GatheredContext>;

// TraceEntry's action of a name in torch.cuda.memory._record_memory_history(skip_actions=...).
int action_named(std::string const& name)
{
  static std::pair<char const*, TraceEntry::Action> const names[] = {
    {"alloc", TraceEntry::ALLOC},
    {"free_requested", TraceEntry::FREE_REQUESTED},
    {"free_completed", TraceEntry::FREE_COMPLETED},
    {"segment_alloc", TraceEntry::SEGMENT_ALLOC},
    {"segment_free", TraceEntry::SEGMENT_FREE},
    {"segment_map", TraceEntry::SEGMENT_MAP},
    {"segment_unmap", TraceEntry::SEGMENT_UNMAP},
    {"snapshot", TraceEntry::SNAPSHOT},
    {"oom", TraceEntry::OOM},
  };
  for (auto const& [n, action] : names) {
    if (name == n) { return action; }
  }
  raise("emmpool: unknown trace action " + name);
}

class memory_history {
 public:
  // Anything to do at all: the history or a trace tracker (one branch per allocation when off).
  bool on() const noexcept { return on_.load(std::memory_order_acquire); }
  bool enabled() const noexcept { return enabled_.load(std::memory_order_acquire); }

  void configure(bool enabled, cca::CreateContextFn recorder, std::size_t max_entries,
                 RecordContext when, bool clear, std::vector<std::string> const& skip_actions)
  {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      enabled_.store(enabled, std::memory_order_release);
      recorder_    = enabled ? recorder : nullptr;
      when_        = enabled ? when : RecordContext::NEVER;
      max_entries_ = std::max<std::size_t>(1, max_entries);
      skip_.clear();
      for (auto const& a : skip_actions) { skip_.insert(action_named(a)); }
      if (!enabled || clear) {
        traces_.clear();
        if (!enabled) { contexts_.clear(); }
      }
      update_on();
    }
    watch_segments();
  }

  void add_tracker(cca::AllocatorTraceTracker tracker)
  {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      trackers_.push_back(std::move(tracker));
      update_on();
    }
    watch_segments();
  }

  // The stack now, if the history keeps stacks at `level` (STATE: of live blocks; ALLOC: of
  // allocations in the trace; ALL: of frees too). Call with no lock held.
  context_ptr gather(RecordContext level) const
  {
    cca::CreateContextFn recorder = nullptr;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      if (when_ >= level) { recorder = recorder_; }
    }
    return recorder != nullptr ? recorder() : nullptr;
  }

  void allocated(int device, void* p, std::size_t requested, cudaStream_t stream, MempoolId pool,
                 context_ptr const& context)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    if (enabled()) { contexts_[p] = live_block{context, requested}; }
    record(TraceEntry::ALLOC, device, reinterpret_cast<std::uintptr_t>(p), requested, stream, pool,
           when_ >= RecordContext::ALLOC ? context : nullptr);
  }

  // emmpool returns a freed block to its pool once the GPU is done with it (reuse_rule.hpp);
  // PyTorch's viewer pairs each alloc with a free_completed, recorded here with the request.
  void freed(int device, void* p, cudaStream_t stream, MempoolId pool, context_ptr const& context)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    std::size_t size = 0;
    auto it = contexts_.find(p);
    if (it != contexts_.end()) {
      size = it->second.requested;
      contexts_.erase(it);
    }
    auto const addr = reinterpret_cast<std::uintptr_t>(p);
    record(TraceEntry::FREE_REQUESTED, device, addr, size, stream, pool, context);
    record(TraceEntry::FREE_COMPLETED, device, addr, size, stream, pool, context);
  }

  void out_of_memory(int device, std::size_t device_free, std::size_t size)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    record(TraceEntry::OOM, device, device_free, size, nullptr, {0, 0}, nullptr);
  }

  // The segment events of emmpool's pool on `device` since the last call, into the trace.
  void take_segment_events(int device)
  {
    if (!on() || device < 0) { return; }
    auto const events = drain<emmpool_segment_event>([device](emmpool_segment_event* out,
                                                              std::size_t n) {
      return api.emmpool_torch_segment_events(device, out, n);
    });
    if (events.empty()) { return; }
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto const& e : events) {
      record(action_of(e), device, e.address, e.size, nullptr, {0, 0}, nullptr);
    }
  }

  // torch.compile's regions (pushCompileContext, per thread) and _set_memory_metadata name the
  // trace entries recorded meanwhile.
  void push_compile_context(std::string const& region) { compile_stack().push_back(region); }
  void pop_compile_context()
  {
    if (!compile_stack().empty()) { compile_stack().pop_back(); }
  }
  void set_user_metadata(std::string const& metadata)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    user_metadata_ = metadata;
  }
  std::string user_metadata() const
  {
    std::lock_guard<std::mutex> lock{mutex_};
    return user_metadata_;
  }

  // The stack that allocated a live block, and the size it asked for (0 if unknown).
  std::pair<context_ptr, std::size_t> block(void* p) const
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = contexts_.find(p);
    if (it == contexts_.end()) { return {nullptr, 0}; }
    return {it->second.context, it->second.requested};
  }

  // The device's trace, oldest first, times in microseconds since the epoch.
  std::vector<TraceEntry> trace(int device)
  {
    std::vector<TraceEntry> out;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto it = traces_.find(device);
      if (it != traces_.end()) { out.assign(it->second.begin(), it->second.end()); }
    }
    auto const to_ns = clock_.makeConverter();
    for (auto& te : out) { te.time_.t_ = to_ns(te.time_.approx_t_) / 1000; }
    return out;
  }

 private:
  struct live_block {
    context_ptr context;
    std::size_t requested;
  };

  void update_on() { on_.store(enabled() || !trackers_.empty(), std::memory_order_release); }

  // The pools record segment events exactly while the history or a tracker listens. Without
  // this file's lock: the core lets go of the GIL meanwhile, which a thread waiting for the
  // lock may hold.
  void watch_segments() { api.emmpool_torch_watch_segments(on() ? 1 : 0); }

  static TraceEntry::Action action_of(emmpool_segment_event const& e)
  {
    switch (e.action) {
      case EMMPOOL_SEGMENT_MADE: return TraceEntry::SEGMENT_ALLOC;
      case EMMPOOL_SEGMENT_RELEASED: return TraceEntry::SEGMENT_FREE;
      case EMMPOOL_SEGMENT_MAPPED: return TraceEntry::SEGMENT_MAP;
      default: return TraceEntry::SEGMENT_UNMAP;
    }
  }

  static std::vector<std::string>& compile_stack()
  {
    static thread_local std::vector<std::string> stack;
    return stack;
  }

  // mutex_ held.
  void record(TraceEntry::Action action, int device, std::uintptr_t addr, std::size_t size,
              cudaStream_t stream, MempoolId pool, context_ptr context)
  {
    if (skip_.count(action) != 0) { return; }
    auto const& regions = compile_stack();
    TraceEntry te{action, static_cast<c10::DeviceIndex>(device), addr, size, stream, pool,
                  c10::getApproximateTime(), std::move(context),
                  regions.empty() ? std::string{"N/A"} : regions.back()
#if EMMPOOL_TORCH_AT_LEAST(2, 10)
                  , user_metadata_
#endif
    };
    for (auto const& tracker : trackers_) { tracker(te); }
    if (!enabled()) { return; }
    auto& ring = traces_[device];
    ring.push_back(std::move(te));
    while (ring.size() > max_entries_) { ring.pop_front(); }
  }

  mutable std::mutex mutex_;
  std::atomic<bool> on_{false};
  std::atomic<bool> enabled_{false};
  cca::CreateContextFn recorder_{nullptr};
  RecordContext when_{RecordContext::NEVER};
  std::size_t max_entries_{1};
  std::unordered_set<int> skip_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::unordered_map<int, std::deque<TraceEntry>> traces_;
  std::unordered_map<void*, live_block> contexts_;
  std::string user_metadata_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

}  // namespace
