// The CuPy adapter, whole: the C entry points CuPy's CFunctionAllocator calls (no Python per
// allocation), how they learn CuPy's current stream, how their failures become CuPy's
// exceptions, and the allocator object emmpool.hooks.use_for_cupy() installs. Part of the
// extension (it needs Python); bind_cupy() adds its functions to emmpool._core.
#include "c_api.hpp"
#include "cupy_adapter.hpp"
#include "python_gil.hpp"

#include <emmpool/detail/stream_key.hpp>
#include <emmpool/round_up.hpp>

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace py = pybind11;

namespace {

using namespace emmpool;

// ---- CuPy's current stream --------------------------------------------------------------------

// How to ask CuPy for its current stream: one of the Cython functions it exports, found by
// emmpool.hooks, cheapest first (both read CuPy's thread-local state):
//   "intptr_t (int)":  cupy_backends.cuda.stream.get_stream_ptr(device);
//   "intptr_t (void)": cupy.cuda.stream.get_current_stream_ptr(), of the current device, which
//                      asks the runtime for it and goes through one more thread-local lookup.
// They need the GIL, which CuPy holds when it calls its allocator; anywhere else the answer is
// "unknown" (-1), and the free is fenced on the legacy stream. Set and read under the GIL.
std::intptr_t (*cupy_stream_of_device)(int)       = nullptr;
std::intptr_t (*cupy_stream_of_current_device)() = nullptr;
constexpr char const* cupy_stream_of_device_signature         = "intptr_t (int)";
constexpr char const* cupy_stream_of_current_device_signature = "intptr_t (void)";

std::intptr_t cupy_stream_under_gil(int device)
{
  if (!python::holds_gil()) { return -1; }
  std::intptr_t const s = cupy_stream_of_device != nullptr ? cupy_stream_of_device(device)
                                                           : cupy_stream_of_current_device();
  if (s == -1 && PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    return -1;
  }
  return s;
}

// What the C entry points ask (cupy_stream_under_gil, or nothing); a negative answer: cannot
// say. Without it, CuPy's memory names no stream (legacy fence).
std::atomic<std::intptr_t (*)(int)> cupy_stream_source{nullptr};

stream_handle cupy_current_stream(int device) noexcept
{
  auto* source          = cupy_stream_source.load(std::memory_order_acquire);
  std::intptr_t const s = source != nullptr ? source(device) : -1;
  return s < 0 ? legacy_stream : static_cast<stream_handle>(s);
}

// ---- failures as CuPy's exceptions ------------------------------------------------------------

// Raise `out_of_memory(size, -1)` (CuPy's OutOfMemoryError(size, total)).
void set_out_of_memory(PyObject* out_of_memory, PyObject* size)
{
  PyObject* err = PyObject_CallFunction(out_of_memory, "On", size, Py_ssize_t{-1});
  if (err != nullptr) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err)), err);
    Py_DECREF(err);
  }
}

// CuPy's OutOfMemoryError while the CuPy entry point raises (set_cupy_failure); a strong
// reference, never released (the entry point may run until the process ends).
PyObject* cupy_out_of_memory = nullptr;

// The CuPy entry point's failure, as a Python exception (CuPy calls it with the GIL held):
// CuPy's OutOfMemoryError(size, -1), ValueError for an invalid request, RuntimeError else; the
// return value -1 is what CuPy's Cython wrapper (`cdef intptr_t _call_malloc`, exceptions
// propagated, -1 their marker) takes for "look for an exception". Without the GIL: NULL.
void* raise_cupy_failure(std::size_t size, int, int kind, char const* what)
{
  if (!python::holds_gil()) { return nullptr; }
  if (kind == 0 && cupy_out_of_memory != nullptr) {
    if (PyObject* n = PyLong_FromSize_t(size)) {
      set_out_of_memory(cupy_out_of_memory, n);
      Py_DECREF(n);
    }
  } else {
    PyErr_Format(kind == 1 ? PyExc_ValueError : PyExc_RuntimeError, "%s", what);
  }
  return reinterpret_cast<void*>(std::intptr_t{-1});
}

// How a failed CuPy allocation is reported. By default not at all: NULL (CuPy cannot tell it
// from a pointer: the allocator object then checks each result). raise_cupy_failure once
// emmpool.hooks has seen this CuPy pass on an exception raised by its C malloc.
std::atomic<c_api::failure_fn> cupy_failure{nullptr};

// ---- the allocator object ---------------------------------------------------------------------

// CuPy's allocator as emmpool installs it: CFunctionAllocator.malloc (over the C entry points)
// of the size rounded up to CuPy's allocation unit (512 bytes), as CuPy's own pool reports it
// in `Memory.size`, which CuPy code may rely on (its own test_percentile_memory_access does);
// then, where `out_of_memory` is given, a NULL pointer turned into CuPy's OutOfMemoryError,
// which CuPy itself does not do. A C function, so that each cupy.empty runs no Python frame of
// ours. `self` is the tuple (CFunctionAllocator.malloc, OutOfMemoryError or None).
constexpr std::size_t cupy_allocation_unit = 512;

