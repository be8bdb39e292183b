// The two calls of every Numba array, as plain CPython objects: no pybind11 dispatch (argument
// overload resolution, std::optional conversions), no functools.partial per array.
//
//   entry = _core.NumbaEntryPoints(pool)
//   free  = entry.allocate(size)   # a new block; `free` is its finalizer, `free.ptr` its address
//   free()                         # the block back to the pool (Numba's fenced free); once:
//                                  # a second call does nothing, whatever is at ptr by then
//   memalloc = entry.memalloc_for(MemoryPointer, context, as_error)
//   memalloc(size)                 # the EMM plugin's memalloc, whole: no Python frame at all
//
// They keep the GIL rules of DevicePool.allocate / .deallocate exactly, through the same
// functions (pool_calls.hpp): first try without waiting for the pool's lock and without a CUDA
// call, holding the GIL; else let go of it (caller_lock.hpp, which takes it back where a daemon
// thread's end at exit may unwind). C++ exceptions become the same Python exceptions as through
// pybind11 (its registered translators).
#include "numba_entry_points.hpp"

#include "caller_lock.hpp"
#include "pool_calls.hpp"
#include "pool_object.hpp"
#include "python_errors.hpp"

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
  bool freed;  // a second call does nothing (memalloc's cleanup may precede weakref.finalize's)
};

// ---- the finalizer: one per array, called once by weakref.finalize -------------------------

PyTypeObject* finalizer_type = nullptr;

void finalizer_dealloc(PyObject* self)
{
  auto* type = Py_TYPE(self);
  Py_XDECREF(reinterpret_cast<PyObject*>(reinterpret_cast<finalizer_object*>(self)->entry));
  PyObject_Free(self);
  Py_DECREF(type);  // instances of a heap type hold a reference to it
}

// Frees f's block once; false with the Python error set if the pool refused.
bool free_block(finalizer_object* f)
{
  // Marked before the GIL may be let go of: a second call from another thread meanwhile must
  // find it freed, not free the address again (by then, maybe another array's block).
  if (f->freed) { return true; }
  f->freed          = true;
  device_pool* pool = f->entry->pool;
  try {
    pool_calls::deallocate(*pool, f->ptr, legacy_stream, block_owner::of_generation(f->generation));
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    f->freed = false;  // the pool refused: nothing was freed
    set_error_from_current_exception();
    return false;
  }
  return true;
}

PyObject* finalizer_call(PyObject* self, PyObject* args, PyObject* kwargs)
{
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "the finalizer takes no arguments");
    return nullptr;
  }
  return free_block(reinterpret_cast<finalizer_object*>(self)) ? (Py_INCREF(Py_None), Py_None)
                                                               : nullptr;
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

// A new block of e's pool, as its finalizer; nullptr with the Python error set on failure.
finalizer_object* allocate_block(entry_points_object* e, std::size_t size)
{
  // The finalizer first: nothing can fail once the block is allocated.
  auto* f = PyObject_New(finalizer_object, finalizer_type);
  if (f == nullptr) { return nullptr; }
  f->entry = nullptr;
  device_ptr ptr{};
  try {
    // The reset generation the allocation ran in, read under the pool's lock: one read before
    // it could be a reset's (by another thread) behind.
    std::uint64_t gen = 0;
    ptr = pool_calls::allocate(*e->pool, size, legacy_stream, alloc_tag::numba, &gen);
    f->generation = gen;
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    Py_DECREF(reinterpret_cast<PyObject*>(f));
    set_error_from_current_exception();
    return nullptr;
  }
  Py_INCREF(reinterpret_cast<PyObject*>(e));
  f->entry = e;
  f->ptr   = ptr;
  f->freed = false;
  return f;
}

PyObject* entry_points_allocate(PyObject* self, PyObject* size_object)
{
  std::size_t const size = PyLong_AsSize_t(size_object);  // TypeError, or OverflowError if < 0
  if (size == static_cast<std::size_t>(-1) && PyErr_Occurred() != nullptr) { return nullptr; }
  return reinterpret_cast<PyObject*>(
    allocate_block(reinterpret_cast<entry_points_object*>(self), size));
}

// ---- memalloc: Numba's EMM call itself, with no Python frame -------------------------------

// A manager's memalloc is a builtin function whose `self` is this tuple. A tuple holds no
// reference to the manager, so the function, kept in the manager's __dict__, makes no cycle.
enum memalloc_slot : Py_ssize_t {
  slot_entry,         // the NumbaEntryPoints
  slot_pointer_type,  // the package's MemoryPointer
  slot_context,       // what the plugin passes as its context (a weakref.proxy)
  slot_as_error,      // exception -> the exception to raise (the package's, for pool errors)
  slot_kwnames,       // ("finalizer",)
  slot_count
};

