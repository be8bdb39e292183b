// emmpool's allocator for PyTorch: a c10::cuda::CUDACachingAllocator::CUDAAllocator over
// emmpool's C entry points (emmpool/torch_api.h), translating PyTorch's interface to emmpool's
// and nothing more: pools, private pools, statistics and segment events are the core's.
//
// Compiled on the user's machine by emmpool._torch (torch.utils.cpp_extension.load), against
// the PyTorch that is installed, and installed with changeCurrentAllocator before PyTorch's
// allocator is first used. Why not CUDAPluggableAllocator alone (what emmpool falls back to when
// this cannot be compiled): its malloc and free take a mutex and keep a map entry per
// allocation, and it answers "does not yet support" to statistics, IPC, private pools, memory
// history and snapshots, which breaks cuDNN's benchmark mode, torch.cuda.memory_stats(),
// torch.multiprocessing, CUDA graphs that share a pool, torch.compile(mode="reduce-overhead"),
// torch.cuda.MemPool and memory_viz. It is subclassed here all the same, so that the other
// methods of the interface (which change from one PyTorch release to the next) keep its
// behaviour, and only those below are emmpool's.
//
// The allocation path: the C entry point, with no lock or map of our own. A block's device rides
// in the low bits of the DataPtr's context (blocks are 256-byte aligned), so the deleter needs
// no lookup either. Beside it, each in its own file: the C entry points (entry_points.hpp),
// private pools (pool_routes.hpp), the memory history (history.hpp), snapshots
// (snapshot.hpp) and tensors across processes (ipc.hpp). One translation unit: the build cache
// is keyed by these sources and the headers shipped beside them (emmpool._torch).
//
// emmpool's _core is never linked: its entry points are looked up with dlsym in the library
// whose path install() is given.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "entry_points.hpp"
#include "history.hpp"
#include "ipc.hpp"
#include "pool_routes.hpp"
#include "snapshot.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace {

// While a private pool is being allocated to, a capture may be under way on this thread: the
// calls into emmpool (whose growth calls cuMemAlloc) run in relaxed capture mode, as PyTorch's
// allocator runs cudaMalloc. Outside, nothing (one atomic load).
class relaxed_while {
 public:
  explicit relaxed_while(bool active)
  {
    if (active) { guard_.emplace(cudaStreamCaptureModeRelaxed); }
  }

 private:
  std::optional<c10::cuda::CUDAStreamCaptureModeGuard> guard_;
};

