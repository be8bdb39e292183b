// The CUDA implementation of the driver seam: the only file that calls the CUDA driver API.
//
// libcuda.so.1 is opened with dlopen at the first call, never at import or link time, so that
// emmpool imports on machines without a GPU and says what is missing when CUDA is needed.
// Symbols are looked up by the versioned names cuda.h maps each API to (cuMemAlloc ->
// cuMemAlloc_v2, ...), so the ABI matches the header we compiled against.
#include <emmpool/driver.hpp>
#include <emmpool/error.hpp>

#include <cuda.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <map>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace emmpool {

namespace {

std::atomic<bool> exiting{false};

struct api {
#define EMMPOOL_API(fn) decltype(&::fn) fn = nullptr;
#include "cuda_driver_api.inc"
#undef EMMPOOL_API
};

class cuda_driver_impl final : public driver {
 public:
  [[nodiscard]] std::string name() const override { return "cuda"; }

  [[nodiscard]] int device_count() override
  {
    auto& a = load();
    int n   = 0;
    check(a.cuDeviceGetCount(&n), "cuDeviceGetCount", EMMPOOL_WHERE);
    return n;
  }

  [[nodiscard]] int current_device() override
  {
    auto& a = load();
    CUcontext ctx{};
    if (a.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr) { return -1; }
    CUdevice dev{};
    if (a.cuCtxGetDevice(&dev) != CUDA_SUCCESS) { return -1; }
    return static_cast<int>(dev);
  }

  [[nodiscard]] device_ptr allocate(int device, std::size_t bytes) override
  {
    scoped_context ctx{*this, device};
    relaxed_capture relaxed{api_};
    CUdeviceptr p{};
    auto const r = api_.cuMemAlloc(&p, bytes);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw out_of_memory{"cuMemAlloc of " + std::to_string(bytes) + " bytes: out of memory"};
    }
    check(r, "cuMemAlloc", EMMPOOL_WHERE);
    return static_cast<device_ptr>(p);
  }

