// The two calls of every Buffer of emmpool's cuda.core memory resource (cuda_core.py), through
// which numba-cuda copies host arrays for kernel launches and cuda.core's own users allocate, as
// plain CPython objects: no pybind11 dispatch per call, and no Python frame for the resource's
// own methods.
//
//   calls = _core.ResourceCalls(pool, tag)
//   ptr = calls.allocate(size, stream); calls.deallocate(ptr, stream)   # the pool's, tagged
//   allocate, deallocate = calls.methods_for(resource, ...)   # the resource's methods, whole
//
// They keep the GIL rules of DevicePool.allocate / .deallocate exactly, through the same
// functions (pool_calls.hpp): first try without waiting for the pool's lock and without a CUDA
// call, holding the GIL; else let go of it (caller_lock.hpp, which takes it back where a daemon
// thread's end at exit may unwind). C++ exceptions become the same Python exceptions as through
// pybind11 (its registered translators: python_errors.hpp).
#include "cuda_core_entry_points.hpp"

#include "caller_lock.hpp"
#include "pool_calls.hpp"
#include "pool_object.hpp"
#include "python_errors.hpp"

#include <emmpool/device_pool.hpp>

#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstddef>

namespace emmpool::bindings {
namespace {

namespace py = pybind11;

// ---- cuda.core's memory resource: one per pool and library ------------------------------

struct resource_calls_object {
  PyObject_HEAD
  PyObject* pool_object;  // the DevicePool: keeps `pool` alive
  device_pool* pool;
  alloc_tag tag;
};

PyTypeObject* resource_calls_type = nullptr;

void resource_calls_dealloc(PyObject* self)
{
  auto* type = Py_TYPE(self);
  Py_XDECREF(reinterpret_cast<resource_calls_object*>(self)->pool_object);
  PyObject_Free(self);
  Py_DECREF(type);
}

// The pool's allocate and free under the resource's tag, through pool_calls (the GIL rules of
// DevicePool.allocate / .deallocate): false with the Python error set where the pool raised.
bool allocate_tagged(resource_calls_object const& r, std::size_t size, stream_handle stream,
                     device_ptr* out)
{
  try {
    *out = pool_calls::allocate(*r.pool, size, stream, r.tag);
    return true;
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    set_error_from_current_exception();
    return false;
  }
}

bool free_tagged(resource_calls_object const& r, device_ptr ptr, stream_handle stream)
{
  try {
    pool_calls::deallocate(*r.pool, ptr, stream, block_owner::of_library(r.tag));
    return true;
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    set_error_from_current_exception();
    return false;
  }
}

// `o` as an unsigned 64-bit integer (an address, a stream handle): false with Python's
// TypeError or OverflowError set.
bool as_u64(PyObject* o, unsigned long long* out)
{
  *out = PyLong_AsUnsignedLongLong(o);
  return *out != static_cast<unsigned long long>(-1) || PyErr_Occurred() == nullptr;
}

// allocate(size, stream) -> address, as DevicePool.allocate(size, stream, tag).
PyObject* resource_calls_allocate(PyObject* self, PyObject* const* args, Py_ssize_t nargs)
{
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "allocate(size, stream) takes 2 arguments (%zd given)", nargs);
    return nullptr;
  }
  std::size_t const size = PyLong_AsSize_t(args[0]);  // TypeError, or OverflowError if < 0
  if (size == static_cast<std::size_t>(-1) && PyErr_Occurred() != nullptr) { return nullptr; }
  unsigned long long stream = 0;
  if (!as_u64(args[1], &stream)) { return nullptr; }
  device_ptr ptr{};
  if (!allocate_tagged(*reinterpret_cast<resource_calls_object*>(self), size, stream, &ptr)) {
    return nullptr;
  }
  return PyLong_FromUnsignedLongLong(ptr);
}

// deallocate(ptr, stream), as DevicePool.deallocate_tagged(ptr, stream, tag).
PyObject* resource_calls_deallocate(PyObject* self, PyObject* const* args, Py_ssize_t nargs)
{
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "deallocate(ptr, stream) takes 2 arguments (%zd given)", nargs);
    return nullptr;
  }
  unsigned long long ptr = 0, stream = 0;
  if (!as_u64(args[0], &ptr) || !as_u64(args[1], &stream)) { return nullptr; }
  if (!free_tagged(*reinterpret_cast<resource_calls_object*>(self), ptr, stream)) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// ---- the resource's allocate and deallocate themselves, with no Python frame ---------------

