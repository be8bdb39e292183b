/*
 * emmpool/torch_api.h - the C interface between emmpool's core and its PyTorch extension.
 *
 * The extension (cpp/torch/) is compiled on the user's machine against the installed PyTorch
 * and finds these functions with dlsym() in emmpool's _core library: nothing links against the
 * other, and this header is the whole contract. Both sides include it; the extension refuses a
 * core whose emmpool_torch_abi_version() is not EMMPOOL_TORCH_ABI_VERSION (bump it on any
 * change below).
 *
 * Conventions: a device is a CUDA ordinal; a stream a cudaStream_t as an opaque pointer; an
 * `emmpool_error*` may be NULL, else it receives what failed. No function throws across this
 * boundary (but a thread's end at interpreter exit: cpp/entry_points/caller_lock.hpp), and none
 * holds the caller's GIL while it waits for a pool's lock or the GPU. Functions that fill an
 * array take its room `n` and return how many entries there are (fill again with more room if
 * that is more than n), or, for queues (segment events, returned foreign blocks), how many they
 * took.
 */
#ifndef EMMPOOL_TORCH_API_H
#define EMMPOOL_TORCH_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EMMPOOL_TORCH_ABI_VERSION 8

/* Every block's address and size are a multiple of this: what the pool rounds a request up to
 * (emmpool::block_alignment; emmpool/round_up.hpp rounds). */
#define EMMPOOL_BLOCK_ALIGNMENT 256

/* ---- kinds -------------------------------------------------------------------------------- */

/* What an allocation failed of. */
typedef enum emmpool_failure {
  EMMPOOL_FAILED_OUT_OF_MEMORY     = 0,
  EMMPOOL_FAILED_INVALID_ARGUMENT  = 1,
  EMMPOOL_FAILED_OTHER             = 2
} emmpool_failure;

/* The library a block was allocated for (emmpool::alloc_tag). */
typedef enum emmpool_library {
  EMMPOOL_LIBRARY_OTHER     = 0,
  EMMPOOL_LIBRARY_NUMBA     = 1,
  EMMPOOL_LIBRARY_CUPY      = 2,
  EMMPOOL_LIBRARY_TORCH     = 3,
  EMMPOOL_LIBRARY_RMM       = 4,
  EMMPOOL_LIBRARY_CUDA_CORE = 5,
  EMMPOOL_LIBRARIES         = 6
} emmpool_library;

/* Where a block is in its life (emmpool::block_status). */
typedef enum emmpool_block_state {
  EMMPOOL_BLOCK_FREE      = 0,
  EMMPOOL_BLOCK_ALLOCATED = 1,
  EMMPOOL_BLOCK_WAITING   = 2 /* freed, waiting for its fence */
} emmpool_block_state;

/* Which requests a segment serves (emmpool::segment_type). */
typedef enum emmpool_segment_type {
  EMMPOOL_SEGMENT_SMALL    = 0,
  EMMPOOL_SEGMENT_LARGE    = 1,
  EMMPOOL_SEGMENT_GROWABLE = 2 /* address space: its free blocks mapped in part */
} emmpool_segment_type;

/* A change of the memory a pool holds from the driver (emmpool::segment_event::kind). */
typedef enum emmpool_segment_action {
  EMMPOOL_SEGMENT_MADE     = 0,
  EMMPOOL_SEGMENT_RELEASED = 1,
  EMMPOOL_SEGMENT_MAPPED   = 2,
  EMMPOOL_SEGMENT_UNMAPPED = 3
} emmpool_segment_action;

/* ---- records ------------------------------------------------------------------------------ */

#define EMMPOOL_ERROR_LENGTH 512

typedef struct emmpool_error {
  int32_t kind; /* emmpool_failure */
  char message[EMMPOOL_ERROR_LENGTH];
} emmpool_error;

/* A device pool now, as PyTorch's allocator reports it (c10's DeviceStats: current and peak
 * values). The free blocks PyTorch's private pools keep are the pool's allocations but PyTorch's
 * cache: they are not among PyTorch's bytes and blocks in use. Bytes are as the pool rounds
 * them. */
typedef struct emmpool_torch_stats {
  uint64_t allocated_bytes;       /* PyTorch's blocks in use */
  uint64_t peak_allocated_bytes;  /* the pool's peak: every library's blocks */
  uint64_t reserved_bytes;        /* with what MemPools' own allocators hold, as PyTorch counts */
  uint64_t peak_reserved_bytes;
  uint64_t inactive_bytes;        /* reserved, in no library's use */
  uint64_t blocks_in_use;         /* every library's */
  uint64_t segments;
} emmpool_torch_stats;