PyObject* cupy_malloc(PyObject* self, PyObject* size)
{
  std::size_t const n = PyLong_AsSize_t(size);
  if (n == static_cast<std::size_t>(-1) && PyErr_Occurred() != nullptr) { return nullptr; }
  std::size_t const rounded =
    n > SIZE_MAX - cupy_allocation_unit ? n : round_up(n, cupy_allocation_unit);
  PyObject* rounded_size = rounded == n ? (Py_INCREF(size), size) : PyLong_FromSize_t(rounded);
  if (rounded_size == nullptr) { return nullptr; }
  PyObject* mem = PyObject_CallOneArg(PyTuple_GET_ITEM(self, 0), rounded_size);
  Py_DECREF(rounded_size);
  PyObject* const out_of_memory = PyTuple_GET_ITEM(self, 1);
  if (mem == nullptr || out_of_memory == Py_None) { return mem; }
  PyObject* ptr = PyObject_GetAttrString(mem, "ptr");
  if (ptr == nullptr) {
    Py_DECREF(mem);
    return nullptr;
  }
  int const is_null = PyObject_Not(ptr);
  Py_DECREF(ptr);
  if (is_null < 0) {
    Py_DECREF(mem);
    return nullptr;
  }
  if (is_null == 1 && n > 0) {  // size 0 gives ptr 0 too
    Py_DECREF(mem);  // holds no memory: CuPy frees nothing for ptr 0
    set_out_of_memory(out_of_memory, size);
    return nullptr;
  }
  return mem;
}

PyMethodDef cupy_malloc_def = {"cupy_malloc", &cupy_malloc, METH_O,
                               "CuPy's allocator over emmpool's pool (emmpool.use_for_cupy)."};

}  // namespace

// ---- the C entry points -------------------------------------------------------------------------

/// How a failed CuPy allocation is reported (see cupy_failure; null: it returns NULL).
EMMPOOL_C_API void emmpool_set_cupy_failure(c_api::failure_fn report)
{
  cupy_failure.store(report, std::memory_order_release);
}

/// How the CuPy entry points learn CuPy's current stream on a device (null: they do not).
EMMPOOL_C_API void emmpool_set_cupy_stream_source(std::intptr_t (*source)(int device))
{
  cupy_stream_source.store(source, std::memory_order_release);
}

/// CuPy: void* malloc(void* param, size_t size, int device_id). The block is used on CuPy's
/// current stream, as in CuPy's own pool.
EMMPOOL_C_API void* emmpool_cupy_malloc(void*, std::size_t size, int device)
{
  return c_api::allocate_tagged(size, device, cupy_current_stream(device), alloc_tag::cupy,
                                cupy_failure.load(std::memory_order_acquire));
}

/// CuPy: void free(void* param, void* ptr, int device_id). No stream is passed: the free is
/// fenced on the stream of the allocation, as CuPy's own pool does.
EMMPOOL_C_API void emmpool_cupy_free(void*, void* ptr, int device)
{
  c_api::free_on(ptr, device, allocation_stream, alloc_tag::cupy);
}

// ---- emmpool._core's CuPy functions -------------------------------------------------------------

void emmpool::bind_cupy(py::module_& m)
{
  m.def(
    "cupy_malloc",
    [](py::object c_malloc, py::object out_of_memory) {
      py::tuple const self = py::make_tuple(std::move(c_malloc), std::move(out_of_memory));
      return py::reinterpret_steal<py::object>(PyCFunction_New(&cupy_malloc_def, self.ptr()));
    },
    py::arg("c_malloc"), py::arg("out_of_memory") = py::none(),
    "c_malloc(size rounded up to 512 bytes, CuPy's allocation unit); with out_of_memory, "
    "raising out_of_memory(size, -1) where c_malloc returns memory at address 0 for a "
    "positive size (CuPy's CFunctionAllocator does not check the C function's result).");
  m.def(
    "set_cupy_failure",
    [](py::object out_of_memory) {
      emmpool_set_cupy_failure(nullptr);
      if (out_of_memory.is_none()) { return; }
      PyObject* old      = cupy_out_of_memory;
      cupy_out_of_memory = out_of_memory.release().ptr();
      Py_XDECREF(old);
      emmpool_set_cupy_failure(&raise_cupy_failure);
    },
    py::arg("out_of_memory"),
    "Make the CuPy entry point raise its failures (out_of_memory(size, -1) for lack of memory) "
    "and return -1; None: return NULL, raising nothing.");
  m.def(
    "set_cupy_stream_source",
    [](py::object capsule) {
      if (capsule.is_none()) {
        emmpool_set_cupy_stream_source(nullptr);
        return;
      }
      auto cap               = capsule.cast<py::capsule>();
      std::string const name = cap.name() != nullptr ? cap.name() : "";
      if (name != cupy_stream_of_device_signature &&
          name != cupy_stream_of_current_device_signature) {
        throw std::invalid_argument{std::string{"expected a capsule of signature '"} +
                                    cupy_stream_of_device_signature + "' or '" +
                                    cupy_stream_of_current_device_signature + "', got '" + name +
                                    "'"};
      }
      emmpool_set_cupy_stream_source(nullptr);  // while the function pointers change
      cupy_stream_of_device         = nullptr;
      cupy_stream_of_current_device = nullptr;
      if (name == cupy_stream_of_device_signature) {
        cupy_stream_of_device = reinterpret_cast<std::intptr_t (*)(int)>(cap.get_pointer());
      } else {
        cupy_stream_of_current_device = reinterpret_cast<std::intptr_t (*)()>(cap.get_pointer());
      }
      emmpool_set_cupy_stream_source(&cupy_stream_under_gil);
    },
    py::arg("capsule"),
    "Let the CuPy entry points ask CuPy's current stream (the capsule of "
    "cupy_backends.cuda.stream.get_stream_ptr or cupy.cuda.stream.get_current_stream_ptr); "
    "None: stop asking.");
}