// Each is a builtin function whose `self` is a tuple of these. The resource keeps them in its
// __dict__ and they hold the resource (Buffer.from_handle takes it, the fallbacks are its bound
// methods): a cycle, through objects the garbage collector tracks (tuple, function, resource).
enum resource_slot : Py_ssize_t {
  rslot_calls,        // the ResourceCalls
  rslot_resource,     // the EmmPoolMemoryResource
  rslot_fallback,     // its Python method: what the fast path does not take on
  rslot_stream_type,  // cuda.core's Stream (exactly that type: a subclass goes to the fallback)
  rslot_namespace,    // the module's globals: Buffer is looked up there at each call
  rslot_as_error,     // exception -> the exception to raise
  rslot_count
};

PyObject* cuda_stream_name = nullptr;  // "__cuda_stream__"
PyObject* stream_name      = nullptr;  // "stream"
PyObject* buffer_name      = nullptr;  // "Buffer"
PyObject* from_handle_name = nullptr;  // "from_handle"
PyObject* stream_kwnames   = nullptr;  // ("stream",)

// The call's keywords are none or `stream` alone; *stream is then its value (nullptr: absent).
bool only_stream_keyword(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                         PyObject** stream)
{
  *stream = nullptr;
  if (kwnames == nullptr || PyTuple_GET_SIZE(kwnames) == 0) { return true; }
  if (PyTuple_GET_SIZE(kwnames) != 1) { return false; }
  PyObject* const name = PyTuple_GET_ITEM(kwnames, 0);
  if (name != stream_name && PyUnicode_Compare(name, stream_name) != 0) { return false; }
  *stream = args[nargs];
  return true;
}

// The handle of `stream` (nullptr or None: `none`): 1; 0 for what the fast path leaves to the
// Python method (not exactly cuda.core's Stream, or a __cuda_stream__ answer not (int, int >= 0)),
// which handles it, errors included; -1 with the error of __cuda_stream__ set.
int stream_handle_of(PyObject* stream, PyObject* stream_type, stream_handle none,
                     stream_handle* out)
{
  if (stream == nullptr || stream == Py_None) {
    *out = none;
    return 1;
  }
  if (reinterpret_cast<PyObject*>(Py_TYPE(stream)) != stream_type) { return 0; }
  PyObject* call[] = {nullptr, stream};
  PyObject* info   = PyObject_VectorcallMethod(cuda_stream_name, call + 1,
                                               1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (info == nullptr) { return -1; }
  int handled = 0;
  if (PyTuple_CheckExact(info) && PyTuple_GET_SIZE(info) == 2 &&
      PyLong_CheckExact(PyTuple_GET_ITEM(info, 1))) {
    unsigned long long h = 0;
    if (!as_u64(PyTuple_GET_ITEM(info, 1), &h)) {
      PyErr_Clear();  // negative, or past 64 bits: the Python method says what it says
    } else {
      *out    = h;
      handled = 1;
    }
  }
  Py_DECREF(info);
  return handled;
}

// Forward the call, as it came, to the resource's Python method.
PyObject* to_fallback(PyObject* state, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames)
{
  return PyObject_Vectorcall(PyTuple_GET_ITEM(state, rslot_fallback), args,
                             static_cast<std::size_t>(nargs), kwnames);
}

// allocate(size, *, stream=None) -> Buffer: EmmPoolMemoryResource.allocate for a size > 0 (an
// int) on cuda.core's Stream or None; anything else goes to that method.
PyObject* resource_allocate(PyObject* state, PyObject* const* args, Py_ssize_t nargs,
                            PyObject* kwnames)
{
  PyObject* stream = nullptr;
  if (nargs != 1 || !only_stream_keyword(args, nargs, kwnames, &stream) ||
      !PyLong_CheckExact(args[0])) {
    return to_fallback(state, args, nargs, kwnames);
  }
  std::size_t const size = PyLong_AsSize_t(args[0]);
  if (size == 0 || (size == static_cast<std::size_t>(-1) && PyErr_Occurred() != nullptr)) {
    PyErr_Clear();  // zero, negative or too large: the method's own answer or error
    return to_fallback(state, args, nargs, kwnames);
  }
  stream_handle handle{};
  int const got = stream_handle_of(stream, PyTuple_GET_ITEM(state, rslot_stream_type),
                                   legacy_stream, &handle);
  if (got < 0) { return nullptr; }
  if (got == 0) { return to_fallback(state, args, nargs, kwnames); }

  auto* r = reinterpret_cast<resource_calls_object*>(PyTuple_GET_ITEM(state, rslot_calls));
  device_ptr ptr{};
  if (!allocate_tagged(*r, size, handle, &ptr)) {
    raise_as(PyTuple_GET_ITEM(state, rslot_as_error));
    return nullptr;
  }
  // Buffer.from_handle(ptr, size, resource, stream=stream), Buffer as the module has it now.
  PyObject* buffer = nullptr;
  PyObject* type   = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, rslot_namespace), buffer_name);
  if (type == nullptr && PyErr_Occurred() == nullptr) {
    PyErr_SetString(PyExc_NameError, "name 'Buffer' is not defined");
  }
  if (type != nullptr) {
    if (PyObject* from_handle = PyObject_GetAttr(type, from_handle_name)) {
      if (PyObject* ptr_object = PyLong_FromUnsignedLongLong(ptr)) {
        PyObject* call[] = {nullptr, ptr_object, args[0], PyTuple_GET_ITEM(state, rslot_resource),
                            stream != nullptr ? stream : Py_None};
        buffer = PyObject_Vectorcall(from_handle, call + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     stream_kwnames);
        Py_DECREF(ptr_object);
      }
      Py_DECREF(from_handle);
    }
  }
  if (buffer == nullptr) {
    // No Buffer owns the block: give it back now (fenced by the allocation's stream), keeping
    // the error being raised.
    PyObject* error = take_raised();
    if (!free_tagged(*r, ptr, allocation_stream)) { PyErr_Clear(); }  // the first error goes on
    raise_again(error);
  }
  return buffer;
}

