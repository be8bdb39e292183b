// The C entry points of emmpool's PyTorch extension (cpp/torch/), as emmpool/torch_api.h
// declares them: what PyTorch's CUDAAllocator interface asks of an allocator (statistics,
// record_stream, IPC, the cache's largest block, empty_cache, the cap of
// set_per_process_memory_fraction, the blocks and segment events of a memory snapshot and
// history) and PyTorch's private pools (emmpool/private_pools.hpp). Each translates between
// the header's C records and the core's types, and follows the entry points' rule through one
// helper, guarded(): no exception crosses the boundary, and the caller's GIL is let go of while
// a pool's lock or the GPU may be waited for (pool_calls.hpp, caller_lock.hpp).
#include "c_api.hpp"
#include "caller_lock.hpp"
#include "torch_accumulated.hpp"

#include <emmpool/pool_controls.hpp>
#include <emmpool/pool_observers.hpp>
#include <emmpool/pool_queries.hpp>
#include <emmpool/pool_sharing.hpp>
#include <emmpool/registry.hpp>
#include <emmpool/torch_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

// The header's enums and constants are the core's, value for value.
static_assert(EMMPOOL_BLOCK_ALIGNMENT == emmpool::block_alignment);
static_assert(EMMPOOL_LIBRARIES == emmpool::alloc_tag_count);
static_assert(EMMPOOL_LIBRARY_TORCH == static_cast<int>(emmpool::alloc_tag::torch));
static_assert(EMMPOOL_LIBRARY_CUDA_CORE == static_cast<int>(emmpool::alloc_tag::cuda_core));
static_assert(EMMPOOL_BLOCK_WAITING == static_cast<int>(emmpool::block_status::waiting));
static_assert(EMMPOOL_SEGMENT_GROWABLE == static_cast<int>(emmpool::segment_type::growable));
static_assert(EMMPOOL_SEGMENT_UNMAPPED ==
              static_cast<int>(emmpool::segment_event::kind::unmapped));

