# cython: language_level=3
# distutils: language = c++
"""emmpool's pool as an RMM device memory resource (resource.hpp), for Python: a subclass of
RMM's DeviceMemoryResource, whose resource_ref RMM's C++ callers allocate through. Built on the
user's machine against the installed RMM by emmpool._rmm; glue only."""

from cpython.pycapsule cimport PyCapsule_GetPointer
from libcpp.optional cimport optional

from rmm.librmm.memory_resource cimport device_async_resource_ref
from rmm.pylibrmm.memory_resource._memory_resource cimport DeviceMemoryResource


cdef extern from "resource.hpp" namespace "emmpool_rmm" nogil:
    cdef cppclass resource:
        resource(const void* api, int device) except +
        int device()


# RMM's pxd defines cython_device_async_resource_ref (its Cython name: device_async_resource_ref)
# above this point of the generated source; a reference to the resource, as RMM's own classes
# make theirs.
cdef extern from *:
    """
    inline std::optional<cython_device_async_resource_ref> emmpool_rmm_ref(
        emmpool_rmm::resource& r)
    {
        return std::optional<cython_device_async_resource_ref>(
            rmm::device_async_resource_ref(r));
    }
    """
    optional[device_async_resource_ref] emmpool_rmm_ref(resource&) except +


cdef class EmmpoolMemoryResource(DeviceMemoryResource):
    """Allocates from emmpool's pool of one device, in stream order, as RMM's (use
    ``emmpool.rmm_resource(device)``, which makes one per device)."""

    # Never deleted: RMM's C++ callers (its per-device map, libcudf's statics) may keep a
    # reference to it past this object's life, up to the process's exit, and the pools it
    # allocates from live as long. Two words, one per device (emmpool.rmm_resource).
    cdef resource* c_obj

    def __cinit__(self, int device, object api):
        self.c_obj = new resource(PyCapsule_GetPointer(api, "emmpool.rmm_api"), device)
        self.c_ref = emmpool_rmm_ref(self.c_obj[0])

    def __init__(self, int device, object api):
        pass

    @property
    def device(self) -> int:
        """The CUDA ordinal whose pool this resource allocates from."""
        return self.c_obj.device()

    def __repr__(self) -> str:
        return f"EmmpoolMemoryResource(device={self.device})"