/* What a device pool counted since PyTorch last reset its accumulated statistics
 * (emmpool_torch_reset_accumulated), as PyTorch's allocator reports it (c10's DeviceStats:
 * "allocated" and "freed" values, counts). The reset is PyTorch's alone: the pool's own
 * statistics, which every library shares, go on. */
typedef struct emmpool_torch_accumulated {
  uint64_t allocated_bytes;        /* of PyTorch's blocks, private pools' included */
  uint64_t freed_bytes;
  uint64_t requested_bytes;        /* the same blocks, as PyTorch asked for them */
  uint64_t requested_freed_bytes;
  uint64_t allocations;            /* PyTorch's blocks from the pool */
  uint64_t frees;                  /* every library's, and PyTorch's blocks private pools keep */
  uint64_t segment_allocations;
  uint64_t segment_releases;
  uint64_t out_of_memory;
  uint64_t dormant_fences;         /* device synchronizations for frees of streams maybe gone */
} emmpool_torch_accumulated;

/* One block of a pool's segments; the blocks of a segment tile it, in address order. */
typedef struct emmpool_layout_row {
  uint64_t segment;       /* the segment's base */
  uint64_t segment_size;
  uint64_t ptr;
  uint64_t size;
  uint64_t stream;        /* named at allocation; 1 (CU_STREAM_LEGACY): none */
  uint8_t state;          /* emmpool_block_state */
  uint8_t library;        /* emmpool_library; 0 if free */
  uint8_t kind;           /* emmpool_segment_type */
  uint8_t reserved_[5];
} emmpool_layout_row;

typedef struct emmpool_segment_event {
  uint64_t address;       /* the segment's base, or the first page mapped or unmapped */
  uint64_t size;
  uint8_t action;         /* emmpool_segment_action */
  uint8_t kind;           /* emmpool_segment_type */
  uint8_t library;        /* emmpool_library whose request made it; 0 otherwise */
  uint8_t reserved_[5];
} emmpool_segment_event;

/* A private pool's id (PyTorch's MempoolId_t). */
typedef struct emmpool_private_id {
  uint64_t first;
  uint64_t second;
} emmpool_private_id;

typedef struct emmpool_private_block {
  uint64_t ptr;
  uint64_t size;
  uint64_t stream;        /* the allocation's */
  emmpool_private_id pool;
  int32_t device;
  uint8_t live;
  uint8_t foreign;        /* from the pool's own allocator, not emmpool's */
  uint8_t reserved_[2];
} emmpool_private_block;

/* The pages under a block of the growable segment, shared with another process
 * (emmpool_ipc_share_pages): their descriptors are the pool's, valid while the block is live. */
typedef struct emmpool_shared_pages {
  uint64_t first_page;
  uint64_t page_size;
  uint64_t offset;      /* the shared address - first_page */
  uint64_t block_size;  /* the block's bytes from the shared address on */
  uint64_t pages;       /* how many descriptors there are */
  unsigned char key[16]; /* the block's key: what a receiver shows the sender's IPC service */
} emmpool_shared_pages;

/* ---- the device pools --------------------------------------------------------------------- */

int emmpool_torch_abi_version(void);
/* The name of a library ("numba", "cupy", ...), or NULL past the last. */
const char* emmpool_library_name(int library);

/* Allocate `size` bytes on `device` for `stream`; NULL on failure, saying why in `error`. */
void* emmpool_torch_allocate(size_t size, int device, void* stream, emmpool_error* error);
/* Free a block of PyTorch's; a foreign or doubly freed pointer is ignored. The signature of
 * PyTorch's CUDAPluggableAllocator, which finds it by this name too. */
void emmpool_torch_free(void* ptr, size_t size, int device, void* stream);
/* tensor.record_stream(stream). 0 done; -1 failed. */
int emmpool_torch_record_stream(void* ptr, int device, void* stream, emmpool_error* error);
/* The size of PyTorch's block at ptr on `device` as the pool holds it (a private pool's block
 * too, whatever allocated it); 0 if ptr is none. What the profiler reports for the block's
 * allocation and its free. */
size_t emmpool_torch_block_size(void* ptr, int device);
/* 0 done; -1 if the device has no pool yet (none is made: statistics must not create a
 * context on a device the program never used). */
int emmpool_torch_stats_of(int device, emmpool_torch_stats* out);
/* 0 done; -1 if the device has no pool yet. */
int emmpool_torch_accumulated_of(int device, emmpool_torch_accumulated* out);
void emmpool_torch_reset_peaks(int device);
/* What emmpool_torch_accumulated_of counts starts again from 0. */
void emmpool_torch_reset_accumulated(int device);
/* torch.cuda.empty_cache(): wait for pending frees, return wholly free memory. Bytes released. */
size_t emmpool_torch_trim(int device);
/* The largest block the pool could hand out at once (cuDNN's benchmark mode sizes its
 * workspace by it): its largest free block, or what the device has free within the cap. */