class emmpool_allocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  emmpool_allocator()
    : CUDAPluggableAllocator(
        [](std::size_t size, int device, cudaStream_t stream) {
          check_size(size);
          return allocate_or_throw(size, device, stream);
        },
        [](void* ptr, std::size_t size, int device, cudaStream_t stream) {
          api.emmpool_torch_free(ptr, size, device, stream);
        })
  {
  }

  c10::DataPtr allocate(std::size_t size) override
  {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    c10::Device const where{c10::DeviceType::CUDA, device};
    if (size == 0) { return {nullptr, nullptr, &delete_block, where}; }
    cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (C10_UNLIKELY(routes_.active() || history_.on() || c10::memoryProfilingEnabled())) {
      bool is_private = false;
      void* p = allocate_slow(size, device, stream, &is_private);
      return {p, context_of(p, device, is_private), &delete_block, where};
    }
    bool is_private = false;
    void* p = allocate_or_oom_pool(size, device, stream, &is_private);
    return {p, context_of(p, device, is_private), &delete_block, where};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  // raw_alloc/raw_delete (Thrust, some libraries' workspaces, cudagraph trees) have no
  // context: a private block is known by its address, the device of another is asked of the
  // pointer.
  void* raw_alloc(std::size_t size) override
  {
    if (size == 0) { return nullptr; }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    bool is_private = false;
    cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(device).stream();
    return allocate_slow(size, device, stream, &is_private);
  }

  void* raw_alloc_with_stream(std::size_t size, cudaStream_t stream) override
  {
    if (size == 0) { return nullptr; }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    bool is_private = false;
    return allocate_slow(size, device, stream, &is_private);
  }

  void raw_delete(void* ptr) override
  {
    if (ptr == nullptr) { return; }
    if (int const device = routes_.device_of(ptr); C10_UNLIKELY(device >= 0)) {
      free_block(context_of(ptr, device, true));
      return;
    }
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    free_block(context_of(ptr, attributes.device, false));
  }

  void free_block(void* ctx)
  {
    void* p          = pointer_of(ctx);
    int const device = device_of(ctx);
    // The profiler is told of every free while it listens, as PyTorch's allocator tells it, with
    // the size the pool gave the block (asked before the block goes).
    std::size_t const profiled =
      C10_UNLIKELY(c10::memoryProfilingEnabled()) ? api.emmpool_torch_block_size(p, device) : 0;
    if (C10_UNLIKELY(history_.on())) {
      auto const context = history_.gather(RecordContext::ALL);
      history_.freed(device, p, nullptr, {0, 0}, context);
    }
    if (is_private(ctx)) {
      routes_.free(p);
    } else {
      relaxed_while relaxed{routes_.active()};
      // PyTorch passes the allocation's stream; emmpool remembers it (c_api.cpp)
      api.emmpool_torch_free(p, 0, device, nullptr);
    }
    if (C10_UNLIKELY(history_.on())) { history_.take_segment_events(device); }
    if (C10_UNLIKELY(profiled != 0)) {
      report_to_profiler(p, -static_cast<std::int64_t>(profiled), device);
    }
  }

  // ---- the cache, statistics, the cap

  // torch.cuda.empty_cache(): every pool returns its wholly free segments ({0, 0}); a
  // MemPool's id: that pool's free blocks, once nobody uses it.
  void emptyCache(MempoolId mempool_id) override
  {
    routes_.empty_cache(mempool_id);
    if (mempool_id != MempoolId{0, 0}) { return; }
    int const n = device_count();
    for (int d = 0; d < n; ++d) {
      (void)api.emmpool_torch_trim(d);
      history_.take_segment_events(d);
    }
  }

  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override
  {
    *largest_block = api.emmpool_torch_largest_block(device);
  }

  // The pool's statistics as PyTorch reports its own (emmpool/torch_api.h says what each
  // counts), field for field.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override
  {
    c10::CachingDeviceAllocator::DeviceStats s;
    emmpool_torch_stats now{};
    emmpool_torch_accumulated total{};
    if (api.emmpool_torch_stats_of(device, &now) != 0 ||
        api.emmpool_torch_accumulated_of(device, &total) != 0) {
      return s;
    }
    auto i64 = [](std::uint64_t x) { return static_cast<std::int64_t>(x); };
    // [0]: all pools (PyTorch keeps a small and a large pool; emmpool has one)
    auto& allocated     = s.allocated_bytes[0];
    allocated.current   = i64(now.allocated_bytes);
    allocated.peak      = i64(now.peak_allocated_bytes);
    allocated.allocated = i64(total.allocated_bytes);
    allocated.freed     = i64(total.freed_bytes);
    s.active_bytes[0]    = allocated;
    s.requested_bytes[0] = allocated;
    s.requested_bytes[0].allocated = i64(total.requested_bytes);
    s.requested_bytes[0].freed     = i64(total.requested_freed_bytes);
    s.reserved_bytes[0].current = i64(now.reserved_bytes);
    s.reserved_bytes[0].peak    = i64(now.peak_reserved_bytes);
    // reserved_bytes.allocated/freed (bytes ever reserved, released) are not counted: left 0
    s.inactive_split_bytes[0].current = i64(now.inactive_bytes);
    s.allocation[0].current   = i64(now.blocks_in_use);
    s.allocation[0].allocated = i64(total.allocations);
    s.allocation[0].freed     = i64(total.frees);
    s.active[0]               = s.allocation[0];
    s.segment[0].current      = i64(now.segments);
    s.segment[0].allocated    = i64(total.segment_allocations);
    s.segment[0].freed        = i64(total.segment_releases);
    s.num_ooms                = i64(total.out_of_memory);
    s.num_sync_all_streams    = i64(total.dormant_fences);
    s.num_device_alloc        = i64(total.segment_allocations);
    s.num_device_free         = i64(total.segment_releases);
    return s;
  }

  void resetPeakStats(c10::DeviceIndex device) override { api.emmpool_torch_reset_peaks(device); }
  void resetAccumulatedStats(c10::DeviceIndex device) override
  {
    api.emmpool_torch_reset_accumulated(device);
  }

  // torch.cuda.set_per_process_memory_fraction(): the cap of emmpool's pool on that device,
  // which every library shares. Refused (saying why) only if more than that is in use.
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override
  {
    if (!(fraction >= 0.0 && fraction <= 1.0)) {
      raise("emmpool: set_per_process_memory_fraction: the fraction must be within [0, 1], not " +
            std::to_string(fraction));
    }
    c10::cuda::CUDAGuard guard{device};
    std::size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    auto const bytes = static_cast<std::size_t>(fraction * static_cast<double>(total));
    emmpool_error error{};
    if (api.emmpool_torch_set_maximum(device, bytes == 0 ? 1 : bytes, &error) != 0) {
      raise("emmpool: set_per_process_memory_fraction(" + std::to_string(fraction) + ", " +
            std::to_string(device) + "): " + error.message);
    }
  }

  double getMemoryFraction(c10::DeviceIndex device) override
  {
    std::size_t const cap = api.emmpool_torch_maximum(device);
    if (cap == std::numeric_limits<std::size_t>::max()) { return 1.0; }
    c10::cuda::CUDAGuard guard{device};
    std::size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return total == 0 ? 1.0 : std::min(1.0, static_cast<double>(cap) / static_cast<double>(total));
  }

  // ---- streams, IPC

  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override
  {
    // Memory that is not emmpool's (received over IPC, from_blob) is not ours to fence, as in
    // PyTorch's own allocator; a private (graph) block keeps its memory until its pool goes.
    if (data.get_deleter() != &delete_block || data.get_context() == nullptr) { return; }
    if (is_private(data.get_context())) {
      routes_.record_stream(pointer_of(data.get_context()));
      return;
    }
    emmpool_error error{};
    if (api.emmpool_torch_record_stream(pointer_of(data.get_context()),
                                        device_of(data.get_context()), stream.stream(),
                                        &error) != 0) {
      raise(std::string{"emmpool: record_stream failed: "} + error.message);
    }
  }

  cca::ShareableHandle shareIpcHandle(void* ptr) override { return share_block(ptr); }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return opened_.open(handle); }

  // ---- private pools (pool_routes.hpp)

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id,
                           std::function<bool(cudaStream_t)> filter) override
  {
    routes_.begin(device, mempool_id, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id) override
  {
    routes_.end(device, mempool_id);
  }
  void releasePool(c10::DeviceIndex, MempoolId mempool_id) override { routes_.release(mempool_id); }
#if EMMPOOL_TORCH_AT_LEAST(2, 11)
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override
  {
    // MemPool() passes the current allocator (this one): its blocks are emmpool's as any.
    if (allocator.get() == this) { allocator = nullptr; }
    routes_.create_or_incref(device, mempool_id, std::move(allocator));
  }
#else
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId mempool_id,
                          cca::CUDAAllocator* allocator) override
  {
    // Not owned: the MemPool that passes it keeps it alive for as long as the pool.
    std::shared_ptr<cca::CUDAAllocator> other;
    if (allocator != nullptr && allocator != this) {
      other.reset(allocator, [](cca::CUDAAllocator*) {});
    }
    routes_.create_or_incref(device, mempool_id, std::move(other));
  }
