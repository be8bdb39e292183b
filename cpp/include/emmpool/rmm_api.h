/*
 * emmpool/rmm_api.h - the C interface between emmpool's core and its native RMM resource.
 *
 * The resource (cpp/rmm/) is compiled on the user's machine against the installed RMM, whose
 * C++ symbols are versioned per release, as the PyTorch extension is against PyTorch. It gets
 * this table from _core (emmpool._core._rmm_api(), a PyCapsule named "emmpool.rmm_api") when it
 * is made, and refuses one whose abi is not EMMPOOL_RMM_ABI_VERSION (bump it on any change).
 *
 * The functions take no Python lock and need none: libcudf's threads call them with the GIL
 * released, or from threads Python never saw. Where the caller does hold the GIL, it is let go
 * of while the pool waits (cpp/entry_points/caller_lock.hpp); emmpool's out-of-memory callback
 * takes it to run. No function throws, nor unwinds: a thread that takes the GIL back once the
 * interpreter finalizes waits there for the process to exit (caller_lock.hpp).
 */
#ifndef EMMPOOL_RMM_API_H
#define EMMPOOL_RMM_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EMMPOOL_RMM_ABI_VERSION 1
#define EMMPOOL_RMM_CAPSULE "emmpool.rmm_api"

/* What an allocation failed of. */
#define EMMPOOL_RMM_OUT_OF_MEMORY 0
#define EMMPOOL_RMM_INVALID_ARGUMENT 1
#define EMMPOOL_RMM_OTHER 2

typedef struct emmpool_rmm_api {
  int abi; /* EMMPOOL_RMM_ABI_VERSION */
  /* A block of `size` bytes of `device`'s pool, in the order of `stream` (a cudaStream_t;
   * NULL is the legacy default stream), counted as RMM's. NULL on failure: `*failure` says
   * what failed, `message` (of `message_size` bytes, NUL-terminated) why. */
  void* (*allocate)(size_t size, int device, void* stream, int* failure, char* message,
                    size_t message_size);
  /* `ptr` (of `allocate`) back to `device`'s pool, fenced on `stream`: the pool hands it out
   * again once the work `stream` has queued so far is done (at once on that stream). A
   * pointer the pool does not hold as RMM's is ignored. */
  void (*deallocate)(void* ptr, int device, void* stream);
  /* Wait until the work `stream` of `device` has queued so far is done (RMM's synchronous
   * allocations): through the core's driver, as every CUDA call. 0 on success, else -1 with
   * `message` filled. */
  int (*synchronize)(int device, void* stream, char* message, size_t message_size);
} emmpool_rmm_api;

#ifdef __cplusplus
}
#endif

#endif /* EMMPOOL_RMM_API_H */
