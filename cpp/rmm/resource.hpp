// emmpool's pool as an RMM memory resource, with no Python on the way: what RMM's C++ callers
// (libcudf, rmm::device_buffer, every resource_ref) allocate through once use_for_rmm() has
// made it a device's resource. Compiled on the user's machine against the installed RMM
// (emmpool._rmm: RMM's C++ symbols are versioned per release), in the one translation unit of
// the Cython module that gives it to Python (emmpool_rmm.pyx). It calls the core through the
// table of emmpool/rmm_api.h, taken from _core once when the resource is made.
//
// A resource is a device's: RMM keeps one per device and calls it with that device current, as
// RMM's own do. It is a value (the table and the device): copies compare equal, as RMM asks of
// a resource that resource_refs wrap and adaptors copy.
#pragma once

#include <emmpool/rmm_api.h>

#include <rmm/aligned.hpp>
#include <rmm/error.hpp>
#include <rmm/resource_ref.hpp>

#include <cuda/memory_resource>
#include <cuda/stream>

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>

namespace emmpool_rmm {

class resource {
 public:
  /// `api`: _core's table (checked here, so a resource from another emmpool build is refused
  /// before its first call); `device`: the CUDA ordinal whose pool it allocates from.
  resource(void const* api, int device)
    : api_{static_cast<emmpool_rmm_api const*>(api)}, device_{device}
  {
    if (api_ == nullptr || api_->abi != EMMPOOL_RMM_ABI_VERSION) {
      throw std::runtime_error{
        "emmpool: the native RMM resource and emmpool's _core come from different versions "
        "(ABI " + std::to_string(api_ == nullptr ? -1 : api_->abi) + ", the resource's " +
        std::to_string(EMMPOOL_RMM_ABI_VERSION) + "): reinstall emmpool (the build cache is "
        "keyed by the source)"};
    }
    if (device < 0) { throw std::invalid_argument{"emmpool: a device ordinal is never negative"}; }
  }

  [[nodiscard]] int device() const noexcept { return device_; }

  /// A block of `bytes`, in the order of `stream`. The pool's blocks are aligned to 256 bytes
  /// (rmm::CUDA_ALLOCATION_ALIGNMENT): a larger alignment is refused (RMM's own pools ignore
  /// it, handing out memory less aligned than asked), never given unmet.
  /// @throws rmm::out_of_memory (what RMM's failure-callback adaptor and callers catch),
  /// rmm::bad_alloc (another failure), rmm::logic_error (an alignment the pool cannot give)
  [[nodiscard]] void* allocate(cuda::stream_ref stream, std::size_t bytes,
                               std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT)
  {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 ||
        alignment > rmm::CUDA_ALLOCATION_ALIGNMENT) {
      throw rmm::logic_error{"emmpool: RMM asked for an alignment of " +
                             std::to_string(alignment) +
                             " bytes; emmpool's blocks are aligned to a power of two up to " +
                             std::to_string(rmm::CUDA_ALLOCATION_ALIGNMENT)};
    }
    if (bytes == 0) { return nullptr; }  // as cudaMalloc(0): nothing to free
    int failure = EMMPOOL_RMM_OTHER;
    char message[512];  // filled on failure only: not cleared on every allocation
    message[0] = '\0';
    void* p = api_->allocate(bytes, device_, stream.get(), &failure, message, sizeof message);
    if (p != nullptr) { return p; }
    if (failure == EMMPOOL_RMM_OUT_OF_MEMORY) { throw rmm::out_of_memory{message}; }
    throw rmm::bad_alloc{message};
  }

  /// `ptr` back to the pool, fenced on `stream`: handed out again once the work queued there so
  /// far is done (at once, on that stream).
  void deallocate(cuda::stream_ref stream, void* ptr, std::size_t /*bytes*/,
                  std::size_t /*alignment*/ = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept
  {
    if (ptr != nullptr) { api_->deallocate(ptr, device_, stream.get()); }
  }

  /// As RMM's stream-ordered resources: on the default stream, then that stream synchronized
  /// (through the core), so that the block is ready for any stream.
  [[nodiscard]] void* allocate_sync(std::size_t bytes,
                                    std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT)
  {
    auto const stream = cuda::stream_ref{cudaStream_t{}};
    void* p           = allocate(stream, bytes, alignment);
    char message[512] = {};
    if (p != nullptr && api_->synchronize(device_, stream.get(), message, sizeof message) != 0) {
      deallocate(stream, p, bytes, alignment);
      throw rmm::cuda_error{message};
    }
    return p;
  }

  /// On the default stream: the pool fences the block there, so no wait is needed for it to
  /// be safe to hand out again.
  void deallocate_sync(void* ptr, std::size_t bytes,
                       std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept
  {
    deallocate(cuda::stream_ref{cudaStream_t{}}, ptr, bytes, alignment);
  }

  [[nodiscard]] bool operator==(resource const& other) const noexcept
  {
    return api_ == other.api_ && device_ == other.device_;
  }
  [[nodiscard]] bool operator!=(resource const& other) const noexcept { return !(*this == other); }

  friend void get_property(resource const&, cuda::mr::device_accessible) noexcept {}

 private:
  emmpool_rmm_api const* api_;
  int device_;
};

static_assert(cuda::mr::resource_with<resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::synchronous_resource_with<resource, cuda::mr::device_accessible>);

}  // namespace emmpool_rmm