namespace {

using emmpool::caller_lock::without_caller_lock;
using emmpool::device_ptr;
using emmpool::stream_handle;

emmpool::pool_registry& registry() { return emmpool::pool_registry::instance(); }

// Inside a catch block: the exception being handled, into the caller's error record.
void report(emmpool_error* error) noexcept
{
  if (error == nullptr) { return; }
  auto const f = emmpool::c_api::current_failure();
  error->kind  = f.kind;
  emmpool::c_api::copy_message(error->message, sizeof error->message, f.what);
}

void say(emmpool_error* error, emmpool_failure kind, char const* what) noexcept
{
  if (error == nullptr) { return; }
  error->kind = kind;
  emmpool::c_api::copy_message(error->message, sizeof error->message, what);
}

// The pool of a device only if it exists already: statistics, peaks and empty_cache must not
// create pools (and with them CUDA contexts, initial reservations) on devices the program never
// used, as torch.cuda.empty_cache() asks of every device.
emmpool::device_pool* existing_pool_of(int device)
{
  for (auto* p : registry().pools()) {
    if (p->device() == device) { return p; }
  }
  return nullptr;
}

// Whether an entry point may wait for a pool's lock or the GPU: then the caller's lock (the
// GIL) is let go of meanwhile. One that allocates from a device pool says no: pool_calls.hpp
// lets go of it there itself, and takes it back to ask the out-of-memory hook, which a
// thread's end at interpreter exit may interrupt (caller_lock.hpp).
enum class waits : bool { no, yes };

// The rule every entry point below follows, written once: body()'s result, or `failed` if it
// threw, what it threw said in `error` (which may be null). No exception leaves but a thread's
// end, which must pass: not noexcept.
template <class Result, class Body>
Result guarded(waits wait, Result failed, emmpool_error* error, Body&& body)
{
  auto run = [&]() -> Result {
    try {
      return body();
    }
    EMMPOOL_LET_THREAD_END
    catch (...) {
      report(error);
    }
    return failed;
  };
  return wait == waits::yes ? without_caller_lock(run) : run();
}

// guarded(), for an entry point that answers nothing: a failure is dropped.
template <class Body>
void guarded(waits wait, Body&& body)
{
  (void)guarded(wait, false, nullptr, [&] {
    body();
    return true;
  });
}

emmpool::private_pool_id id_of(emmpool_private_id id) noexcept { return {id.first, id.second}; }

emmpool_private_block record_of(emmpool::private_block const& b) noexcept
{
  emmpool_private_block r{};
  r.ptr     = b.ptr;
  r.size    = b.size;
  r.stream  = b.stream;
  r.pool    = {b.pool.first, b.pool.second};
  r.device  = b.device;
  r.live    = b.live ? 1 : 0;
  r.foreign = b.foreign ? 1 : 0;
  return r;
}

// PyTorch's view of a device pool (emmpool/torch_api.h says what each field counts): its
// statistics now, and its counts since it began, of which torch_accumulated keeps the baseline.
struct torch_view {
  emmpool_torch_stats now;
  emmpool_torch_accumulated ever;
};

torch_view view_of(emmpool::device_pool& pool)
{
  auto const s      = pool.stats();
  auto const cached = registry().privates().totals(pool.device());
  auto const torch  = static_cast<std::size_t>(emmpool::alloc_tag::torch);
  auto const handed = emmpool::torch_accumulated::handed_on(pool.device());
  auto const less   = [](std::uint64_t a, std::uint64_t b) { return a > b ? a - b : 0; };
  // The free blocks private pools keep leave PyTorch's bytes and blocks in use for its frees;
  // the live blocks of pools' own allocators are PyTorch's in use too.
  std::uint64_t const in_use =
    less(s.bytes_in_use_by_tag[torch], cached.cached_bytes) + cached.foreign_live_bytes;
  std::uint64_t const cached_blocks = std::min<std::uint64_t>(s.blocks_in_use,
                                                              cached.cached_blocks);
  std::uint64_t const reserved      = s.bytes_reserved + cached.foreign_bytes;
  torch_view v{};
  v.now.allocated_bytes      = in_use;
  v.now.peak_allocated_bytes = std::max<std::uint64_t>(s.peak_bytes_in_use, in_use);
  v.now.reserved_bytes       = reserved;
  v.now.peak_reserved_bytes  = std::max<std::uint64_t>(s.peak_bytes_reserved, reserved);
  v.now.inactive_bytes       = less(s.bytes_reserved, s.bytes_in_use);
  v.now.blocks_in_use        = s.blocks_in_use - cached_blocks + cached.foreign_live_blocks;
  v.now.segments             = s.segments;
  // What was freed is what was handed out, less what is still in use.
  v.ever.allocated_bytes       = handed.bytes;
  v.ever.freed_bytes           = less(handed.bytes, in_use);
  v.ever.requested_bytes       = handed.requested;
  v.ever.requested_freed_bytes = less(handed.requested, in_use);
  v.ever.allocations           = s.allocations_by_tag[torch];
  v.ever.frees                 = s.frees + cached_blocks;
  v.ever.segment_allocations   = s.segment_allocations;
  v.ever.segment_releases      = s.segment_releases;
  v.ever.out_of_memory         = s.out_of_memory;
  v.ever.dormant_fences        = s.dormant_fences;
  return v;
}

// A block of `bytes` handed to PyTorch for a request of `requested`: counted
// (torch_accumulated) and passed on. A new block is as the pool rounds the request; a cached
// private one may be larger.
void* handed_to_torch(void* p, std::size_t requested, int device, std::size_t bytes) noexcept
{
  if (p != nullptr) { emmpool::torch_accumulated::count(device, requested, bytes); }
  return p;
}

void* handed_to_torch(void* p, std::size_t requested, int device) noexcept
{
  return handed_to_torch(p, requested, device, emmpool::block_bytes(requested));
}

// A private pool's cached block handed out again, if there was one: all its bytes counted.
void* handed_to_torch(std::optional<emmpool::private_pools::taken> const& t,
                      std::size_t requested, int device) noexcept
{
  return t ? handed_to_torch(reinterpret_cast<void*>(t->ptr), requested, device, t->size)
           : nullptr;
}

template <class T, class Row, class F>
long fill(std::vector<T> const& items, Row* out, std::size_t n, F&& row_of) noexcept
{
  for (std::size_t i = 0; i < items.size() && i < n && out != nullptr; ++i) {
    out[i] = row_of(items[i]);
  }
  return static_cast<long>(items.size());
}

}  // namespace

