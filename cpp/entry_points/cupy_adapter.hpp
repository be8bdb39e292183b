// The CuPy adapter (cupy_adapter.cpp): its functions of emmpool._core. Internal.
#pragma once

#include <pybind11/pybind11.h>

extern "C" {
void* emmpool_cupy_malloc(void*, std::size_t, int);
void emmpool_cupy_free(void*, void*, int);
}

namespace emmpool {

/// Add cupy_malloc, set_cupy_failure and set_cupy_stream_source to the module.
void bind_cupy(pybind11::module_& m);

}  // namespace emmpool