#endif
  int getPoolUseCount(c10::DeviceIndex, MempoolId mempool_id) override
  {
    return routes_.use_count(mempool_id);
  }
#if EMMPOOL_TORCH_AT_LEAST(2, 11)
  void setUseOnOOM(c10::DeviceIndex, MempoolId mempool_id, bool use_on_oom) override
  {
    routes_.set_use_on_oom(mempool_id, use_on_oom);
  }
#else
  void setUseOnOOM(c10::DeviceIndex, MempoolId mempool_id) override
  {
    routes_.set_use_on_oom(mempool_id, true);
  }
#endif
#if EMMPOOL_TORCH_AT_LEAST(2, 10)
  void setNoSplit(c10::DeviceIndex, MempoolId mempool_id) override
  {
    routes_.set_no_split(mempool_id);
  }
#endif
  bool checkPoolLiveAllocations(c10::DeviceIndex, MempoolId mempool_id,
                                const std::unordered_set<void*>& expected) override
  {
    return routes_.live_blocks_are(mempool_id, expected);
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId id) override
  {
    return routes_.checkpoint(device, id);
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex,
                                              std::shared_ptr<cca::AllocatorState> state) override
  {
    auto const* pps = dynamic_cast<pool_checkpoint const*>(state.get());
    if (pps == nullptr) { raise("emmpool: setCheckpointPoolState: not a checkpoint of emmpool's"); }
    return routes_.restore(*pps);
  }

  // ---- history and snapshots (history.hpp, snapshot.hpp)

  bool isHistoryEnabled() override { return history_.enabled(); }