// ---- the device pools -----------------------------------------------------------------------

EMMPOOL_C_API int emmpool_torch_abi_version() { return EMMPOOL_TORCH_ABI_VERSION; }

EMMPOOL_C_API char const* emmpool_library_name(int library)
{
  if (library < 0 || library >= EMMPOOL_LIBRARIES) { return nullptr; }
  return emmpool::alloc_tag_names[library];
}

EMMPOOL_C_API void* emmpool_torch_allocate(std::size_t size, int device, void* stream,
                                           emmpool_error* error)
{
  return guarded<void*>(waits::no, nullptr, error, [&] {
    auto const p = emmpool::c_api::allocate_from(
      size, device, reinterpret_cast<stream_handle>(stream), emmpool::alloc_tag::torch);
    return handed_to_torch(reinterpret_cast<void*>(p), size, device);
  });
}

EMMPOOL_C_API int emmpool_torch_record_stream(void* ptr, int device, void* stream,
                                              emmpool_error* error)
{
  return guarded(waits::yes, -1, error, [&] {
    registry().pool(device).record_stream(reinterpret_cast<device_ptr>(ptr),
                                          reinterpret_cast<stream_handle>(stream));
    return 0;
  });
}

EMMPOOL_C_API std::size_t emmpool_torch_block_size(void* ptr, int device)
{
  return guarded(waits::yes, std::size_t{0}, nullptr, [&]() -> std::size_t {
    auto const p = reinterpret_cast<device_ptr>(ptr);
    if (auto* pool = existing_pool_of(device)) {
      auto const extent = emmpool::pool_queries{*pool}.live_extent(p);
      if (extent && extent->first == p) { return extent->second; }
    }
    // Else a block of a MemPool's own allocator, which only the private pools know.
    for (auto const& b : registry().privates().blocks_of(device)) {
      if (b.ptr == p) { return b.size; }
    }
    return 0;
  });
}

EMMPOOL_C_API int emmpool_torch_stats_of(int device, emmpool_torch_stats* out)
{
  return guarded(waits::yes, -1, nullptr, [&] {
    auto* pool = existing_pool_of(device);
    if (pool == nullptr || out == nullptr) { return -1; }
    *out = view_of(*pool).now;
    return 0;
  });
}

EMMPOOL_C_API int emmpool_torch_accumulated_of(int device, emmpool_torch_accumulated* out)
{
  return guarded(waits::yes, -1, nullptr, [&] {
    auto* pool = existing_pool_of(device);
    if (pool == nullptr || out == nullptr) { return -1; }
    *out = emmpool::torch_accumulated::since_reset(device, view_of(*pool).ever);
    return 0;
  });
}

EMMPOOL_C_API void emmpool_torch_reset_peaks(int device)
{
  guarded(waits::yes, [&] {
    if (auto* pool = existing_pool_of(device)) { emmpool::pool_controls{*pool}.reset_peaks(); }
  });
}

EMMPOOL_C_API void emmpool_torch_reset_accumulated(int device)
{
  guarded(waits::yes, [&] {
    if (auto* pool = existing_pool_of(device)) {
      emmpool::torch_accumulated::reset(device, view_of(*pool).ever);
    }
  });
}

EMMPOOL_C_API std::size_t emmpool_torch_trim(int device)
{
  return guarded(waits::yes, std::size_t{0}, nullptr, [&]() -> std::size_t {
    auto* pool = existing_pool_of(device);
    return pool != nullptr ? pool->trim() : 0;
  });
}

EMMPOOL_C_API std::size_t emmpool_torch_largest_block(int device)
{
  return guarded(waits::yes, std::size_t{0}, nullptr, [&] {
    auto& pool     = registry().pool(device);
    auto const s   = pool.stats();
    auto const mi  = registry().get_driver().memory_info_of(device);
    auto const cap = emmpool::pool_controls{pool}.maximum_size();
    std::size_t const headroom = cap > s.bytes_reserved ? cap - s.bytes_reserved : 0;
    return std::max(s.largest_free_block, std::min(mi.free, headroom));
  });
}

