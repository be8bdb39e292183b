// The Python errors of the extension's plain-CPython entry points (numba_entry_points.cpp,
// cuda_core_entry_points.cpp): a C++ exception set as the Python error a pybind11-bound call
// would raise, and the error being raised taken off, raised again, or replaced by the caller's
// own (`raise as_error(e) from None`). Glue only; internal to the extension.
#pragma once

#include <pybind11/pybind11.h>

namespace emmpool::bindings {

// Set the Python error of the exception being handled, as a pybind11-bound call would.
inline void set_error_from_current_exception()
{
  try {
    throw;
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (...) {
    // pybind11's translators, emmpool's included (module.cpp), as its dispatcher applies them.
#if __has_include(<pybind11/detail/exception_translation.h>)  // pybind11 >= 2.13
    pybind11::detail::try_translate_exceptions();
#else
    if (pybind11::detail::apply_exception_translators(
          pybind11::detail::get_local_internals().registered_exception_translators) ||
        pybind11::detail::apply_exception_translators(
          pybind11::detail::get_internals().registered_exception_translators)) {
      return;
    }
    PyErr_SetString(PyExc_SystemError, "Exception escaped from default exception translator!");
#endif
  }
}

// The exception being raised, taken off (normalized, its traceback on it): a new reference.
inline PyObject* take_raised()
{
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type = nullptr, *error = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &error, &traceback);
  PyErr_NormalizeException(&type, &error, &traceback);
  if (traceback != nullptr) { PyException_SetTraceback(error, traceback); }
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  return error;
#endif
}

// Raise take_raised()'s exception again (stealing the reference).
inline void raise_again(PyObject* error)
{
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(error);
#else
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(error));
  Py_INCREF(type);
  PyErr_Restore(type, error, PyException_GetTraceback(error));
#endif
}

// Replace the error being raised by as_error(error), raised as Python's
// `raise new from new.__cause__` (None, but for an out-of-memory callback's own error).
inline void raise_as(PyObject* as_error)
{
  PyObject* error  = take_raised();
  PyObject* raised = PyObject_CallOneArg(as_error, error);
  bool const same  = raised == error;
  Py_DECREF(error);
  if (raised == nullptr) { return; }
  if (PyExceptionInstance_Check(raised) == 0) {
    PyErr_Format(PyExc_TypeError, "as_error returned %R, not an exception", raised);
  } else {
    // A new exception: its own cause (as_error may set one), and __suppress_context__; the
    // error itself goes on as it was raised.
    if (!same) { PyException_SetCause(raised, PyException_GetCause(raised)); }
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(raised)), raised);
  }
  Py_DECREF(raised);
}

}  // namespace emmpool::bindings
