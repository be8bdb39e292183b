// The Numba plugin's hot pair as plain CPython objects (numba_entry_points.cpp).
#pragma once

#include <Python.h>

namespace emmpool::bindings {

/// Add the types NumbaEntryPoints and NumbaFree to the module. @throws pybind11::error_already_set
void add_numba_entry_points(PyObject* module);

}  // namespace emmpool::bindings
