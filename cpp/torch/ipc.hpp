// CUDA tensors across processes (torch.multiprocessing) in PyTorch's own handle format, so that
// a process on emmpool and one on PyTorch's allocator exchange tensors either way. Part of the
// one translation unit allocator.cpp.
//
// PyTorch's format (c10/cuda/CUDACachingAllocator.cpp, shareIpcHandle; 2.9 to 2.11): a version
// byte (2) and a type byte, then
//   'c'  a cudaMalloc'd block: the 64-byte cudaIpcMemHandle_t of its segment (a bare 64-byte
//        handle, the older form, is one too);
//   'e'  a block of an expandable segment: a header {int32 pid, 4 bytes of padding, uint64
//        page size, uint64 page count} and one int32 per page: the sending process's file
//        descriptor of that page (cuMemExportToShareableHandle), which the receiver copies with
//        pidfd_open + pidfd_getfd and imports.
// emmpool's growable blocks are sent as 'e' (their pages, emmpool_ipc_share_pages, keep their
// descriptors open while the block lives: PyTorch's protocol keeps the sender's block alive
// until every receiver let go of it), followed by emmpool's trailer (share_trailer below:
// where the sender's IPC service listens, the block's key, the sender's device and first page).
// PyTorch's own reader stops after the descriptors, so a receiver on PyTorch's allocator reads
// the handle as its own. An emmpool receiver that finds the trailer asks the sender's service
// for the pages' descriptors (emmpool_ipc_open_offer: a Unix socket, no ptrace rights over the
// sender needed, which pidfd_getfd needs and Yama's ptrace_scope=1 or a container may deny);
// without it (a sender on PyTorch's expandable segments) it copies them with pidfd_getfd.
// Fixed blocks go as bare 64-byte handles. Both kinds are opened once per process and closed
// when the last tensor over them dies.
#pragma once

#include "entry_points.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr char handle_version = 2;
constexpr char cuda_malloc_handle = 'c';
constexpr char expandable_handle  = 'e';

// PyTorch's ShareHeader, as it lies in the string.
struct share_header {
  std::int32_t pid;
  std::int32_t padding;  // zero (PyTorch 2.9 left it unset: never read)
  std::uint64_t page_size;
  std::uint64_t pages;
};
static_assert(sizeof(share_header) == 24, "PyTorch's ShareHeader");

// emmpool's trailer after an 'e' handle's descriptors, then `address_size` bytes: the sender's
// IPC service address.
struct share_trailer {
  char magic[8];
  std::int32_t device;          // the sender's
  std::uint32_t address_size;
  std::uint64_t first_page;     // in the sender
  unsigned char key[16];        // the block's (emmpool_shared_pages)
};
static_assert(sizeof(share_trailer) == 40, "emmpool's share trailer");
constexpr char trailer_magic[8] = {'E', 'M', 'M', 'P', 'O', 'O', 'L', '2'};

// This process's IPC service's address, asked once.
std::string const& this_service()
{
  static std::string const address = [] {
    std::string out(128, '\0');
    emmpool_error error{};
    auto n = api.emmpool_ipc_service(out.data(), out.size(), &error);
    if (n > static_cast<long>(out.size())) {
      out.resize(static_cast<std::size_t>(n));
      n = api.emmpool_ipc_service(out.data(), out.size(), &error);
    }
    if (n < 0) { raise(std::string{"emmpool: cannot share this CUDA tensor: "} + error.message); }
    out.resize(static_cast<std::size_t>(n));
    return out;
  }();
  return address;
}

