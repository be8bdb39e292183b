// emmpool's allocator for PyTorch: a c10::cuda::CUDACachingAllocator::CUDAAllocator over
// emmpool's C entry points (cpp/edges/c_api.cpp, cpp/edges/c_api_torch.cpp).
//
// Compiled on the user's machine by emmpool._torch (torch.utils.cpp_extension.load), against
// the PyTorch that is installed, and installed with changeCurrentAllocator before PyTorch's
// allocator is first used. Why not CUDAPluggableAllocator alone (what emmpool falls back to when
// this cannot be compiled): its malloc and free take a mutex and keep a map entry per
// allocation, and its cacheInfo, getDeviceStats, resetPeakStats, shareIpcHandle and
// getIpcDevPtr throw "does not yet support", which breaks cuDNN's benchmark mode,
// torch.cuda.memory_stats() and torch.multiprocessing. It is subclassed here all the same, so
// that the many other methods of the interface (which change from one PyTorch release to the
// next) keep its behaviour, and only those below are emmpool's.
//
// The allocation path: the C entry point, with no lock or map of our own. A block's device rides
// in the low bits of the DataPtr's context (blocks are 256-byte aligned), so the deleter needs
// no lookup either.
//
// emmpool's _core is never linked: its entry points are looked up with dlsym in the library
// whose path install() is given.

#include <pybind11/pybind11.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::cuda::MempoolId_t;

constexpr int expected_abi = 1;
constexpr std::uintptr_t device_bits  = 0x3f;  // device index, < 64 (emmpool's registry)
constexpr std::uintptr_t private_bit  = 0x80;  // a block of a graph / MemPool private pool
constexpr std::uintptr_t context_bits = 0xff;
constexpr std::size_t error_length    = 512;
void* const no_stream = reinterpret_cast<void*>(std::uintptr_t{1});  // emmpool's legacy_stream

// emmpool's C entry points, found in _core's shared library.
struct entry_points {
  void* (*allocate)(std::size_t, int, void*, int*, char*, std::size_t){};
  void (*free)(void*, std::size_t, int, void*){};
  int (*record_stream)(void*, int, void*, char*, std::size_t){};
  int (*stats)(int, std::uint64_t*, int){};
  void (*reset_peaks)(int){};
  std::size_t (*trim)(int){};
  std::size_t (*largest_block)(int){};
  int (*ipc_handle)(void*, int, unsigned char*, std::size_t*, char*, std::size_t){};
};
entry_points api;

// Messages are made with std::string and std::to_string, never with TORCH_CHECK's several
// arguments: those go through an ostringstream, and with a PyTorch whose extensions link
// libstdc++ statically, formatting a number there crashed (seen with torch 2.11 on the GPU host:
// SIGSEGV in codecvt under ostream::_M_insert<double>).
[[noreturn]] void raise(std::string const& message) { TORCH_CHECK(false, message); }

template <typename F>
void find(void* lib, char const* name, F& f)
{
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    raise(std::string{"emmpool: "} + name + " is missing from emmpool's _core (" + dlerror() +
          "): the PyTorch extension and emmpool come from different versions; reinstall emmpool");
  }
  f = reinterpret_cast<F>(sym);
}

void load_entry_points(std::string const& core_path)
{
  void* lib = dlopen(core_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) { raise("emmpool: cannot open " + core_path + ": " + dlerror()); }
  int (*abi)(){};
  find(lib, "emmpool_torch_abi_version", abi);
  if (abi() != expected_abi) {
    raise("emmpool: _core speaks torch ABI " + std::to_string(abi()) + ", the extension " +
          std::to_string(expected_abi) + ": reinstall emmpool (the extension cache is keyed by its source)");
  }
  find(lib, "emmpool_torch_allocate", api.allocate);
  find(lib, "emmpool_torch_free", api.free);
  find(lib, "emmpool_torch_record_stream", api.record_stream);
  find(lib, "emmpool_torch_stats", api.stats);
  find(lib, "emmpool_torch_reset_peaks", api.reset_peaks);
  find(lib, "emmpool_torch_trim", api.trim);
  find(lib, "emmpool_torch_largest_block", api.largest_block);
  find(lib, "emmpool_torch_ipc_handle", api.ipc_handle);
}

