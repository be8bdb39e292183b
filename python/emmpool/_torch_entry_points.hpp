// emmpool's C entry points as the PyTorch extension sees them (found with dlsym in _core's
// library: cpp/edges/c_api.cpp, cpp/edges/c_api_torch.cpp), the DataPtr context that carries a
// block's device, and the allocation that raises PyTorch's errors. Part of the one translation
// unit _torch_allocator.cpp (included once, hence the unnamed namespace).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>
#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

// The CUDAAllocator interface changes between PyTorch releases; what differs is guarded by this.
#define EMMPOOL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::cuda::MempoolId_t;

constexpr int expected_abi = 3;
constexpr std::uintptr_t device_bits  = 0x3f;  // device index, < 64 (emmpool's registry)
constexpr std::uintptr_t private_bit  = 0x80;  // a block of a graph / MemPool private pool
constexpr std::uintptr_t context_bits = 0xff;
constexpr std::size_t error_length    = 512;
void* const no_stream = reinterpret_cast<void*>(std::uintptr_t{1});  // emmpool's legacy_stream

// emmpool's C entry points, found in _core's shared library.
struct entry_points {
  void* (*allocate)(std::size_t, int, void*, int*, char*, std::size_t){};
  void (*free)(void*, std::size_t, int, void*){};
  int (*record_stream)(void*, int, void*, char*, std::size_t){};
  int (*stats)(int, std::uint64_t*, int){};
  void (*reset_peaks)(int){};
  std::size_t (*trim)(int){};
  std::size_t (*largest_block)(int){};
  int (*ipc_handle)(void*, int, unsigned char*, std::size_t*, char*, std::size_t){};
  int (*set_maximum)(int, std::size_t, char*, std::size_t){};
  std::size_t (*maximum)(int){};
  int (*capture)(int, int){};
  long (*layout)(int, std::uint64_t*, std::size_t){};
  char const* (*tag_name)(int){};
  int (*reserve_outside)(int, long long, char*, std::size_t){};
};
entry_points api;

// Messages are made with std::string and std::to_string, never with TORCH_CHECK's several
// arguments: those go through an ostringstream, and with a PyTorch whose extensions link
// libstdc++ statically, formatting a number there crashed (seen with torch 2.11 on the GPU host:
// SIGSEGV in codecvt under ostream::_M_insert<double>).
[[noreturn]] void raise(std::string const& message) { TORCH_CHECK(false, message); }

template <typename F>
void find(void* lib, char const* name, F& f)
{
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    raise(std::string{"emmpool: "} + name + " is missing from emmpool's _core (" + dlerror() +
          "): the PyTorch extension and emmpool come from different versions; reinstall emmpool");
  }
  f = reinterpret_cast<F>(sym);
}

void load_entry_points(std::string const& core_path)
{
  void* lib = dlopen(core_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) { raise("emmpool: cannot open " + core_path + ": " + dlerror()); }
  int (*abi)(){};
  find(lib, "emmpool_torch_abi_version", abi);
  if (abi() != expected_abi) {
    raise("emmpool: _core speaks torch ABI " + std::to_string(abi()) + ", the extension " +
          std::to_string(expected_abi) + ": reinstall emmpool (the extension cache is keyed by its source)");
  }
  find(lib, "emmpool_torch_allocate", api.allocate);
  find(lib, "emmpool_torch_free", api.free);
  find(lib, "emmpool_torch_record_stream", api.record_stream);
  find(lib, "emmpool_torch_stats", api.stats);
  find(lib, "emmpool_torch_reset_peaks", api.reset_peaks);
  find(lib, "emmpool_torch_trim", api.trim);
  find(lib, "emmpool_torch_largest_block", api.largest_block);
  find(lib, "emmpool_torch_ipc_handle", api.ipc_handle);
  find(lib, "emmpool_torch_set_maximum", api.set_maximum);
  find(lib, "emmpool_torch_maximum", api.maximum);
  find(lib, "emmpool_torch_capture", api.capture);
  find(lib, "emmpool_torch_layout", api.layout);
  find(lib, "emmpool_torch_tag_name", api.tag_name);
  find(lib, "emmpool_torch_reserve_outside", api.reserve_outside);
}

