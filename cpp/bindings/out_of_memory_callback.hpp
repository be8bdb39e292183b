// The Python side of the out-of-memory hook (cpp/entry_points/out_of_memory_hook.hpp): the user's
// callbacks, per device, and the error one of them raised, chained to the OutOfMemoryError it
// leads to. Glue only.
#pragma once

#include <pybind11/pybind11.h>

namespace emmpool::bindings {

/// set_out_of_memory_callback() on the module, and the hook installed.
void add_out_of_memory_callback(pybind11::module_& m);

/// For the exception translator: an OutOfMemoryError (exc, just made) that the message says a
/// callback's error ended gets that error as its __cause__, if this thread kept it.
void chain_callback_error(PyObject* exc, char const* message);

}  // namespace emmpool::bindings