void* pointer_of(void* ctx) { return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ctx) & ~context_bits); }
int device_of(void* ctx) { return static_cast<int>(reinterpret_cast<std::uintptr_t>(ctx) & device_bits); }
bool is_private(void* ctx) { return (reinterpret_cast<std::uintptr_t>(ctx) & private_bit) != 0; }

void* context_of(void* ptr, int device, bool private_block)
{
  return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ptr) |
                                 static_cast<std::uintptr_t>(device) |
                                 (private_block ? private_bit : 0));
}

[[noreturn]] void fail(int kind, std::size_t size, int device, char const* why)
{
  if (kind == 0) {
    std::string const msg = "emmpool: CUDA out of memory. Tried to allocate " +
                            std::to_string(size) + " bytes on device " + std::to_string(device) +
                            ": " + why +
                            " (EMMPOOL_MAXIMUM_POOL_SIZE caps the pool; emmpool.stats() shows what it holds)";
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  raise("emmpool: allocation of " + std::to_string(size) + " bytes on device " +
        std::to_string(device) + " failed: " + why);
}

void* allocate_or_throw(std::size_t size, int device, void* stream)
{
  int kind = 2;
  char why[error_length] = "";
  void* p = api.allocate(size, device, stream, &kind, why, sizeof why);
  if (p == nullptr) { fail(kind, size, device, why); }
  return p;
}

void delete_block(void* ctx);

// Blocks allocated while PyTorch allocates to a private pool (CUDA graph capture, MemPool):
// they must keep their addresses for the graph's replays, so their memory returns to emmpool
// only when PyTorch releases the pool (graph destroyed); until then a freed one may serve a
// later allocation to the same pool, as in PyTorch's own private pools (replays follow the
// capture's order).
class private_pools {
 public:
  struct allocating {
    int device;
    MempoolId id;
    std::function<bool(cudaStream_t)> filter;
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
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto& pool = pools_[id];
      // A free block of this pool freed on the same stream (stream order, as PyTorch's own
      // pools: a block is never reused by another stream, whose captured work is not ordered
      // after the old owner's), if not more than twice the size (a best fit that wastes little;
      // PyTorch's own pools split blocks, emmpool's private blocks are not split).
      for (auto it = pool.free_blocks.lower_bound(rounded);
           it != pool.free_blocks.end() && it->first <= 2 * rounded; ++it) {
        auto& b = blocks_.at(it->second);
        if (b.stream != stream) { continue; }
        void* p = it->second;
        pool.free_blocks.erase(it);
        b.free = false;
        return p;
      }
    }
    // Allocation during capture: emmpool's own CUDA calls (event queries, growth) must not be
    // refused by the capture's strictness, as PyTorch's allocator relaxes it around cudaMalloc.
    // No stream is named, so nothing is recorded on the capturing stream.
    c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
    void* p = allocate_or_throw(rounded, device, no_stream);
    std::lock_guard<std::mutex> lock{mutex_};
    blocks_[p] = block{id, rounded, device, stream, false, false};
    held_.fetch_add(1, std::memory_order_release);
    return p;
  }

  // tensor.record_stream() on a private block: used on another stream, it must not serve a
  // later allocation of its pool (PyTorch defers such blocks until the capture ends); it is
  // held until the pool is released.
  void record_stream(void* p)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = blocks_.find(p);
    if (it != blocks_.end()) { it->second.shared = true; }
  }

  void begin(int device, MempoolId id, std::function<bool(cudaStream_t)> filter)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto& pool = pools_[id];
    pool.use_count += 1;
    allocating_.push_back(allocating{device, id, std::move(filter)});
    active_.store(static_cast<int>(allocating_.size()), std::memory_order_release);
  }

  void end(int device, MempoolId id)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    for (auto it = allocating_.begin(); it != allocating_.end(); ++it) {
      if (it->device == device && it->id == id) {
        allocating_.erase(it);
        break;
      }
    }
    active_.store(static_cast<int>(allocating_.size()), std::memory_order_release);
  }

  // PyTorch no longer needs the pool's addresses (its graphs are destroyed): free blocks go
  // back to emmpool now, live ones when they are freed.
  void release(int /*device*/, MempoolId id)
  {
    std::vector<std::pair<void*, int>> give_back;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto it = pools_.find(id);
      if (it == pools_.end()) { return; }
      if (--it->second.use_count > 0) { return; }
      it->second.free_blocks.clear();
      it->second.released = true;
      bool any_live = false;
      for (auto b = blocks_.begin(); b != blocks_.end();) {
        if (b->second.pool == id && b->second.free) {
          give_back.emplace_back(b->first, b->second.device);
          b = blocks_.erase(b);
        } else {
          any_live = any_live || b->second.pool == id;
          ++b;
        }
      }
      if (!any_live) { pools_.erase(it); }
    }
    return_to_emmpool(std::move(give_back));
  }

  void free(void* p)
  {
    std::vector<std::pair<void*, int>> give_back;
    {
      std::lock_guard<std::mutex> lock{mutex_};
      auto it = blocks_.find(p);
      if (it == blocks_.end()) { return; }
      auto pool = pools_.find(it->second.pool);
      if (pool != pools_.end() && !pool->second.released) {
        it->second.free = true;
        if (!it->second.shared) { pool->second.free_blocks.emplace(it->second.size, p); }
        return;
      }
      give_back.emplace_back(p, it->second.device);
      MempoolId const id = it->second.pool;
      blocks_.erase(it);
      if (pool != pools_.end()) {
        bool any_live = false;
        for (auto const& [q, b] : blocks_) { any_live = any_live || b.pool == id; }
        if (!any_live) { pools_.erase(pool); }
      }
    }
    // A live block of a released pool: its last users may be a replay of the destroyed graph
    // or work on any stream (emmpool fences it on the legacy stream only): same path.
    return_to_emmpool(std::move(give_back));
  }

  // torch.cuda.empty_cache(): blocks whose return had to wait for the end of a capture.
  void flush() { return_to_emmpool({}); }

  bool owns(void* p)
  {
    if (!holds_any()) { return false; }
    std::lock_guard<std::mutex> lock{mutex_};
    return blocks_.count(p) != 0;
  }

 private:
  // Private blocks go back to emmpool only after a device synchronization: a replay of a
  // destroyed graph may still run (cudaGraphExecDestroy does not wait), on a stream emmpool was
  // never told of. No synchronization is possible while a capture is under way (it would
  // invalidate it): the blocks wait for a later release, free or empty_cache.
  void return_to_emmpool(std::vector<std::pair<void*, int>> blocks)
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
    for (auto [p, d] : blocks) {
      if (std::find(synced.begin(), synced.end(), d) == synced.end()) {
        synced.push_back(d);
        try {
          c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(d)};
          C10_CUDA_CHECK_WARN(cudaDeviceSynchronize());
        } catch (...) {
          // called from destructors (CUDAGraph::reset, a tensor's deleter): never throw
        }
      }
      api.free(p, 0, d, nullptr);
    }
  }

  struct block {
    MempoolId pool;
    std::size_t size;
    int device;
    cudaStream_t stream;  // the allocation's: a freed block serves this stream only
    bool free;
    bool shared;          // record_stream'd: never reused within its pool
  };
  struct pool {
    int use_count{0};
    bool released{false};
    std::multimap<std::size_t, void*> free_blocks;
  };
  std::mutex mutex_;
  std::atomic<int> active_{0};
  std::atomic<int> held_{0};  // blocks_ entries (counted with those awaiting return)
  std::vector<allocating> allocating_;
  std::map<MempoolId, pool> pools_;
  std::unordered_map<void*, block> blocks_;
  std::vector<std::pair<void*, int>> deferred_;
};

