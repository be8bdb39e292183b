// The DevicePool behind a Python object, for the plain-CPython entry points
// (numba_entry_points.cpp, cuda_core_entry_points.cpp), which hold the object to keep the pool
// alive and call the pool itself. Glue only; internal to the extension.
#pragma once

#include "python_errors.hpp"

#include <emmpool/device_pool.hpp>

#include <pybind11/pybind11.h>

namespace emmpool::bindings {

// The pool that `pool_object` (a DevicePool) wraps; nullptr with TypeError set, naming `who`
// (the type being made), for anything else.
inline device_pool* device_pool_of(PyObject* pool_object, char const* who)
{
  device_pool* pool = nullptr;
  try {
    if (pybind11::isinstance<device_pool>(pybind11::handle(pool_object))) {
      pool = pybind11::handle(pool_object).cast<device_pool*>();
    }
  } catch (...) {
    set_error_from_current_exception();
    return nullptr;
  }
  if (pool == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s needs a DevicePool, not %s", who,
                 Py_TYPE(pool_object)->tp_name);
  }
  return pool;
}

}  // namespace emmpool::bindings