// deallocate(ptr, size, *, stream=None): EmmPoolMemoryResource.deallocate for an int ptr on
// cuda.core's Stream or None; anything else goes to that method.
PyObject* resource_deallocate(PyObject* state, PyObject* const* args, Py_ssize_t nargs,
                              PyObject* kwnames)
{
  PyObject* stream = nullptr;
  if (nargs != 2 || !only_stream_keyword(args, nargs, kwnames, &stream) ||
      !PyLong_CheckExact(args[0])) {
    return to_fallback(state, args, nargs, kwnames);
  }
  unsigned long long ptr = 0;
  if (!as_u64(args[0], &ptr)) {
    PyErr_Clear();  // negative, or past 64 bits: the method's own answer or error
    return to_fallback(state, args, nargs, kwnames);
  }
  if (ptr == 0) { Py_RETURN_NONE; }  // a zero-byte Buffer
  stream_handle handle{};
  int const got = stream_handle_of(stream, PyTuple_GET_ITEM(state, rslot_stream_type),
                                   allocation_stream, &handle);
  if (got < 0) { return nullptr; }
  if (got == 0) { return to_fallback(state, args, nargs, kwnames); }
  auto* r = reinterpret_cast<resource_calls_object*>(PyTuple_GET_ITEM(state, rslot_calls));
  if (!free_tagged(*r, ptr, handle)) { return nullptr; }
  Py_RETURN_NONE;
}

PyMethodDef resource_allocate_def = {
  "allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&resource_allocate)),
  METH_FASTCALL | METH_KEYWORDS,
  "allocate(size, *, stream=None) -> Buffer: EmmPoolMemoryResource.allocate, in C."};

PyMethodDef resource_deallocate_def = {
  "deallocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&resource_deallocate)),
  METH_FASTCALL | METH_KEYWORDS,
  "deallocate(ptr, size, *, stream=None): EmmPoolMemoryResource.deallocate, in C."};

// methods_for(resource, allocate, deallocate, Stream, namespace, as_error) -> (allocate,
// deallocate): the resource's two methods in C, over its bound Python ones.
PyObject* resource_calls_methods_for(PyObject* self, PyObject* args)
{
  PyObject *resource = nullptr, *allocate = nullptr, *deallocate = nullptr;
  PyObject *stream_type = nullptr, *space = nullptr, *as_error = nullptr;
  if (PyArg_ParseTuple(args, "OOOO!O!O:methods_for", &resource, &allocate, &deallocate,
                       &PyType_Type, &stream_type, &PyDict_Type, &space, &as_error) == 0) {
    return nullptr;
  }
  if (PyCallable_Check(allocate) == 0 || PyCallable_Check(deallocate) == 0 ||
      PyCallable_Check(as_error) == 0) {
    PyErr_SetString(PyExc_TypeError, "methods_for needs the two methods and a callable");
    return nullptr;
  }
  PyObject* result = nullptr;
  PyObject* alloc_state = PyTuple_Pack(rslot_count, self, resource, allocate, stream_type, space,
                                       as_error);
  PyObject* free_state  = PyTuple_Pack(rslot_count, self, resource, deallocate, stream_type, space,
                                       as_error);
  if (alloc_state != nullptr && free_state != nullptr) {
    PyObject* a = PyCFunction_New(&resource_allocate_def, alloc_state);
    PyObject* d = PyCFunction_New(&resource_deallocate_def, free_state);
    if (a != nullptr && d != nullptr) { result = PyTuple_Pack(2, a, d); }
    Py_XDECREF(a);
    Py_XDECREF(d);
  }
  Py_XDECREF(alloc_state);
  Py_XDECREF(free_state);
  return result;
}