EMMPOOL_C_API int emmpool_torch_ipc_handle(void* ptr, int device, unsigned char* handle,
                                           std::size_t* offset, emmpool_error* error)
{
  return guarded(waits::yes, -1, error, [&] {
    auto const info = emmpool::pool_sharing{registry().pool(device)}.ipc_handle(
      reinterpret_cast<device_ptr>(ptr));
    if (!info) {
      say(error, EMMPOOL_FAILED_INVALID_ARGUMENT, "the pointer is not a block of emmpool's pool");
      return -1;
    }
    std::memcpy(handle, info->handle.data(), info->handle.size());
    *offset = info->offset;
    return 0;
  });
}

EMMPOOL_C_API int emmpool_torch_set_maximum(int device, std::size_t bytes, emmpool_error* error)
{
  return guarded(waits::yes, -1, error, [&] {
    emmpool::pool_controls{registry().pool(device)}.set_maximum_size(bytes);
    return 0;
  });
}

EMMPOOL_C_API std::size_t emmpool_torch_maximum(int device)
{
  std::size_t const none = std::numeric_limits<std::size_t>::max();
  return guarded(waits::yes, none, nullptr, [&] {
    auto* pool = existing_pool_of(device);
    return pool != nullptr ? emmpool::pool_controls{*pool}.maximum_size() : none;
  });
}

EMMPOOL_C_API int emmpool_torch_reserve_outside(int device, long long delta, emmpool_error* error)
{
  return guarded(waits::yes, -1, error, [&] {
    emmpool::pool_controls controls{registry().pool(device)};
    return controls.reserve_outside(static_cast<std::ptrdiff_t>(delta)) ? 0 : 1;
  });
}

EMMPOOL_C_API long emmpool_torch_layout(int device, emmpool_layout_row* out, std::size_t n)
{
  return guarded(waits::yes, -1L, nullptr, [&]() -> long {
    auto* pool = existing_pool_of(device);
    if (pool == nullptr) { return -1; }
    return fill(emmpool::pool_queries{*pool}.layout(), out, n, [](emmpool::layout_block const& b) {
      emmpool_layout_row r{};
      r.segment      = b.segment;
      r.segment_size = b.segment_size;
      r.ptr          = b.ptr;
      r.size         = b.size;
      r.stream       = b.stream;
      r.state        = static_cast<std::uint8_t>(b.state);
      r.library      = b.tag;
      r.kind         = static_cast<std::uint8_t>(b.kind);
      return r;
    });
  });
}

EMMPOOL_C_API int emmpool_ipc_share_pages(void* ptr, int device, emmpool_shared_pages* out,
                                           std::int32_t* fds, std::size_t n, emmpool_error* error)
{
  return guarded(waits::yes, -1, error, [&] {
    auto const shared = emmpool::pool_sharing{registry().pool(device)}.share_pages(
      reinterpret_cast<device_ptr>(ptr));
    if (!shared) { return 1; }
    *out = emmpool_shared_pages{shared->first_page, shared->page_size, shared->offset,
                                shared->block_size, shared->fds.size(), {}};
    std::memcpy(out->key, shared->key.data(), sizeof out->key);
    for (std::size_t i = 0; i < shared->fds.size() && i < n && fds != nullptr; ++i) {
      fds[i] = shared->fds[i];
    }
    return 0;
  });
}

EMMPOOL_C_API void* emmpool_ipc_open_pages(int device, std::int32_t const* fds, std::size_t n,
                                           std::uint64_t page_size, emmpool_error* error)
{
  return guarded<void*>(waits::yes, nullptr, error, [&] {
    std::vector<int> const list(fds, fds + n);
    return reinterpret_cast<void*>(registry().imports().open_pages(device, list, page_size));
  });
}

EMMPOOL_C_API long emmpool_ipc_service(char* address, std::size_t n, emmpool_error* error)
{
  return guarded(waits::yes, -1L, error, [&] {
    auto const name = registry().service().address();
    std::memcpy(address, name.data(), std::min(n, name.size()));
    return static_cast<long>(name.size());
  });
}