size_t emmpool_torch_largest_block(int device);
/* The CUDA IPC handle (64 bytes) of the segment holding ptr, and ptr's offset in it. 0 / -1. */
int emmpool_torch_ipc_handle(void* ptr, int device, unsigned char* handle, size_t* offset,
                             emmpool_error* error);
/* The cap on what the device's pool reserves, for every library (0: none). 0 / -1. */
int emmpool_torch_set_maximum(int device, size_t bytes, emmpool_error* error);
/* The cap: SIZE_MAX if none, or if the device has no pool. */
size_t emmpool_torch_maximum(int device);
/* Bytes another allocator reserves for PyTorch on the device change by `delta`, counted
 * against the cap. 0 done; 1 an increase that does not fit; -1 failed. */
int emmpool_torch_reserve_outside(int device, long long delta, emmpool_error* error);
/* The blocks of the device's pool (a memory snapshot); -1 if it has no pool. */
long emmpool_torch_layout(int device, emmpool_layout_row* out, size_t n);
/* The pages under the growable block holding ptr: 0 done (at most n descriptors in `fds`,
 * out->pages says how many there are); 1 ptr is no growable block (a fixed block's handle is
 * emmpool_torch_ipc_handle's); -1 failed. */
int emmpool_ipc_share_pages(void* ptr, int device, emmpool_shared_pages* out, int32_t* fds,
                            size_t n, emmpool_error* error);
/* This process's IPC service (emmpool/ipc_service.hpp), started on first use: its address (an
 * abstract socket name, its leading NUL included) in `address` (room n). The address's length
 * (fill again with more room if that is more than n); -1 failed. */
long emmpool_ipc_service(char* address, size_t n, emmpool_error* error);
/* Map pages another process shared (descriptors of this process, the caller's to close),
 * `page_size` bytes each, on `device`: their base, NULL on failure. */
void* emmpool_ipc_open_pages(int device, const int32_t* fds, size_t n, uint64_t page_size,
                             emmpool_error* error);
/* Map the pages another process offers, asking its IPC service for their descriptors (no
 * ptrace rights needed): `address` (address_size bytes) its service's, `key` (16 bytes) the
 * block's (emmpool_shared_pages), `sender_device` its device, `first_page` the first page's
 * address there, `fds` its numbers of the n pages; mapped on `device`. Their base, NULL on
 * failure. */
void* emmpool_ipc_open_offer(int device, const char* address, size_t address_size,
                             const unsigned char* key, int sender_device, uint64_t first_page,
                             uint64_t page_size, const int32_t* fds, size_t n,
                             emmpool_error* error);
/* Unmap what emmpool_ipc_open_pages returned, after a device synchronization. */
void emmpool_ipc_close(void* base);

/* Record segment events in every pool, present and future (on != 0), or stop. */
void emmpool_torch_watch_segments(int on);
/* Take the device's oldest segment events, at most n; -1 if it has no pool. */
long emmpool_torch_segment_events(int device, emmpool_segment_event* out, size_t n);

/* ---- private pools (emmpool/private_pools.hpp) -------------------------------------------- */

void emmpool_private_create_or_incref(int device, emmpool_private_id id);
int emmpool_private_use_count(emmpool_private_id id);
/* 0 done; -1 failed (no such pool). */
int emmpool_private_set_use_on_oom(emmpool_private_id id, int on, emmpool_error* error);
int emmpool_private_set_no_split(emmpool_private_id id, emmpool_error* error);
/* Allocations PyTorch routes to pool `id` on `device` until the matching end; the device pool
 * makes no call a capture forbids meanwhile. 0 / -1 (being allocated to already). */
int emmpool_private_begin(int device, emmpool_private_id id, emmpool_error* error);
void emmpool_private_end(int device, emmpool_private_id id);
void emmpool_private_release(emmpool_private_id id);
/* id {0, 0}: every pool nobody uses. */
void emmpool_private_empty_cache(emmpool_private_id id);
/* A block of pool `id` on `device` that it freed on `stream` (of at least `size` bytes, at most
 * twice); NULL if none. */
void* emmpool_private_take(emmpool_private_id id, size_t size, int device, void* stream);
/* A block of pool `id`: one it freed on `stream`, else a new one of the device's pool. */
void* emmpool_private_allocate(emmpool_private_id id, size_t size, int device, void* stream,
                               emmpool_error* error);