#if EMMPOOL_TORCH_AT_LEAST(2, 11)
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override
#else
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, RecordContext when,
                     bool clear_history) override
#endif
  {
#if !EMMPOOL_TORCH_AT_LEAST(2, 11)
    std::vector<std::string> const skip_actions;
#endif
    history_.configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history,
                       skip_actions);
  }

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override
  {
    history_.add_tracker(std::move(tracker));
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override
  {
    std::lock_guard<std::mutex> lock{observers_mutex_};
    observers_.push_back(std::move(observer));
  }

#if EMMPOOL_TORCH_AT_LEAST(2, 11)
  cca::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) override
  {
    return build_snapshot(history_, mempool_id, include_traces);
  }
#else
  cca::SnapshotInfo snapshot(MempoolId mempool_id) override
  {
    return build_snapshot(history_, mempool_id, true);
  }
#endif

  void pushCompileContext(std::string& md) override { history_.push_compile_context(md); }
  void popCompileContext() override { history_.pop_compile_context(); }
#if EMMPOOL_TORCH_AT_LEAST(2, 10)
  void setUserMetadata(const std::string& metadata) override
  {
    history_.set_user_metadata(metadata);
  }
  std::string getUserMetadata() override { return history_.user_metadata(); }
#endif

  std::string name() override { return "emmpool"; }

  // Ready once installed, whether PyTorch's lazy CUDA init (which calls init()) ran before the
  // swap or runs after it.
  bool initialized() override { return true; }

  // An allocation is about to raise OutOfMemoryError (entry_points.hpp: fail()).
  void out_of_memory(int device, std::size_t size)
  {
    std::size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) { (void)cudaGetLastError(); }
    if (history_.on()) { history_.out_of_memory(device, free, size); }
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock{observers_mutex_};
      observers = observers_;
    }
    emmpool_torch_stats now{};
    (void)api.emmpool_torch_stats_of(device, &now);
    for (auto const& observer : observers) { observer(device, now.allocated_bytes, total, free); }
  }

 private:
  // From emmpool, or, if that is out of memory, from a MemPool made with use_on_oom; the
  // history and the OOM observers hear of the error only if that fails too, as in PyTorch.
  void* allocate_or_oom_pool(std::size_t size, int device, cudaStream_t stream, bool* is_private)
  {
    check_size(size);  // a size no device holds: raised at once, no pool tried, none told
    relaxed_while relaxed{routes_.active()};
    try {
      return allocate_or_throw(size, device, stream, oom_report::by_caller);
    } catch (c10::OutOfMemoryError const&) {
      void* p = routes_.allocate_on_oom(size, device, stream);
      if (p == nullptr) {
        out_of_memory(device, size);
        throw;
      }
      if (is_private != nullptr) { *is_private = true; }
      return p;
    }
  }

  // Private pools and the history: off the fast path.
  void* allocate_slow(std::size_t size, int device, cudaStream_t stream, bool* is_private)
  {
    auto const context = history_.on() ? history_.gather(RecordContext::STATE) : nullptr;
    MempoolId id{0, 0};
    void* p = nullptr;
    if (routes_.active() && routes_.pool_for(device, stream, &id)) {
      p           = routes_.allocate(size, device, id, stream);
      *is_private = true;
    } else {
      p = allocate_or_oom_pool(size, device, stream, is_private);
    }
    if (C10_UNLIKELY(history_.on())) {
      history_.take_segment_events(device);  // before the block: its segment came first
      history_.allocated(device, p, size, stream, id, context);
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      // the size the pool gave the block, which its free reports too
      auto const block = api.emmpool_torch_block_size(p, device);
      if (block != 0) { report_to_profiler(p, static_cast<std::int64_t>(block), device); }
    }
    return p;
  }

  // torch.profiler's memory timeline (profile_memory=True): an allocation (size > 0) or a free
  // (size < 0) with PyTorch's bytes in use and reserved after it, as PyTorch's allocator
  // reports them.
  void report_to_profiler(void* p, std::int64_t size, int device)
  {
    emmpool_torch_stats now{};
    (void)api.emmpool_torch_stats_of(device, &now);
    c10::reportMemoryUsageToProfiler(
      p, size, static_cast<std::int64_t>(now.allocated_bytes),
      static_cast<std::int64_t>(now.reserved_bytes),
      c10::Device{c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)});
  }

  pool_routes routes_;
  memory_history history_;
  opened_handles opened_;
  std::mutex observers_mutex_;
  std::vector<cca::OutOfMemoryObserver> observers_;
};