// Handles opened from other processes (torch.multiprocessing), each opened once per process as
// CUDA requires, and closed when the last tensor over it dies.
class ipc_opened {
 public:
  std::shared_ptr<void> open(std::string const& handle)
  {
    cudaIpcMemHandle_t h{};
    char const* bytes = handle.data();
    if (handle.size() == CUDA_IPC_HANDLE_SIZE) {
      // the raw form, which emmpool sends and every PyTorch accepts
    } else {
      // PyTorch's versioned form: [version][type][payload]; 'c' is a cudaMalloc'd block
      TORCH_CHECK(handle.size() >= 2, "emmpool: ill-formed CUDA IPC handle");
      TORCH_CHECK(handle[1] == 'c',
                  "emmpool: this CUDA tensor was shared from an expandable segment (PyTorch's "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the sending process); "
                  "emmpool opens only cudaMalloc-style handles: turn expandable segments off in "
                  "the sender, or leave PyTorch's allocator in this process");
      TORCH_CHECK(handle.size() == 2 + CUDA_IPC_HANDLE_SIZE, "emmpool: ill-formed CUDA IPC handle");
      bytes += 2;
    }
    std::memcpy(&h, bytes, CUDA_IPC_HANDLE_SIZE);
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = opened_.find(handle);
    if (it != opened_.end()) {
      if (auto sp = it->second.lock()) { return sp; }
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* p = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    std::shared_ptr<void> sp(p, [this, handle, device](void* q) {
      {
        std::lock_guard<std::mutex> lock{mutex_};
        auto it = opened_.find(handle);
        if (it != opened_.end() && it->second.expired()) { opened_.erase(it); }
      }
      try {  // a shared_ptr's deleter: never throw (CUDAGuard may, at exit)
        c10::cuda::CUDAGuard guard{device};
        C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(q));
      } catch (...) {
      }
    });
    opened_[handle] = sp;
    return sp;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;
};

