// What the C entry points share (c_api.cpp: PyTorch and the common part; cupy_adapter.cpp:
// CuPy). Internal to the extension.
#pragma once

#include <emmpool/driver.hpp>
#include <emmpool/stats.hpp>

#include <cstddef>

#define EMMPOOL_C_API extern "C" __attribute__((visibility("default")))

struct emmpool_rmm_api;

namespace emmpool::c_api {

/// What a failed allocation returns: NULL, or what a `report` function makes of the failure.
/// kind: 0 out of memory, 1 invalid argument, 2 any other error.
using failure_fn = void* (*)(std::size_t size, int device, int kind, char const* what);

/// What failed, for a C caller: failure_fn's kind and the message.
struct failure {
  int kind;
  char const* what;  ///< valid while the exception is being handled
};

/// `what` into the caller's buffer of `room` bytes, cut to fit, NUL-terminated (nothing where
/// there is no buffer): how every C entry point hands a message over.
void copy_message(char* to, std::size_t room, char const* what) noexcept;

/// Inside a catch block: the exception being handled, classified (out_of_memory 0,
/// std::invalid_argument 1, anything else 2). The one mapping every C entry point reports by.
[[nodiscard]] failure current_failure() noexcept;

/// Allocate from the process-wide pool of `device` as every entry point does (pool_calls.hpp).
/// @throws as device_pool::allocate
[[nodiscard]] device_ptr allocate_from(std::size_t size, int device, stream_handle stream,
                                       alloc_tag tag);

/// allocate_from(), reporting a failure as failure_fn says. Throws nothing but the end of the
/// thread (not noexcept: see caller_lock.hpp).
void* allocate_tagged(std::size_t size, int device, stream_handle stream, alloc_tag tag,
                      failure_fn report = nullptr);

/// Free a block of library `tag` into the process-wide pool of `device`: a foreign or doubly
/// freed pointer is ignored. The caller's lock and exceptions as for allocate_tagged.
void free_on(void* ptr, int device, stream_handle stream, alloc_tag tag);

/// The table of emmpool/rmm_api.h (c_api_rmm.cpp), for the module to hand over in a capsule.
[[nodiscard]] emmpool_rmm_api const* rmm_api() noexcept;

}  // namespace emmpool::c_api
