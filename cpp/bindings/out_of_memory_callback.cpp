#include "out_of_memory_callback.hpp"

#include "caller_lock.hpp"
#include "out_of_memory_hook.hpp"
#include "python_gil.hpp"

#include <emmpool/device_pool.hpp>

#include <atomic>
#include <cstring>
#include <map>
#include <string>

namespace py = pybind11;

namespace emmpool::bindings {

py::dict stats_dict(pool_stats const& s);  // module.cpp

namespace {

// Callbacks by device (-1: every device without its own). Read and written with the GIL held;
// never destroyed (they live as long as the interpreter).
std::map<int, py::object>& callbacks()
{
  static auto* m = new std::map<int, py::object>;
  return *m;
}

// Whether any callback is set: without one, an allocation that runs out of memory (PyTorch's,
// on a thread of its own) never waits for the GIL just to learn there is none.
std::atomic<bool> any{false};

// The error a callback raised on this thread, until the OutOfMemoryError it ends in takes it
// (a new reference; nullptr: none). Replaced by the next callback's.
thread_local PyObject* raised = nullptr;

constexpr char const* marker = "the out-of-memory callback raised";

out_of_memory_hook::answer ask(device_pool& pool, std::size_t size, std::string& error)
{
  using answer = out_of_memory_hook::answer;
  if (!any.load(std::memory_order_acquire) || python::finalizing()) {
    return answer::freed_nothing;
  }
  // The pool's statistics first, without the GIL: taking the pool's lock while holding it
  // could deadlock with a thread that holds the pool's lock and waits for the GPU
  // (caller_lock.hpp).
  auto const snapshot = caller_lock::without_caller_lock([&] { return pool.stats(); });
  py::gil_scoped_acquire gil;
  auto& all = callbacks();
  auto it   = all.find(pool.device());
  if (it == all.end()) { it = all.find(-1); }
  if (it == all.end()) { return answer::freed_nothing; }
  py::object const callback = it->second;  // a reference: the callback may replace itself
  try {
    py::dict stats = stats_dict(snapshot);
    bool const freed = py::bool_(callback(pool.device(), size, stats));
    return freed ? answer::freed_something : answer::freed_nothing;
  } catch (py::error_already_set& e) {
    error = std::string{py::str(e.type().attr("__name__"))} + ": " + py::str(e.value()).cast<std::string>();
    Py_XDECREF(raised);
    raised = e.value().inc_ref().ptr();
    // Kept until an OutOfMemoryError takes it, which CuPy's and PyTorch's C entry points never
    // raise: without its traceback it holds no frame (nor the arrays they hold).
    PyException_SetTraceback(raised, Py_None);
    return answer::raised;
  }
}

}  // namespace

void chain_callback_error(PyObject* exc, char const* message)
{
  if (raised == nullptr) { return; }
  if (std::strstr(message, marker) != nullptr) {
    PyException_SetCause(exc, raised);  // steals the reference
  } else {
    Py_DECREF(raised);
  }
  raised = nullptr;
}

void add_out_of_memory_callback(py::module_& m)
{
  m.def(
    "set_out_of_memory_callback",
    [](py::object callback, py::object device) {
      int const d = device.is_none() ? -1 : device.cast<int>();
      if (callback.is_none()) {
        callbacks().erase(d);
      } else {
        if (!PyCallable_Check(callback.ptr())) {
          throw py::type_error("the out-of-memory callback must be callable");
        }
        callbacks()[d] = callback;
      }
      any.store(!callbacks().empty(), std::memory_order_release);
    },
    py::arg("callback"), py::arg("device") = py::none(),
    "callback(device, size, stats) -> bool, asked when an allocation on `device` (None: any "
    "without its own) cannot be served after the pool's own recovery; None removes it.");
  out_of_memory_hook::install(&ask);
}

}  // namespace emmpool::bindings