EMMPOOL_C_API void* emmpool_ipc_open_offer(int device, char const* address,
                                           std::size_t address_size, unsigned char const* key,
                                           int sender_device, std::uint64_t first_page,
                                           std::uint64_t page_size, std::int32_t const* fds,
                                           std::size_t n, emmpool_error* error)
{
  return guarded<void*>(waits::yes, nullptr, error, [&] {
    emmpool::page_offer offer;
    offer.address.assign(address, address_size);
    std::memcpy(offer.key.data(), key, offer.key.size());
    offer.device     = sender_device;
    offer.first_page = first_page;
    offer.page_size  = page_size;
    offer.fds.assign(fds, fds + n);
    return reinterpret_cast<void*>(registry().imports().open_offer(device, offer));
  });
}

EMMPOOL_C_API void emmpool_ipc_close(void* base)
{
  guarded(waits::yes, [&] { registry().imports().close(reinterpret_cast<device_ptr>(base)); });
}

EMMPOOL_C_API void emmpool_torch_watch_segments(int on)
{
  guarded(waits::yes, [&] { registry().set_segment_events(on != 0); });
}

EMMPOOL_C_API long emmpool_torch_segment_events(int device, emmpool_segment_event* out,
                                                std::size_t n)
{
  return guarded(waits::yes, -1L, nullptr, [&]() -> long {
    auto* pool = existing_pool_of(device);
    if (pool == nullptr) { return -1; }
    auto const events = emmpool::pool_observers{*pool}.take_segment_events(out == nullptr ? 0 : n);
    return fill(events, out, n, [](emmpool::segment_event const& e) {
      emmpool_segment_event r{};
      r.address = e.address;
      r.size    = e.size;
      r.action  = static_cast<std::uint8_t>(e.what);
      r.kind    = static_cast<std::uint8_t>(e.type);
      r.library = e.tag;
      return r;
    });
  });
}

// ---- private pools --------------------------------------------------------------------------

// Those that may give blocks back to a device pool (end, release, empty_cache, free) do so
// after a device synchronization: they wait.

EMMPOOL_C_API void emmpool_private_create_or_incref(int device, emmpool_private_id id)
{
  guarded(waits::no, [&] { registry().privates().create_or_incref(device, id_of(id)); });
}

EMMPOOL_C_API int emmpool_private_use_count(emmpool_private_id id)
{
  return guarded(waits::no, 0, nullptr, [&] { return registry().privates().use_count(id_of(id)); });
}

EMMPOOL_C_API int emmpool_private_set_use_on_oom(emmpool_private_id id, int on,
                                                 emmpool_error* error)
{
  return guarded(waits::no, -1, error, [&] {
    registry().privates().set_use_on_oom(id_of(id), on != 0);
    return 0;
  });
}

EMMPOOL_C_API int emmpool_private_set_no_split(emmpool_private_id id, emmpool_error* error)
{
  return guarded(waits::no, -1, error, [&] {
    registry().privates().set_no_split(id_of(id));
    return 0;
  });
}

EMMPOOL_C_API int emmpool_private_begin(int device, emmpool_private_id id, emmpool_error* error)
{
  return guarded(waits::yes, -1, error, [&] {
    registry().privates().begin(device, id_of(id));
    return 0;
  });
}

EMMPOOL_C_API void emmpool_private_end(int device, emmpool_private_id id)
{
  guarded(waits::yes, [&] { registry().privates().end(device, id_of(id)); });
}

EMMPOOL_C_API void emmpool_private_release(emmpool_private_id id)
{
  guarded(waits::yes, [&] { registry().privates().release(id_of(id)); });
}

EMMPOOL_C_API void emmpool_private_empty_cache(emmpool_private_id id)
{
  guarded(waits::yes, [&] { registry().privates().empty_cache(id_of(id)); });
}

EMMPOOL_C_API void* emmpool_private_take(emmpool_private_id id, std::size_t size, int device,
                                         void* stream)
{
  return guarded<void*>(waits::no, nullptr, nullptr, [&]() -> void* {
    return handed_to_torch(
      registry().privates().take(id_of(id), size, reinterpret_cast<stream_handle>(stream)), size,
      device);
  });
}