// Never destroyed (a leaked shared_ptr holds it): tensors may be freed during interpreter exit.
emmpool_allocator* the_allocator = nullptr;

void delete_block(void* ctx)
{
  if (ctx == nullptr) { return; }
  the_allocator->free_block(ctx);
}

void report_out_of_memory(int device, std::size_t size)
{
  if (the_allocator != nullptr) { the_allocator->out_of_memory(device, size); }
}

// Install emmpool as PyTorch's CUDA allocator. PyTorch refuses (RuntimeError) once its own
// allocator has been used.
void install(std::string const& core_path)
{
  if (the_allocator) { return; }
  load_entry_points(core_path);
  auto allocator = std::make_shared<emmpool_allocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  // changeCurrentAllocator swaps what c10::cuda::CUDACachingAllocator::get() answers, which
  // tensors allocate through; the allocator registered for the CUDA device type
  // (c10::GetAllocator: torch.accelerator's statistics and empty_cache, storages made without a
  // tensor) would stay PyTorch's own, beside emmpool's pool. It points here too.
  c10::SetAllocator(c10::DeviceType::CUDA, allocator.get());
  new std::shared_ptr<emmpool_allocator>(allocator);
  the_allocator     = allocator.get();
  on_out_of_memory = &report_out_of_memory;
}

bool installed()
{
  return the_allocator != nullptr && cca::get() == the_allocator &&
         c10::GetAllocator(c10::DeviceType::CUDA) == the_allocator;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  m.doc() = "emmpool's CUDAAllocator for PyTorch (built by emmpool._torch)";
  m.def("install", &install, "Install emmpool as PyTorch's CUDA allocator");
  m.def("installed", &installed, "Whether PyTorch's current CUDA allocator is this one");
  m.def("block_libraries", &block_libraries,
        "(address, library) of every block of emmpool's pool on a device that another library "
        "than PyTorch holds");
  m.attr("abi") = EMMPOOL_TORCH_ABI_VERSION;
}