void* pointer_of(void* ctx) { return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ctx) & ~context_bits); }
int device_of(void* ctx) { return static_cast<int>(reinterpret_cast<std::uintptr_t>(ctx) & device_bits); }
bool is_private(void* ctx) { return (reinterpret_cast<std::uintptr_t>(ctx) & private_bit) != 0; }

void* context_of(void* ptr, int device, bool private_block)
{
  return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ptr) |
                                 static_cast<std::uintptr_t>(device) |
                                 (private_block ? private_bit : 0));
}

// Told of every out-of-memory error before it is raised (memory history, OOM observers): set
// once by the allocator at install.
void (*on_out_of_memory)(int device, std::size_t size) = nullptr;

// A size as PyTorch's messages write it (c10's format_size): tools that read its
// out-of-memory errors find the same words.
std::string format_size(std::size_t bytes)
{
  char text[64];
  double const b = static_cast<double>(bytes);
  if (bytes <= (std::size_t{1} << 20)) {
    std::snprintf(text, sizeof text, "%.2f KiB", b / 1024.0);
  } else if (bytes <= (std::size_t{1} << 30)) {
    std::snprintf(text, sizeof text, "%.2f MiB", b / 1048576.0);
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", b / 1073741824.0);
  }
  return text;
}

[[noreturn]] void fail(int kind, std::size_t size, int device, char const* why)
{
  if (kind == 0) {
    if (on_out_of_memory != nullptr) { on_out_of_memory(device, size); }
    // PyTorch's first sentences, then emmpool's account of its pool.
    std::size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) { (void)cudaGetLastError(); }
    std::string const msg = "emmpool: CUDA out of memory. Tried to allocate " + format_size(size) +
                            ". GPU " + std::to_string(device) + " has a total capacity of " +
                            format_size(total) + " of which " + format_size(free) +
                            " is free. " + why +
                            " (EMMPOOL_MAXIMUM_POOL_SIZE caps the pool; emmpool.stats() shows what it holds)";
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  raise("emmpool: allocation of " + std::to_string(size) + " bytes on device " +
        std::to_string(device) + " failed: " + why);
}

void* allocate_or_throw(std::size_t size, int device, void* stream)
{
  // As PyTorch's allocator: a size no device holds, refused before the pool is asked
  if (size > (std::size_t{1} << 60)) {
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     "emmpool: CUDA out of memory. Tried to allocate more than 1EB memory.");
  }
  int kind = 2;
  char why[error_length] = "";
  void* p = api.allocate(size, device, stream, &kind, why, sizeof why);
  if (p == nullptr) { fail(kind, size, device, why); }
  return p;
}

// One block of emmpool's layout (c_api_torch.cpp: emmpool_torch_layout).
struct layout_row {
  std::uint64_t segment, segment_size, ptr, size, stream, state, tag, kind;
};

std::vector<layout_row> layout_of(int device)
{
  std::vector<std::uint64_t> raw;
  long n = api.layout(device, nullptr, 0);
  while (n > 0) {
    raw.resize(8 * static_cast<std::size_t>(n));
    long const m = api.layout(device, raw.data(), static_cast<std::size_t>(n));
    if (m <= n) {
      raw.resize(8 * static_cast<std::size_t>(m < 0 ? 0 : m));
      break;
    }
    n = m;  // a segment appeared in between: again, with room for it
  }
  std::vector<layout_row> rows;
  for (std::size_t i = 0; i + 8 <= raw.size(); i += 8) {
    rows.push_back(layout_row{raw[i], raw[i + 1], raw[i + 2], raw[i + 3], raw[i + 4], raw[i + 5],
                              raw[i + 6], raw[i + 7]});
  }
  return rows;
}

}  // namespace