EMMPOOL_C_API void* emmpool_private_allocate(emmpool_private_id id, std::size_t size, int device,
                                             void* stream, emmpool_error* error)
{
  return guarded<void*>(waits::no, nullptr, error, [&] {
    auto& privates = registry().privates();
    auto const s   = reinterpret_cast<stream_handle>(stream);
    if (auto const p = privates.take(id_of(id), size, s)) {
      return handed_to_torch(p, size, device);
    }
    // A new block of the device's pool, by the entry points' rule (the out-of-memory hook
    // included). No stream is named: nothing is recorded on a capturing stream.
    auto const p = emmpool::c_api::allocate_from(size, device, emmpool::legacy_stream,
                                                 emmpool::alloc_tag::torch);
    try {
      privates.adopt(id_of(id), p, size, device, s, false);
    } catch (...) {
      emmpool::c_api::free_on(reinterpret_cast<void*>(p), device, emmpool::allocation_stream,
                              emmpool::alloc_tag::torch);
      throw;
    }
    return handed_to_torch(reinterpret_cast<void*>(p), size, device);
  });
}

EMMPOOL_C_API int emmpool_private_adopt_foreign(emmpool_private_id id, void* ptr, std::size_t size,
                                                int device, void* stream, emmpool_error* error)
{
  return guarded(waits::no, -1, error, [&] {
    registry().privates().adopt(id_of(id), reinterpret_cast<device_ptr>(ptr), size, device,
                                reinterpret_cast<stream_handle>(stream), true);
    (void)handed_to_torch(ptr, size, device, size);  // the pool's own allocator's bytes
    return 0;
  });
}

EMMPOOL_C_API void* emmpool_private_allocate_on_oom(std::size_t size, int device, void* stream)
{
  return guarded<void*>(waits::no, nullptr, nullptr, [&]() -> void* {
    return handed_to_torch(
      registry().privates().take_on_oom(size, device, reinterpret_cast<stream_handle>(stream)),
      size, device);
  });
}

EMMPOOL_C_API void emmpool_private_record_stream(void* ptr)
{
  guarded(waits::no,
          [&] { registry().privates().record_stream(reinterpret_cast<device_ptr>(ptr)); });
}

EMMPOOL_C_API void emmpool_private_free(void* ptr)
{
  guarded(waits::yes, [&] { registry().privates().free(reinterpret_cast<device_ptr>(ptr)); });
}

EMMPOOL_C_API int emmpool_private_device_of(void* ptr)
{
  return guarded(waits::no, -1, nullptr, [&] {
    auto& privates = registry().privates();
    if (!privates.owns(reinterpret_cast<device_ptr>(ptr))) { return -1; }
    return privates.device_of(reinterpret_cast<device_ptr>(ptr)).value_or(-1);
  });
}

EMMPOOL_C_API long emmpool_private_returned_foreign(emmpool_private_block* out, std::size_t n)
{
  return guarded(waits::no, 0L, nullptr, [&] {
    return fill(registry().privates().take_returned_foreign(out == nullptr ? 0 : n), out, n,
                record_of);
  });
}

EMMPOOL_C_API int emmpool_private_live_blocks_are(emmpool_private_id id, std::uint64_t const* ptrs,
                                                  std::size_t n)
{
  return guarded(waits::no, 0, nullptr, [&] {
    std::vector<device_ptr> const expected(ptrs, ptrs + n);
    return registry().privates().live_blocks_are(id_of(id), expected) ? 1 : 0;
  });
}

EMMPOOL_C_API long emmpool_private_live_blocks(emmpool_private_id id, std::uint64_t* out,
                                               std::size_t n)
{
  return guarded(waits::no, -1L, nullptr, [&] {
    return fill(registry().privates().live_blocks(id_of(id)), out, n,
                [](device_ptr p) { return static_cast<std::uint64_t>(p); });
  });
}

EMMPOOL_C_API int emmpool_private_restore(emmpool_private_id id, std::uint64_t const* live,
                                          std::size_t n, emmpool_error* error)
{
  return guarded(waits::no, -1, error, [&] {
    registry().privates().restore(id_of(id), std::vector<device_ptr>(live, live + n));
    return 0;
  });
}

EMMPOOL_C_API long emmpool_private_blocks(int device, emmpool_private_block* out, std::size_t n)
{
  return guarded(waits::no, -1L, nullptr, [&] {
    return fill(registry().privates().blocks_of(device), out, n, record_of);
  });
}