// The handle of the block at ptr on the current device, and ptr's offset from what it maps.
cca::ShareableHandle share_block(void* ptr)
{
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  emmpool_error error{};
  emmpool_shared_pages pages{};
  std::vector<std::int32_t> fds(8);
  int r = api.emmpool_ipc_share_pages(ptr, device, &pages, fds.data(), fds.size(), &error);
  if (r == 0 && pages.pages > fds.size()) {
    fds.resize(pages.pages);
    r = api.emmpool_ipc_share_pages(ptr, device, &pages, fds.data(), fds.size(), &error);
  }
  if (r < 0) { raise(std::string{"emmpool: cannot share this CUDA tensor: "} + error.message); }
  if (r == 0) {  // a growable block: its pages
    share_header const header{static_cast<std::int32_t>(::getpid()), 0, pages.page_size,
                               pages.pages};
    auto const& service = this_service();
    share_trailer trailer{};
    std::memcpy(trailer.magic, trailer_magic, sizeof trailer.magic);
    trailer.device       = device;
    trailer.address_size = static_cast<std::uint32_t>(service.size());
    trailer.first_page   = pages.first_page;
    std::memcpy(trailer.key, pages.key, sizeof trailer.key);
    std::string out;
    out.push_back(handle_version);
    out.push_back(expandable_handle);
    out.append(reinterpret_cast<char const*>(&header), sizeof header);
    out.append(reinterpret_cast<char const*>(fds.data()), sizeof(std::int32_t) * pages.pages);
    out.append(reinterpret_cast<char const*>(&trailer), sizeof trailer);
    out.append(service);
    return {static_cast<std::ptrdiff_t>(pages.offset), out};
  }
  unsigned char handle[CUDA_IPC_HANDLE_SIZE];  // a fixed segment's legacy handle
  std::size_t offset = 0;
  if (api.emmpool_torch_ipc_handle(ptr, device, handle, &offset, &error) != 0) {
    raise(std::string{"emmpool: cannot share this CUDA tensor: "} + error.message);
  }
  return {static_cast<std::ptrdiff_t>(offset),
          std::string(reinterpret_cast<char const*>(handle), CUDA_IPC_HANDLE_SIZE)};
}

// The sending process's descriptors, as this process's own (pidfd_getfd: the kernel's ptrace
// rule over the sender applies). Raises saying why not.
std::vector<int> take_descriptors(share_header const& header, char const* fds)
{
  auto const pidfd = static_cast<int>(::syscall(SYS_pidfd_open, header.pid, 0));
  if (pidfd < 0) {
    raise("emmpool: cannot receive this CUDA tensor's pages from process " +
          std::to_string(header.pid) + " (pidfd_open: " + std::strerror(errno) +
          "); the sender may use fixed segments instead (EMMPOOL_SEGMENTS=fixed, or PyTorch's "
          "expandable_segments:False)");
  }
  std::vector<int> mine;
  for (std::uint64_t i = 0; i < header.pages; ++i) {
    std::int32_t theirs = 0;
    std::memcpy(&theirs, fds + i * sizeof theirs, sizeof theirs);
    auto const fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, theirs, 0));
    if (fd < 0) {
      auto const why = std::string{std::strerror(errno)};
      for (int m : mine) { ::close(m); }
      ::close(pidfd);
      raise("emmpool: cannot receive this CUDA tensor's pages from process " +
            std::to_string(header.pid) + " (pidfd_getfd: " + why +
            ": copying another process's descriptors needs ptrace rights over it, which "
            "kernel.yama.ptrace_scope or a container may deny); the sender may use fixed "
            "segments instead (EMMPOOL_SEGMENTS=fixed, or PyTorch's expandable_segments:False)");
    }
    mine.push_back(fd);
  }
  ::close(pidfd);
  return mine;
}

// Handles opened from other processes, each opened once per process (CUDA requires it for
// legacy handles) and closed when the last tensor over it dies.
class opened_handles {
 public:
  std::shared_ptr<void> open(std::string const& handle)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = opened_.find(handle);
    if (it != opened_.end()) {
      if (auto sp = it->second.lock()) { return sp; }
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    bool const pages = handle.size() >= 2 && handle[1] == expandable_handle &&
                       handle.size() != CUDA_IPC_HANDLE_SIZE;
    auto sp = pages ? open_pages(handle, device) : open_cuda_malloc(handle, device);
    opened_[handle] = sp;
    return sp;
  }