class emmpool_allocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  emmpool_allocator()
    : CUDAPluggableAllocator(
        [](std::size_t size, int device, cudaStream_t stream) {
          return allocate_or_throw(size, device, stream);
        },
        [](void* ptr, std::size_t size, int device, cudaStream_t stream) {
          api.free(ptr, size, device, stream);
        })
  {
    // torch.cuda.empty_cache() -> every pool returns its wholly free segments
    set_reset_fn([this] {
      graphs_.flush();
      int n = 0;
      C10_CUDA_CHECK(cudaGetDeviceCount(&n));
      for (int d = 0; d < n && d < 64; ++d) { (void)api.trim(d); }
    });
    // torch.cuda.set_per_process_memory_fraction(): emmpool's cap is fixed when its pool is made
    set_memory_fraction_fn([](double fraction, int device) {
      raise("emmpool: torch.cuda.set_per_process_memory_fraction(" + std::to_string(fraction) +
            ", " + std::to_string(device) +
            ") cannot change emmpool's cap, which is fixed when the pool is made: set "
            "EMMPOOL_MAXIMUM_POOL_SIZE=" + std::to_string(fraction) +
            " (or emmpool.configure(maximum_pool_size=...)) before the first allocation");
    });
  }

  c10::DataPtr allocate(std::size_t size) override
  {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    c10::Device const where{c10::DeviceType::CUDA, device};
    if (size == 0) { return {nullptr, nullptr, &delete_block, where}; }
    cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (C10_UNLIKELY(graphs_.active())) {
      MempoolId id;
      if (graphs_.pool_for(device, stream, &id)) {
        void* p = graphs_.allocate(size, device, id, stream);
        return {p, context_of(p, device, true), &delete_block, where};
      }
    }
    void* p = allocate_or_throw(size, device, stream);
    return {p, context_of(p, device, false), &delete_block, where};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  // raw_alloc/raw_delete (Thrust, some libraries' workspaces) have no context: the device
  // is asked of the pointer.
  void* raw_alloc(std::size_t size) override
  {
    if (size == 0) { return nullptr; }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return raw_allocate(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(std::size_t size, cudaStream_t stream) override
  {
    if (size == 0) { return nullptr; }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return raw_allocate(size, device, stream);
  }

  // raw_alloc during a capture (Thrust's temporaries, ...) goes to the private pool as in
  // PyTorch's own allocator: the graph's replays write to it after raw_delete.
  void* raw_allocate(std::size_t size, int device, cudaStream_t stream)
  {
    if (C10_UNLIKELY(graphs_.active())) {
      MempoolId id;
      if (graphs_.pool_for(device, stream, &id)) { return graphs_.allocate(size, device, id, stream); }
    }
    return allocate_or_throw(size, device, stream);
  }

  void raw_delete(void* ptr) override
  {
    if (ptr == nullptr) { return; }
    if (C10_UNLIKELY(graphs_.owns(ptr))) {
      graphs_.free(ptr);
      return;
    }
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    api.free(ptr, 0, attributes.device, nullptr);
  }

  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override
  {
    *largest_block = api.largest_block(device);
  }

  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override
  {
    // Memory that is not emmpool's (received over IPC, from_blob) is not ours to fence, as in
    // PyTorch's own allocator; a private (graph) block keeps its memory until its pool goes.
    if (data.get_deleter() != &delete_block || data.get_context() == nullptr) { return; }
    if (is_private(data.get_context())) {
      graphs_.record_stream(pointer_of(data.get_context()));
      return;
    }
    char why[error_length] = "";
    if (api.record_stream(pointer_of(data.get_context()), device_of(data.get_context()),
                          stream.stream(), why, sizeof why) != 0) {
      raise(std::string{"emmpool: record_stream failed: "} + why);
    }
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override
  {
    std::uint64_t v[16] = {};
    c10::CachingDeviceAllocator::DeviceStats s;
    if (api.stats(device, v, 16) < 16) { return s; }
    auto i64 = [](std::uint64_t x) { return static_cast<std::int64_t>(x); };
    // [0]: all pools (PyTorch keeps a small and a large pool; emmpool has one)
    auto& allocated     = s.allocated_bytes[0];
    allocated.current   = i64(v[0]);           // PyTorch's blocks
    allocated.peak      = std::max(i64(v[2]), allocated.current);  // the pool's peak: every library
    s.active_bytes[0]    = allocated;
    s.requested_bytes[0] = allocated;
    s.reserved_bytes[0].current = i64(v[3]);
    s.reserved_bytes[0].peak    = i64(v[4]);
    // reserved_bytes.allocated/freed (bytes ever reserved, released) are not counted: left 0
    s.inactive_split_bytes[0].current = i64(v[3] > v[1] ? v[3] - v[1] : 0);
    s.allocation[0].current   = i64(v[7]);
    s.allocation[0].allocated = i64(v[5]);
    s.allocation[0].freed     = i64(v[6]);
    s.active[0]               = s.allocation[0];
    s.segment[0].current      = i64(v[8]);
    s.segment[0].allocated    = i64(v[9]);
    s.segment[0].freed        = i64(v[10]);
    s.num_ooms                = i64(v[11]);
    s.num_sync_all_streams    = i64(v[15]);
    s.num_device_alloc        = i64(v[9]);
    s.num_device_free         = i64(v[10]);
    return s;
  }

  void resetPeakStats(c10::DeviceIndex device) override { api.reset_peaks(device); }
  void resetAccumulatedStats(c10::DeviceIndex) override {}

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id,
                           std::function<bool(cudaStream_t)> filter) override
  {
    graphs_.begin(device, mempool_id, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id) override
  {
    graphs_.end(device, mempool_id);
  }
  void releasePool(c10::DeviceIndex device, MempoolId mempool_id) override
  {
    graphs_.release(device, mempool_id);
  }

  cca::ShareableHandle shareIpcHandle(void* ptr) override
  {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    unsigned char handle[CUDA_IPC_HANDLE_SIZE];
    std::size_t offset = 0;
    char why[error_length] = "";
    if (api.ipc_handle(ptr, device, handle, &offset, why, sizeof why) != 0) {
      raise(std::string{"emmpool: cannot share this CUDA tensor: "} + why);
    }
    return {static_cast<std::ptrdiff_t>(offset),
            std::string(reinterpret_cast<char const*>(handle), CUDA_IPC_HANDLE_SIZE)};
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return ipc_.open(handle); }

  std::string name() override { return "emmpool"; }

  void free_block(void* ctx)
  {
    if (is_private(ctx)) {
      graphs_.free(pointer_of(ctx));
    } else {
      // PyTorch passes the allocation's stream; emmpool remembers it (c_api.cpp)
      api.free(pointer_of(ctx), 0, device_of(ctx), nullptr);
    }
  }

 private:
  private_pools graphs_;
  ipc_opened ipc_;
};

// Never destroyed (a leaked shared_ptr holds it): tensors may be freed during interpreter exit.
emmpool_allocator* the_allocator = nullptr;

void delete_block(void* ctx)
{
  if (ctx == nullptr) { return; }
  the_allocator->free_block(ctx);
}

// Install emmpool as PyTorch's CUDA allocator. PyTorch refuses (RuntimeError) once its own
// allocator has been used.
void install(std::string const& core_path)
{
  if (the_allocator) { return; }
  load_entry_points(core_path);
  auto allocator = std::make_shared<emmpool_allocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  new std::shared_ptr<emmpool_allocator>(allocator);
  the_allocator = allocator.get();
}

bool installed() { return the_allocator != nullptr && cca::get() == the_allocator; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  m.doc() = "emmpool's CUDAAllocator for PyTorch (built by emmpool._torch)";
  m.def("install", &install, "Install emmpool as PyTorch's CUDA allocator");
  m.def("installed", &installed, "Whether PyTorch's current CUDA allocator is this one");
  m.attr("abi") = expected_abi;
}