PyObject* resource_calls_new(PyTypeObject*, PyObject* args, PyObject* kwargs)
{
  static char const* keywords[] = {"pool", "tag", nullptr};
  PyObject* pool_object          = nullptr;
  int tag                        = 0;
  if (PyArg_ParseTupleAndKeywords(args, kwargs, "Oi", const_cast<char**>(keywords), &pool_object,
                                  &tag) == 0) {
    return nullptr;
  }
  if (tag < 0 || tag >= static_cast<int>(alloc_tag_count)) {
    PyErr_Format(PyExc_ValueError, "tag must be an index of LIBRARIES, not %d", tag);
    return nullptr;
  }
  device_pool* const pool = device_pool_of(pool_object, "ResourceCalls");
  if (pool == nullptr) { return nullptr; }
  auto* r = PyObject_New(resource_calls_object, resource_calls_type);
  if (r == nullptr) { return nullptr; }
  Py_INCREF(pool_object);
  r->pool_object = pool_object;
  r->pool        = pool;
  r->tag         = static_cast<alloc_tag>(tag);
  return reinterpret_cast<PyObject*>(r);
}

PyMethodDef resource_calls_methods[] = {
  {"allocate",
   reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&resource_calls_allocate)),
   METH_FASTCALL,
   "allocate(size, stream) -> address: DevicePool.allocate(size, stream, tag), raising as it "
   "does."},
  {"deallocate",
   reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&resource_calls_deallocate)),
   METH_FASTCALL,
   "deallocate(ptr, stream): DevicePool.deallocate_tagged(ptr, stream, tag), raising as it "
   "does."},
  {"methods_for", &resource_calls_methods_for, METH_VARARGS,
   "methods_for(resource, allocate, deallocate, Stream, namespace, as_error) -> (allocate, "
   "deallocate): the resource's allocate and deallocate in C, for an int size or address and "
   "a stream that is None or exactly Stream; any other call goes to the bound Python method "
   "given. Buffer is namespace['Buffer'] at each call; a pool error e is raised as "
   "`raise as_error(e) from None` (its own cause kept)."},
  {nullptr, nullptr, 0, nullptr}};

PyMemberDef resource_calls_members[] = {
  {"pool", T_OBJECT, offsetof(resource_calls_object, pool_object), READONLY, "the DevicePool"},
  {nullptr, 0, 0, 0, nullptr}};

}  // namespace

void add_cuda_core_entry_points(PyObject* module)
{
  static PyType_Slot resource_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&resource_calls_dealloc)},
    {Py_tp_new, reinterpret_cast<void*>(&resource_calls_new)},
    {Py_tp_methods, resource_calls_methods},
    {Py_tp_members, resource_calls_members},
    {Py_tp_doc, const_cast<char*>(
                  "ResourceCalls(pool, tag): the allocate and free of emmpool's cuda.core memory "
                  "resource over one DevicePool, without pybind11's dispatch per call.")},
    {0, nullptr}};
  static PyType_Spec resource_spec = {"emmpool._core.ResourceCalls", sizeof(resource_calls_object),
                                      0, Py_TPFLAGS_DEFAULT, resource_slots};
  cuda_stream_name = PyUnicode_InternFromString("__cuda_stream__");
  stream_name      = PyUnicode_InternFromString("stream");
  buffer_name      = PyUnicode_InternFromString("Buffer");
  from_handle_name = PyUnicode_InternFromString("from_handle");
  if (cuda_stream_name == nullptr || stream_name == nullptr || buffer_name == nullptr ||
      from_handle_name == nullptr) {
    throw py::error_already_set();
  }
  stream_kwnames = PyTuple_Pack(1, stream_name);
  if (stream_kwnames == nullptr) { throw py::error_already_set(); }
  resource_calls_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&resource_spec));
  if (resource_calls_type == nullptr) { throw py::error_already_set(); }
  if (PyModule_AddObjectRef(module, "ResourceCalls",
                            reinterpret_cast<PyObject*>(resource_calls_type)) < 0) {
    throw py::error_already_set();
  }
}

}  // namespace emmpool::bindings
