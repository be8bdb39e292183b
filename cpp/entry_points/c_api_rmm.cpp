// The C entry points of emmpool's native RMM resource (cpp/rmm/), as emmpool/rmm_api.h declares
// them: a table handed over once, then an allocation and a free per call of RMM's, tagged
// RMM's, with no Python on the way (the caller's GIL, where it holds one, is let go of while
// the pool waits: pool_calls.hpp).
#include "c_api.hpp"
#include "caller_lock.hpp"

#include <emmpool/registry.hpp>
#include <emmpool/rmm_api.h>

static_assert(EMMPOOL_RMM_OUT_OF_MEMORY == 0 && EMMPOOL_RMM_INVALID_ARGUMENT == 1 &&
                EMMPOOL_RMM_OTHER == 2,
              "rmm_api.h's failures are c_api::failure's kinds");

namespace {

using emmpool::stream_handle;

void* rmm_allocate(std::size_t size, int device, void* stream, int* failure, char* message,
                   std::size_t message_size)
{
  try {
    return reinterpret_cast<void*>(emmpool::c_api::allocate_from(
      size, device, reinterpret_cast<stream_handle>(stream), emmpool::alloc_tag::rmm));
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    auto const f = emmpool::c_api::current_failure();
    if (failure != nullptr) { *failure = f.kind; }
    emmpool::c_api::copy_message(message, message_size, f.what);
  }
  return nullptr;
}

void rmm_deallocate(void* ptr, int device, void* stream)
{
  // RMM's and CCCL's deallocate above are noexcept: nothing unwinds out of here, not even at
  // the interpreter's exit (caller_lock.hpp).
  emmpool::c_api::free_on(ptr, device, reinterpret_cast<stream_handle>(stream),
                          emmpool::alloc_tag::rmm);
}

int rmm_synchronize(int device, void* stream, char* message, std::size_t message_size)
{
  try {
    auto& drv = emmpool::pool_registry::instance().get_driver();
    auto const event = drv.create_event(device);
    try {
      drv.record_event(device, event, reinterpret_cast<stream_handle>(stream));
      emmpool::caller_lock::without_caller_lock([&] { drv.synchronize_event(device, event); });
    } catch (...) {
      drv.destroy_event(device, event);
      throw;
    }
    drv.destroy_event(device, event);
    return 0;
  }
  EMMPOOL_LET_THREAD_END
  catch (...) {
    emmpool::c_api::copy_message(message, message_size, emmpool::c_api::current_failure().what);
  }
  return -1;
}

constexpr emmpool_rmm_api table{EMMPOOL_RMM_ABI_VERSION, &rmm_allocate, &rmm_deallocate,
                                &rmm_synchronize};

}  // namespace

namespace emmpool::c_api {

emmpool_rmm_api const* rmm_api() noexcept { return &table; }

}  // namespace emmpool::c_api
