// The cuda.core memory resource's hot pair as plain CPython objects (cuda_core_entry_points.cpp).
#pragma once

#include <Python.h>

namespace emmpool::bindings {

/// Add the type ResourceCalls to the module. @throws pybind11::error_already_set
void add_cuda_core_entry_points(PyObject* module);

}  // namespace emmpool::bindings