  void deallocate(int device, device_ptr ptr) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuMemFree(static_cast<CUdeviceptr>(ptr)), "cuMemFree", EMMPOOL_WHERE);
  }

  [[nodiscard]] std::uint64_t buffer_id(int device, device_ptr ptr) override
  {
    scoped_context ctx{*this, device};
    unsigned long long id = 0;
    auto const r = api_.cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                              static_cast<CUdeviceptr>(ptr));
    return r == CUDA_SUCCESS ? static_cast<std::uint64_t>(id) : 0;
  }

  [[nodiscard]] event_handle create_event(int device) override
  {
    scoped_context ctx{*this, device};
    CUevent e{};
    check(api_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate", EMMPOOL_WHERE);
    return reinterpret_cast<event_handle>(e);
  }

  void destroy_event(int device, event_handle event) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuEventDestroy(reinterpret_cast<CUevent>(event)), "cuEventDestroy", EMMPOOL_WHERE);
  }

  void record_event(int device, event_handle event, stream_handle stream) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuEventRecord(reinterpret_cast<CUevent>(event), reinterpret_cast<CUstream>(stream)),
          "cuEventRecord", EMMPOOL_WHERE);
  }

  [[nodiscard]] bool event_completed(int device, event_handle event) override
  {
    scoped_context ctx{*this, device};
    auto const r = api_.cuEventQuery(reinterpret_cast<CUevent>(event));
    if (r == CUDA_ERROR_NOT_READY) { return false; }
    check(r, "cuEventQuery", EMMPOOL_WHERE);
    return true;
  }

  void synchronize_event(int device, event_handle event) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuEventSynchronize(reinterpret_cast<CUevent>(event)), "cuEventSynchronize",
          EMMPOOL_WHERE);
  }

  void release_context(int device) override
  {
    auto& a = load();
    std::lock_guard lock{contexts_mutex_};
    if (device < 0 || static_cast<std::size_t>(device) >= contexts_.size()) { return; }
    auto& ctx = contexts_[static_cast<std::size_t>(device)];
    if (ctx == nullptr) { return; }
    CUdevice dev{};
    check(a.cuDeviceGet(&dev, device), "cuDeviceGet", EMMPOOL_WHERE);
    ctx = nullptr;
    if (auto* k = known(device)) { k->store(nullptr); }
    check(a.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease", EMMPOOL_WHERE);
  }

  void synchronize_device(int device) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuCtxSynchronize(), "cuCtxSynchronize", EMMPOOL_WHERE);
  }

  [[nodiscard]] std::uint64_t stream_id(int device, stream_handle stream) override
  {
    (void)load();
    if (stream_get_id_ == nullptr) { return 0; }
    unsigned long long id{};
    // A stream handle names its own context, and this is on the allocation path of every named
    // stream: no context switch, unless the driver asks for one (a free from a thread with no
    // context current, say).
    auto r = stream_get_id_(reinterpret_cast<CUstream>(stream), &id);
    if (r == CUDA_ERROR_INVALID_CONTEXT) {
      scoped_context ctx{*this, device};
      r = stream_get_id_(reinterpret_cast<CUstream>(stream), &id);
    }
    check(r, "cuStreamGetId", EMMPOOL_WHERE);
    return static_cast<std::uint64_t>(id);
  }

  [[nodiscard]] ipc_bytes ipc_handle(int device, device_ptr segment_base) override
  {
    scoped_context ctx{*this, device};
    CUipcMemHandle h{};
    check(api_.cuIpcGetMemHandle(&h, static_cast<CUdeviceptr>(segment_base)), "cuIpcGetMemHandle",
          EMMPOOL_WHERE);
    ipc_bytes out{};
    static_assert(sizeof(h.reserved) == std::tuple_size_v<ipc_bytes>);
    std::memcpy(out.data(), h.reserved, out.size());
    return out;
  }

  [[nodiscard]] device_ptr ipc_open(int device, ipc_bytes const& handle) override
  {
    scoped_context ctx{*this, device};
    CUipcMemHandle h{};
    std::memcpy(h.reserved, handle.data(), handle.size());
    CUdeviceptr p{};
    check(api_.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
          "cuIpcOpenMemHandle", EMMPOOL_WHERE);
    return static_cast<device_ptr>(p);
  }

  void ipc_close(int device, device_ptr ptr) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuIpcCloseMemHandle(static_cast<CUdeviceptr>(ptr)), "cuIpcCloseMemHandle",
          EMMPOOL_WHERE);
  }

  [[nodiscard]] memory_info memory_info_of(int device) override
  {
    scoped_context ctx{*this, device};
    std::size_t free = 0, total = 0;
    check(api_.cuMemGetInfo(&free, &total), "cuMemGetInfo", EMMPOOL_WHERE);
    return {free, total};
  }

  [[nodiscard]] void* host_allocate(int device, std::size_t bytes, unsigned flags) override
  {
    scoped_context ctx{*this, device};
    relaxed_capture relaxed{api_};
    void* p      = nullptr;
    auto const r = api_.cuMemHostAlloc(&p, bytes, flags);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw out_of_memory{"cuMemHostAlloc of " + std::to_string(bytes) + " bytes: out of memory"};
    }
    check(r, "cuMemHostAlloc", EMMPOOL_WHERE);
    return p;
  }

  void host_deallocate(int device, void* ptr) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuMemFreeHost(ptr), "cuMemFreeHost", EMMPOOL_WHERE);
  }

  void host_register(int device, void* ptr, std::size_t bytes, unsigned flags) override
  {
    scoped_context ctx{*this, device};
    unsigned cu_flags = 0;
    if (flags & host_portable) { cu_flags |= CU_MEMHOSTREGISTER_PORTABLE; }
    if (flags & host_mapped) { cu_flags |= CU_MEMHOSTREGISTER_DEVICEMAP; }
    check(api_.cuMemHostRegister(ptr, bytes, cu_flags), "cuMemHostRegister", EMMPOOL_WHERE);
  }

  void host_unregister(int device, void* ptr) override
  {
    scoped_context ctx{*this, device};
    check(api_.cuMemHostUnregister(ptr), "cuMemHostUnregister", EMMPOOL_WHERE);
  }

  // --- virtual memory management: optional entry points (vmm_ below), so that a driver
  // without them still serves fixed segments.

  [[nodiscard]] std::size_t vmm_page_size(int device) override
  {
    (void)load();
    if (!vmm_.complete()) { return 0; }
    CUdevice dev{};
    check(api_.cuDeviceGet(&dev, device), "cuDeviceGet", EMMPOOL_WHERE);
    int supported = 0;
    if (vmm_.cuDeviceGetAttribute(&supported,
                                  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                  dev) != CUDA_SUCCESS ||
        supported == 0) {
      return 0;
    }
    auto const prop = allocation_prop(dev);
    std::size_t granularity = 0;
    if (vmm_.cuMemGetAllocationGranularity(&granularity, &prop,
                                           CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS) {
      return 0;
    }
    return granularity;
  }

  [[nodiscard]] device_ptr reserve_address(int device, std::size_t bytes) override
  {
    scoped_context ctx{*this, device};
    require_vmm("cuMemAddressReserve");
    relaxed_capture relaxed{api_};
    CUdeviceptr p{};
    check(vmm_.cuMemAddressReserve(&p, bytes, 0, 0, 0), "cuMemAddressReserve", EMMPOOL_WHERE);
    return static_cast<device_ptr>(p);
  }

  void free_address(int device, device_ptr base, std::size_t bytes) override
  {
    scoped_context ctx{*this, device};
    require_vmm("cuMemAddressFree");
    check(vmm_.cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree",
          EMMPOOL_WHERE);
  }

  [[nodiscard]] physical_handle create_physical(int device, std::size_t bytes) override
  {
    scoped_context ctx{*this, device};
    require_vmm("cuMemCreate");
    relaxed_capture relaxed{api_};
    CUdevice dev{};
    check(api_.cuDeviceGet(&dev, device), "cuDeviceGet", EMMPOOL_WHERE);
    // Exportable as a file descriptor (IPC of growable blocks), unless this device or driver
    // refused that once: then plain pages, which serve everything but IPC.
    auto const bit = std::uint64_t{1} << (static_cast<unsigned>(device) % 64);
    CUmemGenericAllocationHandle h{};
    auto r = CUDA_ERROR_NOT_SUPPORTED;
    if ((not_shareable_.load(std::memory_order_relaxed) & bit) == 0) {
      auto prop                 = allocation_prop(dev);
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      r = vmm_.cuMemCreate(&h, bytes, &prop, 0);
      if ((r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_VALUE) &&
          (not_shareable_.fetch_or(bit, std::memory_order_relaxed) & bit) == 0) {
        // Said once per device, where it happens: from now on its growable blocks serve
        // everything but sharing with another process, which fails naming this.
        char const* name = nullptr;
        if (api_.cuGetErrorName == nullptr || api_.cuGetErrorName(r, &name) != CUDA_SUCCESS) {
          name = "an error";
        }
        std::fprintf(stderr,
                     "emmpool: device %d refuses exportable pages (cuMemCreate with POSIX file "
                     "descriptors: %s): its growable blocks cannot be shared with another "
                     "process; EMMPOOL_SEGMENTS=fixed shares blocks with legacy IPC handles\n",
                     device, name);
      }
    }
    if ((not_shareable_.load(std::memory_order_relaxed) & bit) != 0) {
      auto const prop = allocation_prop(dev);
      r = vmm_.cuMemCreate(&h, bytes, &prop, 0);
    }
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw out_of_memory{"cuMemCreate of " + std::to_string(bytes) + " bytes: out of memory"};
    }
    check(r, "cuMemCreate", EMMPOOL_WHERE);
    return static_cast<physical_handle>(h);
  }

  void release_physical(int device, physical_handle h) override
  {
    scoped_context ctx{*this, device};
    require_vmm("cuMemRelease");
    check(vmm_.cuMemRelease(static_cast<CUmemGenericAllocationHandle>(h)), "cuMemRelease",
          EMMPOOL_WHERE);
  }

  void map_physical(int device, device_ptr at, std::size_t bytes, physical_handle h) override
  {
    scoped_context ctx{*this, device};
    require_vmm("cuMemMap");
    relaxed_capture relaxed{api_};
    CUdevice dev{};
    check(api_.cuDeviceGet(&dev, device), "cuDeviceGet", EMMPOOL_WHERE);
    auto const p = static_cast<CUdeviceptr>(at);
    check(vmm_.cuMemMap(p, bytes, 0, static_cast<CUmemGenericAllocationHandle>(h), 0), "cuMemMap",
          EMMPOOL_WHERE);
    // Read/write for the device and for every device that can access it as a peer, as a
    // cuMemAlloc segment is once peer access is enabled (VMM mappings need no enabling).
    auto const& readers = accessors(dev);
    std::vector<CUmemAccessDesc> access(readers.size());
    for (std::size_t i = 0; i < readers.size(); ++i) {
      access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access[i].location.id   = readers[i];
      access[i].flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    auto const a = vmm_.cuMemSetAccess(p, bytes, access.data(), access.size());
    if (a != CUDA_SUCCESS) {
      vmm_.cuMemUnmap(p, bytes);
      check(a, "cuMemSetAccess", EMMPOOL_WHERE);
    }
  }

  void unmap_physical(int device, device_ptr at, std::size_t bytes) override
  {
    scoped_context ctx{*this, device};
    require_vmm("cuMemUnmap");
    check(vmm_.cuMemUnmap(static_cast<CUdeviceptr>(at), bytes), "cuMemUnmap", EMMPOOL_WHERE);
  }

  [[nodiscard]] int export_physical(int device, physical_handle h) override
  {
    scoped_context ctx{*this, device};
    if (vmm_.cuMemExportToShareableHandle == nullptr) { require_vmm_ipc("cuMemExportToShareableHandle"); }
    int fd = -1;
    auto const r = vmm_.cuMemExportToShareableHandle(
      &fd, static_cast<CUmemGenericAllocationHandle>(h), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      0);
    auto const bit = std::uint64_t{1} << (static_cast<unsigned>(device) % 64);
    if (r != CUDA_SUCCESS && (not_shareable_.load(std::memory_order_relaxed) & bit) != 0) {
      check(r, "cuMemExportToShareableHandle (this device refused exportable pages: "
               "EMMPOOL_SEGMENTS=fixed shares blocks with legacy IPC handles)",
            EMMPOOL_WHERE);
    }
    check(r, "cuMemExportToShareableHandle", EMMPOOL_WHERE);
    return fd;
  }

  [[nodiscard]] physical_handle import_physical(int device, int fd) override
  {
    scoped_context ctx{*this, device};
    if (vmm_.cuMemImportFromShareableHandle == nullptr) {
      require_vmm_ipc("cuMemImportFromShareableHandle");
    }
    relaxed_capture relaxed{api_};
    CUmemGenericAllocationHandle h{};
    // The handle type's descriptor is passed by value, in the pointer (CUDA's documented form).
    check(vmm_.cuMemImportFromShareableHandle(
            &h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle", EMMPOOL_WHERE);
    return static_cast<physical_handle>(h);
  }

 private:
  struct vmm_api {
    decltype(&::cuDeviceGetAttribute) cuDeviceGetAttribute                     = nullptr;
    decltype(&::cuMemGetAllocationGranularity) cuMemGetAllocationGranularity = nullptr;
    decltype(&::cuMemAddressReserve) cuMemAddressReserve                       = nullptr;
    decltype(&::cuMemAddressFree) cuMemAddressFree                             = nullptr;
    decltype(&::cuMemCreate) cuMemCreate                                       = nullptr;
    decltype(&::cuMemRelease) cuMemRelease                                     = nullptr;
    decltype(&::cuMemMap) cuMemMap                                             = nullptr;
    decltype(&::cuMemUnmap) cuMemUnmap                                         = nullptr;
    decltype(&::cuMemSetAccess) cuMemSetAccess                                 = nullptr;
    decltype(&::cuDeviceCanAccessPeer) cuDeviceCanAccessPeer = nullptr;  // optional: own device only
    // optional: IPC of growable blocks
    decltype(&::cuMemExportToShareableHandle) cuMemExportToShareableHandle     = nullptr;
    decltype(&::cuMemImportFromShareableHandle) cuMemImportFromShareableHandle = nullptr;
    [[nodiscard]] bool complete() const noexcept
    {
      return cuDeviceGetAttribute && cuMemGetAllocationGranularity && cuMemAddressReserve &&
             cuMemAddressFree && cuMemCreate && cuMemRelease && cuMemMap && cuMemUnmap &&
             cuMemSetAccess;
    }
  };

  static CUmemAllocationProp allocation_prop(CUdevice dev)
  {
    CUmemAllocationProp prop{};
    prop.type          = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id   = dev;
    return prop;
  }

  // The device itself, then the devices that can access its memory as peers; asked once.
  std::vector<CUdevice> const& accessors(CUdevice dev)
  {
    std::lock_guard lock{contexts_mutex_};
    auto& list = accessors_[static_cast<int>(dev)];
    if (list.empty()) {
      list.push_back(dev);
      int n = 0;
      if (api_.cuDeviceGetCount(&n) == CUDA_SUCCESS && vmm_.cuDeviceCanAccessPeer != nullptr) {
        for (int d = 0; d < n; ++d) {
          CUdevice other{};
          int can = 0;
          if (d == static_cast<int>(dev) || api_.cuDeviceGet(&other, d) != CUDA_SUCCESS) {
            continue;
          }
          if (vmm_.cuDeviceCanAccessPeer(&can, other, dev) == CUDA_SUCCESS && can != 0) {
            list.push_back(other);
          }
        }
      }
    }
    return list;
  }

  [[noreturn]] static void require_vmm_ipc(char const* call)
  {
    throw cuda_error{call, static_cast<int>(CUDA_ERROR_NOT_SUPPORTED), "CUDA_ERROR_NOT_SUPPORTED",
                     EMMPOOL_WHERE};
  }

  void require_vmm(char const* call) const
  {
    if (!vmm_.complete()) {
      throw cuda_error{call, static_cast<int>(CUDA_ERROR_NOT_SUPPORTED), "CUDA_ERROR_NOT_SUPPORTED",
                       EMMPOOL_WHERE};
    }
  }

  // Makes the device's primary context current for one call when it is not already. Numba,
  // CuPy and PyTorch all work in primary contexts; finalizer threads may have none current.
  class scoped_context {
   public:
    scoped_context(cuda_driver_impl& d, int device) : api_{d.load()}
    {
      CUcontext want = d.primary_context(device);
      CUcontext cur{};
      check(api_.cuCtxGetCurrent(&cur), "cuCtxGetCurrent", EMMPOOL_WHERE);
      if (cur != want) {
        check(api_.cuCtxPushCurrent(want), "cuCtxPushCurrent", EMMPOOL_WHERE);
        pushed_ = true;
      }
    }
    ~scoped_context()
    {
      if (pushed_) {
        CUcontext popped{};
        api_.cuCtxPopCurrent(&popped);
      }
    }
    scoped_context(scoped_context const&)            = delete;
    scoped_context& operator=(scoped_context const&) = delete;

   private:
    api const& api_;
    bool pushed_ = false;
  };

  /// The calling thread in relaxed capture mode for one call that takes memory from the driver
  /// (and the undoing of a half-done one). While any thread captures a CUDA graph in "global"
  /// mode, CUDA refuses every other thread's potentially unsafe calls (cuMemAlloc, cuMemCreate,
  /// cuMemMap, ...) unless that thread is relaxed: without this, a pool that grows for one
  /// library while another captures breaks the capture. These calls record nothing into any
  /// graph. PyTorch relaxes its cudaMalloc only on a thread whose stream is capturing; emmpool
  /// relaxes every thread that grows the pool, since its pool serves every library's threads.
  /// Calls that give memory back are not relaxed: they may synchronize, which a capture
  /// forbids, and the pool holds them back during the captures it knows of.
  class relaxed_capture {
   public:
    explicit relaxed_capture(api const& a) : api_{a}
    {
      relaxed_ = api_.cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
    }
    ~relaxed_capture()
    {
      if (relaxed_) { api_.cuThreadExchangeStreamCaptureMode(&mode_); }
    }
    relaxed_capture(relaxed_capture const&)            = delete;
    relaxed_capture& operator=(relaxed_capture const&) = delete;

   private:
    api const& api_;
    CUstreamCaptureMode mode_{CU_STREAM_CAPTURE_MODE_RELAXED};  // then the thread's own
    bool relaxed_{};
  };

  static void check(CUresult r, char const* call, char const* where)
  {
    if (r == CUDA_SUCCESS) { return; }
    char const* name = nullptr;
    // The instance is loaded whenever a call could fail, so the name lookup is available.
    auto& a = instance_api();
    if (a.cuGetErrorName == nullptr || a.cuGetErrorName(r, &name) != CUDA_SUCCESS) {
      name = "CUDA_ERROR_UNKNOWN";
    }
    throw cuda_error{call, static_cast<int>(r), name, where};
  }

  static api& instance_api();

  api& load()
  {
    std::call_once(loaded_, [this] { load_once(); });
    if (!load_error_.empty()) { throw driver_unavailable{load_call_, load_code_, load_error_}; }
    return api_;
  }

  // Each failure gets one sentence (driver_unavailable): what is missing, what it means for
  // this process, what to do.
  void load_once()
  {
    handle_ = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      char const* why = ::dlerror();  // "libcuda.so.1: cannot open shared object file: ..."
      load_call_      = "dlopen";
      load_code_      = static_cast<int>(CUDA_ERROR_NO_DEVICE);
      load_error_     = std::string{"No NVIDIA driver found ("} + (why ? why : "libcuda.so.1") +
                    "), so emmpool cannot use a GPU in this process: install the NVIDIA "
                    "driver, or run on a machine with an NVIDIA GPU.";
      return;
    }
#define EMMPOOL_API(fn)                                                                    \
  api_.fn = reinterpret_cast<decltype(api_.fn)>(::dlsym(handle_, EMMPOOL_STRINGIFY(fn)));  \
  if (api_.fn == nullptr) {                                                                \
    load_call_  = "dlsym";                                                                 \
    load_code_  = static_cast<int>(CUDA_ERROR_NOT_FOUND);                                  \
    load_error_ = std::string{"The NVIDIA driver is older than CUDA "} +                   \
                  std::to_string(CUDA_VERSION / 1000) + " (it lacks " +                   \
                  EMMPOOL_STRINGIFY(fn) + "), so emmpool cannot use the GPU: update the " \
                  "NVIDIA driver.";                                                        \
    return;                                                                                \
  }
#include "cuda_driver_api.inc"
#undef EMMPOOL_API
    // Optional (CUDA 12.0+): without it the pool cannot tell a new stream from a destroyed one
    // under the same handle, and so never names a stream after the call that passed it.
    stream_get_id_ = reinterpret_cast<decltype(&::cuStreamGetId)>(
      ::dlsym(handle_, EMMPOOL_STRINGIFY(cuStreamGetId)));
    // Optional too: growable segments (virtual memory management, CUDA 10.2+).
#define EMMPOOL_VMM(fn) vmm_.fn = reinterpret_cast<decltype(vmm_.fn)>(::dlsym(handle_, EMMPOOL_STRINGIFY(fn)));
    EMMPOOL_VMM(cuDeviceGetAttribute)
    EMMPOOL_VMM(cuMemGetAllocationGranularity)
    EMMPOOL_VMM(cuMemAddressReserve)
    EMMPOOL_VMM(cuMemAddressFree)
    EMMPOOL_VMM(cuMemCreate)
    EMMPOOL_VMM(cuMemRelease)
    EMMPOOL_VMM(cuMemMap)
    EMMPOOL_VMM(cuMemUnmap)
    EMMPOOL_VMM(cuMemSetAccess)
    EMMPOOL_VMM(cuDeviceCanAccessPeer)
    EMMPOOL_VMM(cuMemExportToShareableHandle)
    EMMPOOL_VMM(cuMemImportFromShareableHandle)
#undef EMMPOOL_VMM
    auto const r = api_.cuInit(0);
    if (r != CUDA_SUCCESS) {
      char const* name = nullptr;
      api_.cuGetErrorName(r, &name);
      load_call_  = "cuInit";
      load_code_  = static_cast<int>(r);
      load_error_ = std::string{"The NVIDIA driver is installed but cannot start ("} +
                    (name ? name : "cuInit failed") +
                    "), so emmpool cannot use a GPU in this process: check that a GPU is "
                    "visible (nvidia-smi, CUDA_VISIBLE_DEVICES) and that the driver matches "
                    "its kernel module.";
      return;
    }
    std::atexit([] { exiting.store(true); });
  }

  CUcontext primary_context(int device)
  {
    // Every driver call asks (scoped_context): once retained, without the lock.
    auto* const k = known(device);
    if (auto* ctx = k != nullptr ? k->load(std::memory_order_acquire) : nullptr) { return ctx; }
    std::lock_guard lock{contexts_mutex_};
    if (device < 0) { throw std::invalid_argument{"device must be a non-negative ordinal"}; }
    // The ordinal is checked before anything is sized by it: it may come from another
    // process (an IPC handle), and a huge one must be an error, not a huge vector.
    CUdevice dev{};
    check(api_.cuDeviceGet(&dev, device), "cuDeviceGet", EMMPOOL_WHERE);
    if (static_cast<std::size_t>(device) >= contexts_.size()) {
      contexts_.resize(static_cast<std::size_t>(device) + 1, nullptr);
    }
    auto& ctx = contexts_[static_cast<std::size_t>(device)];
    if (ctx == nullptr) {
      // Retained until the pool's reset() (release_context); never released at exit, where
      // a release could race with the driver's own teardown.
      check(api_.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain", EMMPOOL_WHERE);
      if (k != nullptr) { k->store(ctx, std::memory_order_release); }
    }
    return ctx;
  }

  std::once_flag loaded_;
  void* handle_ = nullptr;
  api api_{};
  decltype(&::cuStreamGetId) stream_get_id_ = nullptr;
  vmm_api vmm_{};
  std::map<int, std::vector<CUdevice>> accessors_;  // contexts_mutex_
  // Per device (bit device % 64): cuMemCreate refused exportable pages once; asks no more.
  std::atomic<std::uint64_t> not_shareable_{0};
  std::string load_call_;
  std::string load_error_;
  int load_code_ = 0;
  std::mutex contexts_mutex_;
  std::vector<CUcontext> contexts_;
  std::array<std::atomic<CUcontext>, 64> known_{};  // contexts_' first 64, readable unlocked
  [[nodiscard]] std::atomic<CUcontext>* known(int device) noexcept
  {
    auto const d = static_cast<std::size_t>(device);
    return device >= 0 && d < known_.size() ? &known_[d] : nullptr;
  }
};

cuda_driver_impl& instance()
{
  // Never destroyed: pools may use it from finalizers during interpreter exit.
  static auto* d = new cuda_driver_impl{};
  return *d;
}

api& cuda_driver_impl::instance_api() { return instance().api_; }

}  // namespace

driver& cuda_driver() { return instance(); }

bool process_is_exiting() noexcept { return exiting.load(std::memory_order_relaxed); }

}  // namespace emmpool
