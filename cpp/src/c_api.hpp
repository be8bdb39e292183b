// What the C entry points share (c_api.cpp: PyTorch and the common part; cupy_adapter.cpp:
// CuPy). Internal to the extension.
#pragma once

#include <emmpool/driver.hpp>
#include <emmpool/stats.hpp>

#include <cstddef>

#define EMMPOOL_C_API extern "C" __attribute__((visibility("default")))

namespace emmpool::c_api {

/// What a failed allocation returns: NULL, or what a `report` function makes of the failure.
/// kind: 0 out of memory, 1 invalid argument, 2 any other error.
using failure_fn = void* (*)(std::size_t size, int device, int kind, char const* what);

/// What failed, for a C caller: failure_fn's kind and the message.
struct failure {
  int kind;
  char const* what;  ///< valid while the exception is being handled
};

/// Inside a catch block: the exception being handled, classified (out_of_memory 0,
/// std::invalid_argument 1, anything else 2). The one mapping every C entry point reports by.
[[nodiscard]] failure current_failure() noexcept;

/// The caller's own lock: Python's GIL, which CuPy holds when it calls its allocator, and
/// PyTorch at times. Held while waiting for the pool's lock (whose holder may be waiting for
/// GPU work queued behind a host callback that needs the GIL) or for the GPU (the same
/// callback), it deadlocks. `release` lets go of it if the calling thread holds it and returns
/// what `restore` takes it back with (nullptr: it was not held). The Python extension installs
/// the GIL's (module.cpp); none is installed by default.
struct caller_lock {
  void* (*release)() noexcept;
  void (*restore)(void* token) noexcept;
};
void set_caller_lock(caller_lock lock) noexcept;

/// The caller's lock let go of for this object's lifetime (see caller_lock).
class caller_lock_released {
 public:
  caller_lock_released() noexcept;
  ~caller_lock_released();
  caller_lock_released(caller_lock_released const&)            = delete;
  caller_lock_released& operator=(caller_lock_released const&) = delete;

 private:
  void (*restore_)(void*) noexcept = nullptr;
  void* token_                     = nullptr;
};

/// Allocate from the process-wide pool of `device` as every C entry point does: first without
/// waiting for the pool's lock or the GPU, holding the caller's lock; else without it.
/// @throws as device_pool::allocate
[[nodiscard]] device_ptr allocate_from(std::size_t size, int device, stream_handle stream,
                                       alloc_tag tag);

/// allocate_from(), never throwing (see failure_fn).
void* allocate_tagged(std::size_t size, int device, stream_handle stream, alloc_tag tag,
                      failure_fn report = nullptr) noexcept;

/// Free a block of library `tag` into the process-wide pool of `device`; never throws: a
/// foreign or doubly freed pointer is ignored. The caller's lock as for allocate_tagged.
void free_on(void* ptr, int device, stream_handle stream, alloc_tag tag) noexcept;

}  // namespace emmpool::c_api