/* ptr (`size` bytes from the pool's own allocator) is a new live block of pool `id`. 0 / -1. */
int emmpool_private_adopt_foreign(emmpool_private_id id, void* ptr, size_t size, int device,
                                  void* stream, emmpool_error* error);
/* Out of memory elsewhere: a free block of a use_on_oom pool, freed on `stream`; else NULL. */
void* emmpool_private_allocate_on_oom(size_t size, int device, void* stream);
void emmpool_private_record_stream(void* ptr);
void emmpool_private_free(void* ptr);
/* The device of a private block, -1 if ptr is not one. */
int emmpool_private_device_of(void* ptr);
/* Take foreign blocks due back to their allocator (the caller deletes each and counts it off
 * with emmpool_torch_reserve_outside), at most n. */
long emmpool_private_returned_foreign(emmpool_private_block* out, size_t n);
/* 1 if pool `id`'s live blocks are exactly ptrs[0..n), 0 if not. */
int emmpool_private_live_blocks_are(emmpool_private_id id, const uint64_t* ptrs, size_t n);
/* Pool `id`'s live blocks, in address order (a checkpoint). */
long emmpool_private_live_blocks(emmpool_private_id id, uint64_t* out, size_t n);
/* Pool `id`'s live blocks become exactly live[0..n). 0 / -1 (pool gone, block left it). */
int emmpool_private_restore(emmpool_private_id id, const uint64_t* live, size_t n,
                            emmpool_error* error);
long emmpool_private_blocks(int device, emmpool_private_block* out, size_t n);

/* ---- every function above, named once ------------------------------------------------------ */

/* X(name) for each function of this interface, in the order above: the extension's table of
 * pointers, which it fills with dlsym, is this list expanded (cpp/torch/entry_points.hpp). A
 * function is added by its declaration above and its line here; the core defines it
 * (cpp/entry_points/c_api_torch.cpp), and tests/test_torch_hook.py checks that the list and the
 * declarations name the same functions. */
#define EMMPOOL_TORCH_FUNCTIONS(X)                                                                 \
  X(emmpool_torch_abi_version)                                                                     \
  X(emmpool_library_name)                                                                          \
  X(emmpool_torch_allocate)                                                                        \
  X(emmpool_torch_free)                                                                            \
  X(emmpool_torch_record_stream)                                                                   \
  X(emmpool_torch_block_size)                                                                      \
  X(emmpool_torch_stats_of)                                                                        \
  X(emmpool_torch_accumulated_of)                                                                  \
  X(emmpool_torch_reset_peaks)                                                                     \
  X(emmpool_torch_reset_accumulated)                                                               \
  X(emmpool_torch_trim)                                                                            \
  X(emmpool_torch_largest_block)                                                                   \
  X(emmpool_torch_ipc_handle)                                                                      \
  X(emmpool_torch_set_maximum)                                                                     \
  X(emmpool_torch_maximum)                                                                         \
  X(emmpool_torch_reserve_outside)                                                                 \
  X(emmpool_torch_layout)                                                                          \
  X(emmpool_ipc_share_pages)                                                                       \
  X(emmpool_ipc_service)                                                                           \
  X(emmpool_ipc_open_pages)                                                                        \
  X(emmpool_ipc_open_offer)                                                                        \
  X(emmpool_ipc_close)                                                                             \
  X(emmpool_torch_watch_segments)                                                                  \
  X(emmpool_torch_segment_events)                                                                  \
  X(emmpool_private_create_or_incref)                                                              \
  X(emmpool_private_use_count)                                                                     \
  X(emmpool_private_set_use_on_oom)                                                                \
  X(emmpool_private_set_no_split)                                                                  \
  X(emmpool_private_begin)                                                                         \
  X(emmpool_private_end)                                                                           \
  X(emmpool_private_release)                                                                       \
  X(emmpool_private_empty_cache)                                                                   \
  X(emmpool_private_take)                                                                          \
  X(emmpool_private_allocate)                                                                      \
  X(emmpool_private_adopt_foreign)                                                                 \
  X(emmpool_private_allocate_on_oom)                                                               \
  X(emmpool_private_record_stream)                                                                 \
  X(emmpool_private_free)                                                                          \
  X(emmpool_private_device_of)                                                                     \
  X(emmpool_private_returned_foreign)                                                              \
  X(emmpool_private_live_blocks_are)                                                               \
  X(emmpool_private_live_blocks)                                                                   \
  X(emmpool_private_restore)                                                                       \
  X(emmpool_private_blocks)

#ifdef __cplusplus
}
#endif

#endif /* EMMPOOL_TORCH_API_H */
