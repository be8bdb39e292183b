// emmpool's C entry points as the PyTorch extension sees them (emmpool/torch_api.h, found with
// dlsym in _core's library), the DataPtr context that carries a block's device, and the
// allocation that raises PyTorch's errors. Part of the one translation unit allocator.cpp
// (included once, hence the unnamed namespace).
#pragma once

#include <emmpool/torch_api.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>
#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

// The CUDAAllocator interface changes between PyTorch releases; what differs is guarded by this.
#define EMMPOOL_TORCH_AT_LEAST(major, minor)           \
  (TORCH_VERSION_MAJOR > (major) ||                     \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using MempoolId = c10::cuda::MempoolId_t;

constexpr std::uintptr_t device_bits  = 0x3f;  // device index, < 64 (emmpool's registry)
constexpr std::uintptr_t private_bit  = 0x80;  // a block of a graph / MemPool private pool
constexpr std::uintptr_t context_bits = 0xff;

// emmpool's C entry points, typed by the header, found in _core's shared library: a pointer
// for each function the header lists (EMMPOOL_TORCH_FUNCTIONS).
struct entry_points {
#define EMMPOOL_POINTER(name) decltype(&::name) name{};
  EMMPOOL_TORCH_FUNCTIONS(EMMPOOL_POINTER)
#undef EMMPOOL_POINTER
};
entry_points api;

// Messages are made with std::string and std::to_string, never with TORCH_CHECK's several
// arguments: those go through an ostringstream, and with a PyTorch whose extensions link
// libstdc++ statically (torch 2.11's wheels), formatting a number there crashes (SIGSEGV in
// codecvt under ostream::_M_insert<double>).
[[noreturn]] void raise(std::string const& message) { TORCH_CHECK(false, message); }

void load_entry_points(std::string const& core_path)
{
  void* lib = dlopen(core_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) { raise("emmpool: cannot open " + core_path + ": " + dlerror()); }
  auto find = [&](char const* name) {
    void* sym = dlsym(lib, name);
    if (sym == nullptr) {
      raise(std::string{"emmpool: "} + name + " is missing from emmpool's _core (" + dlerror() +
            "): the PyTorch extension and emmpool come from different versions; reinstall emmpool");
    }
    return sym;
  };
  auto const abi = reinterpret_cast<decltype(&::emmpool_torch_abi_version)>(
    find("emmpool_torch_abi_version"))();
  if (abi != EMMPOOL_TORCH_ABI_VERSION) {
    raise("emmpool: _core speaks torch ABI " + std::to_string(abi) + ", the extension " +
          std::to_string(EMMPOOL_TORCH_ABI_VERSION) +
          ": reinstall emmpool (the extension cache is keyed by its source)");
  }
#define EMMPOOL_FIND(name) api.name = reinterpret_cast<decltype(&::name)>(find(#name));
  EMMPOOL_TORCH_FUNCTIONS(EMMPOOL_FIND)
#undef EMMPOOL_FIND
}

emmpool_private_id private_id(MempoolId id)
{
  return {static_cast<std::uint64_t>(id.first), static_cast<std::uint64_t>(id.second)};
}
MempoolId mempool_id(emmpool_private_id id)
{
  return {static_cast<MempoolId::first_type>(id.first),
          static_cast<MempoolId::second_type>(id.second)};
}

void* pointer_of(void* ctx)
{
  return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ctx) & ~context_bits);
}
int device_of(void* ctx)
{
  return static_cast<int>(reinterpret_cast<std::uintptr_t>(ctx) & device_bits);
}
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

// Whether an out-of-memory error tells on_out_of_memory as it is raised, or leaves that to a
// caller that has a last resort to try first (MemPools made with use_on_oom, as PyTorch tries
// them before its observers hear of the error).
enum class oom_report : std::uint8_t { at_once, by_caller };

// A failed allocation as PyTorch raises it: out of memory with PyTorch's first sentences,
// then emmpool's account of its pool; anything else as a plain error.
[[noreturn]] void fail(emmpool_error const& error, std::size_t size, int device,
                       oom_report report = oom_report::at_once)
{
  if (error.kind == EMMPOOL_FAILED_OUT_OF_MEMORY) {
    if (on_out_of_memory != nullptr && report == oom_report::at_once) {
      on_out_of_memory(device, size);
    }
    std::size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) { (void)cudaGetLastError(); }
    std::string const msg = "emmpool: CUDA out of memory. Tried to allocate " + format_size(size) +
                            ". GPU " + std::to_string(device) + " has a total capacity of " +
                            format_size(total) + " of which " + format_size(free) +
                            " is free. " + error.message +
                            " (EMMPOOL_MAXIMUM_POOL_SIZE caps the pool; emmpool.stats() shows "
                            "what it holds)";
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  raise("emmpool: allocation of " + std::to_string(size) + " bytes on device " +
        std::to_string(device) + " failed: " + error.message);
}

[[noreturn]] void fail_out_of_memory(std::size_t size, int device, char const* why)
{
  emmpool_error error{EMMPOOL_FAILED_OUT_OF_MEMORY, {}};
  std::snprintf(error.message, sizeof error.message, "%s", why);
  fail(error, size, device);
}

// As PyTorch's allocator: a size no device holds, refused before the pool is asked.
void check_size(std::size_t size)
{
  if (size > (std::size_t{1} << 60)) {
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     "emmpool: CUDA out of memory. Tried to allocate more than 1EB memory.");
  }
}

// A block from the pool, or PyTorch's error; the caller has checked the size (check_size).
void* allocate_or_throw(std::size_t size, int device, void* stream,
                        oom_report report = oom_report::at_once)
{
  emmpool_error error{EMMPOOL_FAILED_OTHER, {}};
  void* p = api.emmpool_torch_allocate(size, device, stream, &error);
  if (p == nullptr) { fail(error, size, device, report); }
  return p;
}

// An array the core fills (emmpool/torch_api.h's protocol: it returns how many there are, and
// is asked again with room for them if that is more).
template <class Row, class Fill>
std::vector<Row> rows_of(Fill&& fill)
{
  std::vector<Row> rows;
  long n = fill(nullptr, 0);
  while (n > 0) {
    rows.resize(static_cast<std::size_t>(n));
    long const m = fill(rows.data(), rows.size());
    if (m <= n) {
      rows.resize(static_cast<std::size_t>(m < 0 ? 0 : m));
      break;
    }
    n = m;  // more appeared in between: again, with room for them
  }
  return rows;
}

std::vector<emmpool_layout_row> layout_of(int device)
{
  return rows_of<emmpool_layout_row>([device](emmpool_layout_row* out, std::size_t n) {
    return api.emmpool_torch_layout(device, out, n);
  });
}

std::vector<emmpool_private_block> private_blocks_of(int device)
{
  return rows_of<emmpool_private_block>([device](emmpool_private_block* out, std::size_t n) {
    return api.emmpool_private_blocks(device, out, n);
  });
}

// A queue the core keeps (segment events, returned foreign blocks): taken in chunks.
template <class Row, class Take>
std::vector<Row> drain(Take&& take)
{
  std::vector<Row> all;
  Row chunk[64];
  for (;;) {
    long const n = take(chunk, 64);
    if (n <= 0) { break; }
    all.insert(all.end(), chunk, chunk + n);
    if (n < 64) { break; }
  }
  return all;
}

}  // namespace
