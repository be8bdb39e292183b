/**
 * @file driver.hpp
 * @brief The one seam between emmpool and CUDA.
 *
 * Everything emmpool asks of the GPU goes through `driver`. Two implementations exist:
 *  - `cuda_driver()` (cpp/src/cuda_driver.cpp): the CUDA driver API, resolved with
 *    dlopen("libcuda.so.1") at first use, so importing emmpool needs no GPU and no driver;
 *  - `host_driver` (host_driver.hpp): host memory and events that a test completes by hand,
 *    so that the pool logic runs in CI, which has no GPU.
 *
 * Contract common to both:
 *  - every call that concerns a device names it; the CUDA implementation makes that device's
 *    primary context current for the duration of the call when it is not already (so callers on
 *    finalizer threads, or in CuPy/PyTorch hooks, need not care);
 *  - failures throw `cuda_error` (or `out_of_memory` for an allocation the driver refused for
 *    lack of memory), never return silently;
 *  - streams are opaque integers; `legacy_stream` names CUDA's legacy default stream, which
 *    orders after all work previously issued to blocking streams of the context;
 *  - a stream handle other than the null, legacy and per-thread ones (which live as long as
 *    the context) is passed only while its owner guarantees it alive: using a destroyed
 *    stream's handle is undefined (a real driver may crash; the host driver fails loudly).
 *    The pool's rule for this is in reuse_rule.hpp ("stream lifetime").
 */
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace emmpool {

using device_ptr    = std::uintptr_t;  ///< A device address (CUdeviceptr).
using stream_handle = std::uintptr_t;  ///< A CUstream, as an integer.
using event_handle  = std::uintptr_t;  ///< A CUevent, as an integer.
using physical_handle = std::uint64_t;  ///< A CUmemGenericAllocationHandle (cuMemCreate).

/// CU_STREAM_LEGACY: the legacy default stream, whatever the per-thread setting of the caller.
/// To the pool it also means "no stream named": Numba's allocations and frees carry none.
inline constexpr stream_handle legacy_stream = 0x1;
/// CU_STREAM_PER_THREAD: a different stream on each thread under one handle. The pool never
/// keeps it (a free may be fenced from another thread): callers map it to legacy_stream, which
/// orders after every per-thread default stream.
inline constexpr stream_handle per_thread_stream = 0x2;

/// @brief Whether a handle names a stream that lives as long as its context: the null stream
/// (0), the legacy one and the per-thread one. Any other stream may be destroyed at any time
/// by its owner, and its handle then reused for a new stream.
[[nodiscard]] constexpr bool is_context_stream(stream_handle s) noexcept
{
  return s <= per_thread_stream;
}

/// @brief The 64 opaque bytes of a CUipcMemHandle.
using ipc_bytes = std::array<unsigned char, 64>;

/// @brief Free and total memory of a device, as cuMemGetInfo reports them.
struct memory_info {
  std::size_t free;
  std::size_t total;
};

/// @brief Flags of cuMemHostAlloc, per segment of the pinned pool.
enum host_alloc_flags : unsigned {
  host_portable      = 0x01,  // CU_MEMHOSTALLOC_PORTABLE
  host_mapped        = 0x02,  // CU_MEMHOSTALLOC_DEVICEMAP
  host_writecombined = 0x04,  // CU_MEMHOSTALLOC_WRITECOMBINED
};

/// @brief The driver seam. Implementations must be thread-safe.
class driver {
 public:
  virtual ~driver() = default;

  /// @brief Short name for messages ("cuda" or "host").
  [[nodiscard]] virtual std::string name() const = 0;
  /// @brief Number of devices. @throws driver_unavailable where there is no driver.
  [[nodiscard]] virtual int device_count() = 0;
  /// @brief Device of the calling thread's current context, or -1 when none is current.
  [[nodiscard]] virtual int current_device() = 0;

  /// @brief Allocate a segment of device memory. @throws out_of_memory, cuda_error
  [[nodiscard]] virtual device_ptr allocate(int device, std::size_t bytes) = 0;
  /// @brief Return a segment to the driver (cuMemFree: synchronizes the device).
  virtual void deallocate(int device, device_ptr ptr) = 0;
  /// @brief A process-wide unique id of the allocation containing ptr, 0 if ptr is not valid
  /// (e.g. its context was reset). Used to never free an address that has been reused.
  [[nodiscard]] virtual std::uint64_t buffer_id(int device, device_ptr ptr) = 0;

  /// @brief Create an event without timing (cheap to record and query).
  [[nodiscard]] virtual event_handle create_event(int device) = 0;
  virtual void destroy_event(int device, event_handle event) = 0;
  /// @brief Record event on stream: it completes once all work issued before it on stream has.
  virtual void record_event(int device, event_handle event, stream_handle stream) = 0;
  /// @brief True if the event has completed. Never blocks.
  [[nodiscard]] virtual bool event_completed(int device, event_handle event) = 0;
  /// @brief Block until the event has completed.
  virtual void synchronize_event(int device, event_handle event) = 0;
  /// @brief Block until all work of the device's context has completed (cuCtxSynchronize),
  /// on every stream, destroyed ones included.
  virtual void synchronize_device(int device) = 0;
  /// @brief cuStreamGetId: an id unique to this stream for the life of the process, so that a
  /// new stream that reuses a destroyed stream's handle is not mistaken for it. Only for a
  /// stream its owner guarantees alive during the call (not a context stream). 0 where the
  /// driver cannot say (older than CUDA 12.0): the pool then treats the stream as one it can
  /// never name again (no stream order; its frees wait for a device synchronization).
  [[nodiscard]] virtual std::uint64_t stream_id(int device, stream_handle stream) = 0;

  /// @brief Drop what the driver holds of the device's context (the CUDA implementation's
  /// retain of the primary context), because the caller is about to reset it. The next call
  /// for the device attaches to whatever primary context exists then.
  virtual void release_context(int device) = 0;

  /// @brief cuIpcGetMemHandle of a segment base.
  [[nodiscard]] virtual ipc_bytes ipc_handle(int device, device_ptr segment_base) = 0;
  /// @brief cuIpcOpenMemHandle (lazily enabling peer access) of another process's handle: the
  /// memory, mapped here until ipc_close. @throws cuda_error
  [[nodiscard]] virtual device_ptr ipc_open(int device, ipc_bytes const& handle) = 0;
  /// @brief cuIpcCloseMemHandle of what ipc_open() returned.
  virtual void ipc_close(int device, device_ptr ptr) = 0;
  /// @brief cuMemGetInfo of the device.
  [[nodiscard]] virtual memory_info memory_info_of(int device) = 0;

  /// @brief cuMemHostAlloc. @throws out_of_memory, cuda_error
  [[nodiscard]] virtual void* host_allocate(int device, std::size_t bytes, unsigned flags) = 0;
  virtual void host_deallocate(int device, void* ptr) = 0;
  /// @brief cuMemHostRegister of caller memory (flags: host_mapped and/or host_portable).
  virtual void host_register(int device, void* ptr, std::size_t bytes, unsigned flags) = 0;
  virtual void host_unregister(int device, void* ptr) = 0;

  // --- virtual memory management (growable segments, detail/growable_segment.hpp) ------------
  // Address space is reserved once; physical memory is created in pages, mapped into it and
  // unmapped page by page, and a page may be mapped elsewhere again before it is released. The
  // defaults say "unsupported": a driver that does not override them gives the pool fixed
  // segments only.

  /// @brief The page size of physical allocations on the device (cuMemGetAllocationGranularity,
  /// recommended), or 0 where virtual memory management is unsupported: a device without
  /// CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, or a driver lacking the calls.
  [[nodiscard]] virtual std::size_t vmm_page_size(int device);
  /// @brief cuMemAddressReserve of `bytes` (a multiple of the page size), page aligned; no
  /// memory behind it. @throws cuda_error
  [[nodiscard]] virtual device_ptr reserve_address(int device, std::size_t bytes);
  /// @brief cuMemAddressFree of a whole reservation, which must hold no mapping any more.
  virtual void free_address(int device, device_ptr base, std::size_t bytes);
  /// @brief cuMemCreate of `bytes` (a multiple of the page size) of the device's memory,
  /// exportable to another process as a POSIX file descriptor where the driver allows it
  /// (export_physical). @throws out_of_memory, cuda_error
  [[nodiscard]] virtual physical_handle create_physical(int device, std::size_t bytes);
  /// @brief cuMemRelease: the memory goes back once no mapping of it is left (here or in a
  /// process that imported it). @throws cuda_error
  virtual void release_physical(int device, physical_handle h);
  /// @brief cuMemMap of all of `h` at `at` (page aligned, inside a reservation, not mapped)
  /// and cuMemSetAccess read/write for the device and its peers; all or nothing.
  /// @throws cuda_error
  virtual void map_physical(int device, device_ptr at, std::size_t bytes, physical_handle h);
  /// @brief cuMemUnmap of exactly what one map_physical mapped; the handle stays, to be mapped
  /// again or released. The caller guarantees no work that may still touch the range (the
  /// reuse rule's fence completed): unmapping memory a kernel uses is a crash. @throws cuda_error
  virtual void unmap_physical(int device, device_ptr at, std::size_t bytes);
  /// @brief cuMemExportToShareableHandle as a POSIX file descriptor, which the caller owns
  /// (and closes); another process imports it (import_physical) after receiving it over a Unix
  /// socket. @throws cuda_error where `h` was made without that handle type
  [[nodiscard]] virtual int export_physical(int device, physical_handle h);
  /// @brief cuMemImportFromShareableHandle of a descriptor another process exported (still the
  /// caller's to close): a handle to map and, when done, release. @throws cuda_error
  [[nodiscard]] virtual physical_handle import_physical(int device, int fd);
  /// @brief Descriptors one export_physical() keeps open in this process while its result is
  /// (CUDA: the one it returns), for the count asked of the descriptor limit first.
  [[nodiscard]] virtual std::size_t descriptors_per_export() const noexcept { return 1; }
};

/// @brief The process-wide CUDA driver implementation. Loading is deferred to its first call;
/// this accessor itself never touches CUDA.
driver& cuda_driver();

/// @brief Whether the process is exiting (atexit has run): destructors then must not call CUDA,
/// since the driver may already be torn down. Leaking at exit beats crashing at exit.
[[nodiscard]] bool process_is_exiting() noexcept;

}  // namespace emmpool
