// The two calls of every Numba array, as plain CPython objects: no pybind11 dispatch (argument
// overload resolution, std::optional conversions), no functools.partial per array.
//
//   entry = _core.NumbaEntryPoints(pool)
//   free  = entry.allocate(size)   # a new block; `free` is its finalizer, `free.ptr` its address
//   free()                         # the block back to the pool (Numba's fenced free)
//
// They keep the GIL rules of DevicePool.allocate / .deallocate exactly: first try without
// waiting for the pool's lock and without a CUDA call (try_allocate / try_deallocate), holding
// the GIL; else let go of the GIL and take the lock (a thread holding it may be waiting for GPU
// work queued behind a host callback that needs the GIL). C++ exceptions become the same Python
// exceptions as through pybind11 (its registered translators).
#include "numba_entry_points.hpp"

#include <emmpool/device_pool.hpp>

#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>
#include <exception>

namespace emmpool::bindings {
namespace {

namespace py = pybind11;

struct entry_points_object {
  PyObject_HEAD
  PyObject* pool_object;  // the DevicePool: keeps `pool` alive
  device_pool* pool;
};

struct finalizer_object {
  PyObject_HEAD
  entry_points_object* entry;  // strong: its pool outlives every block's free
  unsigned long long ptr;
  unsigned long long generation;
};

// Set the Python error of the exception being handled, as a pybind11-bound call would.
void set_error_from_current_exception()
{
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (...) {
    // pybind11's translators, emmpool's included (module.cpp), as its dispatcher applies them.
#if __has_include(<pybind11/detail/exception_translation.h>)  // pybind11 >= 2.13
    py::detail::try_translate_exceptions();
#else
    if (py::detail::apply_exception_translators(
          py::detail::get_local_internals().registered_exception_translators) ||
        py::detail::apply_exception_translators(
          py::detail::get_internals().registered_exception_translators)) {
      return;
    }
    PyErr_SetString(PyExc_SystemError, "Exception escaped from default exception translator!");
#endif
  }
}

// ---- the finalizer: one per array, called once by weakref.finalize -------------------------

PyTypeObject* finalizer_type = nullptr;

void finalizer_dealloc(PyObject* self)
{
  auto* type = Py_TYPE(self);
  Py_XDECREF(reinterpret_cast<PyObject*>(reinterpret_cast<finalizer_object*>(self)->entry));
  PyObject_Free(self);
  Py_DECREF(type);  // instances of a heap type hold a reference to it
}

PyObject* finalizer_call(PyObject* self, PyObject* args, PyObject* kwargs)
{
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "the finalizer takes no arguments");
    return nullptr;
  }
  auto const* f     = reinterpret_cast<finalizer_object*>(self);
  device_pool* pool = f->entry->pool;
  try {
    if (!pool->try_deallocate(f->ptr, legacy_stream, f->generation)) {
      py::gil_scoped_release nogil;
      pool->deallocate(f->ptr, legacy_stream, f->generation);
    }
  } catch (...) {
    set_error_from_current_exception();
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMemberDef finalizer_members[] = {
  {"ptr", T_ULONGLONG, offsetof(finalizer_object, ptr), READONLY, "the block's address"},
  {"generation", T_ULONGLONG, offsetof(finalizer_object, generation), READONLY,
   "the pool's reset generation when the block was allocated"},
  {nullptr, 0, 0, 0, nullptr}};

// ---- the allocator: one per pool and Numba manager -----------------------------------------

PyTypeObject* entry_points_type = nullptr;

void entry_points_dealloc(PyObject* self)
{
  auto* type = Py_TYPE(self);
  Py_XDECREF(reinterpret_cast<entry_points_object*>(self)->pool_object);
  PyObject_Free(self);
  Py_DECREF(type);
}

PyObject* entry_points_allocate(PyObject* self, PyObject* size_object)
{
  auto* e = reinterpret_cast<entry_points_object*>(self);
  std::size_t const size = PyLong_AsSize_t(size_object);  // TypeError, or OverflowError if < 0
  if (size == static_cast<std::size_t>(-1) && PyErr_Occurred() != nullptr) { return nullptr; }
  // The finalizer first: nothing can fail once the block is allocated.
  auto* f = PyObject_New(finalizer_object, finalizer_type);
  if (f == nullptr) { return nullptr; }
  f->entry = nullptr;
  device_ptr ptr{};
  try {
    // The reset generation the allocation ran in, read under the pool's lock: one read before
    // it could be a reset's (by another thread) behind.
    std::uint64_t gen = 0;
    if (auto const p = e->pool->try_allocate(size, legacy_stream, alloc_tag::numba, &gen)) {
      ptr = *p;
    } else {
      py::gil_scoped_release nogil;
      ptr = e->pool->allocate(size, legacy_stream, alloc_tag::numba, &gen);
    }
    f->generation = gen;
  } catch (...) {
    Py_DECREF(reinterpret_cast<PyObject*>(f));
    set_error_from_current_exception();
    return nullptr;
  }
  Py_INCREF(self);
  f->entry = e;
  f->ptr   = ptr;
  return reinterpret_cast<PyObject*>(f);
}

PyObject* entry_points_new(PyTypeObject*, PyObject* args, PyObject* kwargs)
{
  static char const* keywords[] = {"pool", nullptr};
  PyObject* pool_object          = nullptr;
  if (PyArg_ParseTupleAndKeywords(args, kwargs, "O", const_cast<char**>(keywords), &pool_object) ==
      0) {
    return nullptr;
  }
  device_pool* pool = nullptr;
  try {
    if (py::isinstance<device_pool>(py::handle(pool_object))) {
      pool = py::handle(pool_object).cast<device_pool*>();
    }
  } catch (...) {
    set_error_from_current_exception();
    return nullptr;
  }
  if (pool == nullptr) {
    PyErr_Format(PyExc_TypeError, "NumbaEntryPoints needs a DevicePool, not %s",
                 Py_TYPE(pool_object)->tp_name);
    return nullptr;
  }
  auto* e = PyObject_New(entry_points_object, entry_points_type);
  if (e == nullptr) { return nullptr; }
  Py_INCREF(pool_object);
  e->pool_object = pool_object;
  e->pool        = pool;
  return reinterpret_cast<PyObject*>(e);
}

PyMethodDef entry_points_methods[] = {
  {"allocate", &entry_points_allocate, METH_O,
   "allocate(size) -> finalizer: a block of the pool for Numba (no stream named, tagged "
   "numba); the finalizer (free.ptr: the address) frees it, fenced on the legacy stream, in "
   "the reset generation it was allocated in. Raises as DevicePool.allocate."},
  {nullptr, nullptr, 0, nullptr}};

PyMemberDef entry_points_members[] = {
  {"pool", T_OBJECT, offsetof(entry_points_object, pool_object), READONLY, "the DevicePool"},
  {nullptr, 0, 0, 0, nullptr}};

}  // namespace

void add_numba_entry_points(PyObject* module)
{
  static PyType_Slot finalizer_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&finalizer_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(&finalizer_call)},
    {Py_tp_members, finalizer_members},
    {Py_tp_doc, const_cast<char*>("Frees one Numba block of an emmpool pool when called.")},
    {0, nullptr}};
  static PyType_Spec finalizer_spec = {"emmpool._core.NumbaFree", sizeof(finalizer_object), 0,
                                       Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
                                       finalizer_slots};
  static PyType_Slot entry_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&entry_points_dealloc)},
    {Py_tp_new, reinterpret_cast<void*>(&entry_points_new)},
    {Py_tp_methods, entry_points_methods},
    {Py_tp_members, entry_points_members},
    {Py_tp_doc, const_cast<char*>(
                  "NumbaEntryPoints(pool): the Numba plugin's allocate and free of "
                  "one DevicePool, without pybind11's dispatch per call.")},
    {0, nullptr}};
  static PyType_Spec entry_spec = {"emmpool._core.NumbaEntryPoints", sizeof(entry_points_object),
                                   0, Py_TPFLAGS_DEFAULT, entry_slots};

  finalizer_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&finalizer_spec));
  if (finalizer_type == nullptr) { throw py::error_already_set(); }
  entry_points_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&entry_spec));
  if (entry_points_type == nullptr) { throw py::error_already_set(); }
  if (PyModule_AddObjectRef(module, "NumbaFree", reinterpret_cast<PyObject*>(finalizer_type)) < 0 ||
      PyModule_AddObjectRef(module, "NumbaEntryPoints",
                            reinterpret_cast<PyObject*>(entry_points_type)) < 0) {
    throw py::error_already_set();
  }
}

}  // namespace emmpool::bindings