 private:
  std::shared_ptr<void> open_pages(std::string const& handle, c10::DeviceIndex device)
  {
    TORCH_CHECK(handle[0] <= handle_version,
                "emmpool: this CUDA tensor was shared by a newer PyTorch than this one");
    TORCH_CHECK(handle.size() >= 2 + sizeof(share_header), "emmpool: ill-formed CUDA IPC handle");
    share_header header{};
    std::memcpy(&header, handle.data() + 2, sizeof header);
    auto const body    = handle.size() - 2 - sizeof header;  // descriptors, and a trailer
    auto const* pages  = handle.data() + 2 + sizeof header;
    auto const fds_end = header.pages <= body / sizeof(std::int32_t)
                           ? header.pages * sizeof(std::int32_t)
                           : body + 1;
    share_trailer trailer{};
    if (header.pages > 0 && fds_end <= body && body - fds_end >= sizeof trailer) {
      std::memcpy(&trailer, pages + fds_end, sizeof trailer);
    }
    bool const offered = std::memcmp(trailer.magic, trailer_magic, sizeof trailer.magic) == 0 &&
                         body - fds_end - sizeof trailer == trailer.address_size;
    TORCH_CHECK(header.pages > 0 && (offered || fds_end == body),
                "emmpool: this CUDA tensor's pages were shared as fabric handles (PyTorch's "
                "CU_MEM_HANDLE_TYPE_FABRIC), which emmpool does not import");
    emmpool_error error{};
    void* base = nullptr;
    if (offered) {
      // An emmpool sender: its service hands the descriptors over a socket.
      std::vector<std::int32_t> theirs(header.pages);
      std::memcpy(theirs.data(), pages, fds_end);
      base = api.emmpool_ipc_open_offer(device, pages + fds_end + sizeof trailer,
                                        trailer.address_size, trailer.key, trailer.device,
                                        trailer.first_page, header.page_size, theirs.data(),
                                        theirs.size(), &error);
    } else {
      auto fds = take_descriptors(header, pages);  // PyTorch's own expandable segments
      base = api.emmpool_ipc_open_pages(device, fds.data(), fds.size(), header.page_size,
                                        &error);
      for (int fd : fds) { ::close(fd); }  // imported: the driver holds the memory now
    }
    if (base == nullptr) {
      raise(std::string{"emmpool: cannot map this CUDA tensor's pages: "} + error.message);
    }
    return std::shared_ptr<void>(base, [this, handle](void* q) {
      forget(handle);
      api.emmpool_ipc_close(q);  // synchronizes the device, then unmaps: never throws
    });
  }

  std::shared_ptr<void> open_cuda_malloc(std::string const& handle, c10::DeviceIndex device)
  {
    char const* bytes = handle.data();
    if (handle.size() != CUDA_IPC_HANDLE_SIZE) {  // PyTorch's versioned form
      TORCH_CHECK(handle.size() == 2 + CUDA_IPC_HANDLE_SIZE && handle[1] == cuda_malloc_handle,
                  "emmpool: ill-formed CUDA IPC handle");
      bytes += 2;
    }
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, bytes, CUDA_IPC_HANDLE_SIZE);
    void* p = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    return std::shared_ptr<void>(p, [this, handle, device](void* q) {
      forget(handle);
      try {  // a shared_ptr's deleter: never throw (CUDAGuard may, at exit)
        c10::cuda::CUDAGuard guard{device};
        C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(q));
      } catch (...) {
      }
    });
  }

  void forget(std::string const& handle)
  {
    std::lock_guard<std::mutex> lock{mutex_};
    auto it = opened_.find(handle);
    if (it != opened_.end() && it->second.expired()) { opened_.erase(it); }
  }

  std::mutex mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;
};

}  // namespace