// The size as the plugin's Python memalloc takes it (an int, or what has __index__: NumPy
// integers), with its errors. A new reference to the int, or nullptr with the error set.
PyObject* size_of(PyObject* size, std::size_t* out)
{
  PyObject* n = PyNumber_Index(size);
  if (n == nullptr) {
    if (PyErr_ExceptionMatches(PyExc_TypeError) == 0) { return nullptr; }
    PyErr_Clear();
    PyObject* name = PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(size)), "__name__");
    if (name == nullptr) { return nullptr; }
    PyErr_Format(PyExc_TypeError, "allocation size must be an integer number of bytes, not %S",
                 name);
    Py_DECREF(name);
    return nullptr;
  }
  int overflow        = 0;
  long long const big = PyLong_AsLongLongAndOverflow(n, &overflow);
  if (overflow < 0 || (overflow == 0 && big < 0)) {
    PyErr_Format(PyExc_ValueError, "cannot allocate a negative number of bytes (%S)", n);
    Py_DECREF(n);
    return nullptr;
  }
  *out = PyLong_AsSize_t(n);  // OverflowError past size_t
  if (*out == static_cast<std::size_t>(-1) && PyErr_Occurred() != nullptr) {
    Py_DECREF(n);
    return nullptr;
  }
  return n;
}

// memalloc(size) -> MemoryPointer(context, ptr, size, finalizer=free), as plugin.py's.
PyObject* numba_memalloc(PyObject* state, PyObject* size_object)
{
  std::size_t size = 0;
  PyObject* size_int = size_of(size_object, &size);
  if (size_int == nullptr) { return nullptr; }
  auto* e = reinterpret_cast<entry_points_object*>(PyTuple_GET_ITEM(state, slot_entry));
  auto* f = allocate_block(e, size);
  if (f == nullptr) {
    Py_DECREF(size_int);
    raise_as(PyTuple_GET_ITEM(state, slot_as_error));
    return nullptr;
  }
  auto* free       = reinterpret_cast<PyObject*>(f);
  PyObject* memory = nullptr;
  if (PyObject* ptr = PyLong_FromUnsignedLongLong(f->ptr)) {
    PyObject* args[] = {nullptr, PyTuple_GET_ITEM(state, slot_context), ptr, size_int, free};
    memory = PyObject_Vectorcall(PyTuple_GET_ITEM(state, slot_pointer_type), args + 1,
                                 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                 PyTuple_GET_ITEM(state, slot_kwnames));
    Py_DECREF(ptr);
  }
  Py_DECREF(size_int);
  if (memory == nullptr) {
    // No MemoryPointer owns the block: give it back now, keeping the error being raised (the
    // block is freed once even if a half-made pointer's weakref.finalize calls it too).
    PyObject* error = take_raised();
    if (!free_block(f)) { PyErr_Clear(); }
    raise_again(error);
  }
  Py_DECREF(free);
  return memory;
}

PyMethodDef numba_memalloc_def = {
  "memalloc", &numba_memalloc, METH_O,
  "memalloc(size) -> MemoryPointer: a block of emmpool's pool for Numba (EMM), its finalizer "
  "freeing it; failures raised as the package's own errors."};

PyObject* entry_points_memalloc_for(PyObject* self, PyObject* args)
{
  PyObject *pointer_type = nullptr, *context = nullptr, *as_error = nullptr;
  if (PyArg_ParseTuple(args, "OOO:memalloc_for", &pointer_type, &context, &as_error) == 0) {
    return nullptr;
  }
  if (PyCallable_Check(pointer_type) == 0 || PyCallable_Check(as_error) == 0) {
    PyErr_SetString(PyExc_TypeError, "memalloc_for needs a MemoryPointer class and a callable");
    return nullptr;
  }
  PyObject* kwnames = Py_BuildValue("(s)", "finalizer");
  if (kwnames == nullptr) { return nullptr; }
  PyObject* state = PyTuple_Pack(slot_count, self, pointer_type, context, as_error, kwnames);
  Py_DECREF(kwnames);
  if (state == nullptr) { return nullptr; }
  PyObject* function = PyCFunction_New(&numba_memalloc_def, state);
  Py_DECREF(state);
  return function;
}

PyObject* entry_points_new(PyTypeObject*, PyObject* args, PyObject* kwargs)
{
  static char const* keywords[] = {"pool", nullptr};
  PyObject* pool_object          = nullptr;
  if (PyArg_ParseTupleAndKeywords(args, kwargs, "O", const_cast<char**>(keywords), &pool_object) ==
      0) {
    return nullptr;
  }
  device_pool* const pool = device_pool_of(pool_object, "NumbaEntryPoints");
  if (pool == nullptr) { return nullptr; }
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
  {"memalloc_for", &entry_points_memalloc_for, METH_VARARGS,
   "memalloc_for(MemoryPointer, context, as_error) -> memalloc: the EMM plugin's memalloc "
   "(size: an int or what has __index__, >= 0) in C: MemoryPointer(context, address, size, "
   "finalizer=free) over allocate(size); a failure e raised as `raise as_error(e) from None`."},
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
