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

/// Allocate from the process-wide pool of `device`; never throws (see failure_fn).
void* allocate_tagged(std::size_t size, int device, stream_handle stream, alloc_tag tag,
                      failure_fn report = nullptr) noexcept;

/// Free a block of library `tag` into the process-wide pool of `device`; never throws: a
/// foreign or doubly freed pointer is ignored.
void free_on(void* ptr, int device, stream_handle stream, alloc_tag tag) noexcept;

}  // namespace emmpool::c_api
