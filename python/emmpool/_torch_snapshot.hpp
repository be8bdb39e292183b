// A memory snapshot in PyTorch's format (torch.cuda.memory._snapshot(), memory_viz) of
// emmpool's pool: every segment, tiled by its blocks, free gaps included, with the history's
// traces. Part of the one translation unit _torch_allocator.cpp.
//
// The segments are emmpool's, which every library shares: the blocks of Numba, CuPy and
// cuda.core appear in them as allocated blocks (emmpool.torch_snapshot() names their library).
// A block of a private pool (a CUDA graph's, a MemPool's) is shown as a segment of its own,
// owned by that pool, as PyTorch shows its private pools' segments; the rest of its emmpool
// segment is split around it, so that every address is shown once. A growable segment shows
// its runs of blocks in use: its free blocks are address space, mapped only in part.
#pragma once

#include "_torch_entry_points.hpp"
#include "_torch_history.hpp"
#include "_torch_private_pools.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr std::uint64_t torch_tag = 3;  // emmpool::alloc_tag::torch

int device_count()
{
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return std::min(n, 64);
}

cca::SnapshotInfo build_snapshot(private_pools& pools, memory_history& history, MempoolId only,
                                 bool include_traces)
{
  using cca::BlockInfo;
  using cca::SegmentInfo;
  cca::SnapshotInfo out;
  int const devices = device_count();
  bool const filtered = only != MempoolId{0, 0};
  for (int d = 0; d < devices; ++d) {
    auto const rows = layout_of(d);
    std::unordered_map<std::uint64_t, private_pools::block_view> privates;
    for (auto const& b : pools.blocks_of(d)) { privates.emplace(reinterpret_cast<std::uint64_t>(b.ptr), b); }

    SegmentInfo piece;
    bool open = false;
    auto close = [&] {
      if (open && !piece.blocks.empty() && (!filtered || piece.owner_private_pool_id == only)) {
        out.segments.push_back(std::move(piece));
      }
      piece = SegmentInfo{};
      open  = false;
    };
    auto start = [&](layout_row const& r) {
      close();
      piece.device        = static_cast<c10::DeviceIndex>(d);
      piece.address       = r.ptr;
      piece.is_large      = r.kind != 0;
      piece.is_expandable = r.kind == 2;
      open                = true;
    };
    auto add = [&](BlockInfo b, cudaStream_t stream) {
      piece.total_size += b.size;
      piece.requested_size += b.allocated ? b.requested_size : 0;
      piece.allocated_size += b.allocated ? b.size : 0;
      piece.active_size += b.active ? b.size : 0;
      // void* from PyTorch 2.11 on, cudaStream_t before
      if (piece.stream == nullptr && b.allocated) { piece.stream = stream; }
      piece.blocks.push_back(std::move(b));
    };

    std::unordered_map<std::uint64_t, bool> shown;  // private blocks met in emmpool's layout
    auto private_segment = [&](private_pools::block_view const& b, layout_row const& r) {
      start(r);
      piece.owner_private_pool_id = b.pool;
      piece.is_large              = b.size > (std::size_t{1} << 20);
      BlockInfo info;
      info.size = info.requested_size = b.size;
      info.allocated = info.active = b.live;
      auto const [ctx, requested] = history.block(b.ptr);
      if (b.live) {
        info.context_when_allocated = ctx;
        if (requested != 0) { info.requested_size = requested; }
      }
      add(std::move(info), b.stream);
      close();
    };
    std::uint64_t segment = 0;
    for (auto const& r : rows) {
      bool const new_segment = r.segment != segment;
      segment                = r.segment;
      if (auto it = privates.find(r.ptr); it != privates.end() && r.state == 1) {
        // A private pool's block: a segment of that pool (live, or free within the pool).
        private_segment(it->second, r);
        shown[r.ptr] = true;
        continue;
      }
      if (r.kind == 2 && r.state == 0) {  // growable address space, not all of it mapped
        close();
        continue;
      }
      if (new_segment || !open) { start(r); }
      BlockInfo info;
      info.size = info.requested_size = r.size;
      info.allocated = r.state == 1;
      info.active    = r.state != 0;
      if (r.tag == torch_tag && r.state == 1) {
        auto const [ctx, requested] = history.block(reinterpret_cast<void*>(r.ptr));
        info.context_when_allocated = ctx;
        if (requested != 0) { info.requested_size = requested; }
      }
      add(std::move(info), reinterpret_cast<cudaStream_t>(r.stream == 1 ? 0 : r.stream));
    }
    close();
    // Blocks of a MemPool made with another allocator: that allocator's memory, not emmpool's.
    for (auto const& [ptr, b] : privates) {
      if (shown.count(ptr) != 0) { continue; }
      layout_row const r{ptr, b.size, ptr, b.size, 0, 1, torch_tag, 1};
      private_segment(b, r);
    }
  }
  out.device_traces.resize(static_cast<std::size_t>(devices));
  if (include_traces) {
    for (int d = 0; d < devices; ++d) { out.device_traces[static_cast<std::size_t>(d)] = history.trace(d); }
  }
  out.config_metadata = cca::AllocatorConfigInfo{};
  out.config_metadata.last_allocator_settings = "emmpool";
  return out;
}

// The library of every block of another library than PyTorch (for emmpool.torch_snapshot()).
std::vector<std::pair<std::uint64_t, std::string>> block_libraries(int device)
{
  std::vector<std::pair<std::uint64_t, std::string>> out;
  for (auto const& r : layout_of(device)) {
    if (r.state == 0 || r.tag == torch_tag) { continue; }
    char const* name = api.tag_name(static_cast<int>(r.tag));
    out.emplace_back(r.ptr, name != nullptr ? name : "other");
  }
  return out;
}

}  // namespace
