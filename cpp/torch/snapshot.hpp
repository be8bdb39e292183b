// A memory snapshot in PyTorch's format (torch.cuda.memory._snapshot(), memory_viz) of
// emmpool's pool: every segment, tiled by its blocks, free gaps included, with the history's
// traces. Part of the one translation unit allocator.cpp.
//
// The segments are emmpool's, which every library shares: the blocks of Numba, CuPy and
// cuda.core appear in them as allocated blocks (emmpool.torch_snapshot() names their library).
// A block of a private pool (a CUDA graph's, a MemPool's) is shown as a segment of its own,
// owned by that pool, as PyTorch shows its private pools' segments; the rest of its emmpool
// segment is split around it, so that every address is shown once. A growable segment shows
// its runs of blocks in use: its free blocks are address space, mapped only in part.
#pragma once

#include "entry_points.hpp"
#include "history.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

int device_count()
{
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return std::min(n, 64);
}

cca::SnapshotInfo build_snapshot(memory_history& history, MempoolId only, bool include_traces)
{
  using cca::BlockInfo;
  using cca::SegmentInfo;
  cca::SnapshotInfo out;
  int const devices = device_count();
  bool const filtered = only != MempoolId{0, 0};
  for (int d = 0; d < devices; ++d) {
    auto const rows = layout_of(d);
    std::unordered_map<std::uint64_t, emmpool_private_block> privates;
    for (auto const& b : private_blocks_of(d)) { privates.emplace(b.ptr, b); }

    SegmentInfo piece;
    bool open = false;
    auto close = [&] {
      if (open && !piece.blocks.empty() && (!filtered || piece.owner_private_pool_id == only)) {
        out.segments.push_back(std::move(piece));
      }
      piece = SegmentInfo{};
      open  = false;
    };
    auto start = [&](emmpool_layout_row const& r) {
      close();
      piece.device        = static_cast<c10::DeviceIndex>(d);
      piece.address       = r.ptr;
      piece.is_large      = r.kind != EMMPOOL_SEGMENT_SMALL;
      piece.is_expandable = r.kind == EMMPOOL_SEGMENT_GROWABLE;
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
    auto private_segment = [&](emmpool_private_block const& b, emmpool_layout_row const& r) {
      start(r);
      piece.owner_private_pool_id = mempool_id(b.pool);
      piece.is_large              = b.size > (std::size_t{1} << 20);
      BlockInfo info;
      info.size = info.requested_size = b.size;
      info.allocated = info.active = b.live;
      auto const [ctx, requested] = history.block(reinterpret_cast<void*>(b.ptr));
      if (b.live) {
        info.context_when_allocated = ctx;
        if (requested != 0) { info.requested_size = requested; }
      }
      add(std::move(info), reinterpret_cast<cudaStream_t>(b.stream));
      close();
    };
    std::uint64_t segment = 0;
    for (auto const& r : rows) {
      bool const new_segment = r.segment != segment;
      segment                = r.segment;
      auto const it = privates.find(r.ptr);
      if (it != privates.end() && r.state == EMMPOOL_BLOCK_ALLOCATED) {
        // A private pool's block: a segment of that pool (live, or free within the pool).
        private_segment(it->second, r);
        shown[r.ptr] = true;
        continue;
      }
      if (r.kind == EMMPOOL_SEGMENT_GROWABLE && r.state == EMMPOOL_BLOCK_FREE) {
        // growable address space, not all of it mapped
        close();
        continue;
      }
      if (new_segment || !open) { start(r); }
      BlockInfo info;
      info.size = info.requested_size = r.size;
      info.allocated = r.state == EMMPOOL_BLOCK_ALLOCATED;
      info.active    = r.state != EMMPOOL_BLOCK_FREE;
      if (r.library == EMMPOOL_LIBRARY_TORCH && r.state == EMMPOOL_BLOCK_ALLOCATED) {
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
      emmpool_layout_row r{};
      r.segment = r.ptr = ptr;
      r.segment_size = r.size = b.size;
      r.state   = EMMPOOL_BLOCK_ALLOCATED;
      r.library = EMMPOOL_LIBRARY_TORCH;
      r.kind    = EMMPOOL_SEGMENT_LARGE;
      private_segment(b, r);
    }
  }
  out.device_traces.resize(static_cast<std::size_t>(devices));
  if (include_traces) {
    for (int d = 0; d < devices; ++d) {
      out.device_traces[static_cast<std::size_t>(d)] = history.trace(d);
    }
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
    if (r.state == EMMPOOL_BLOCK_FREE || r.library == EMMPOOL_LIBRARY_TORCH) { continue; }
    char const* name = api.emmpool_library_name(r.library);
    out.emplace_back(r.ptr, name != nullptr ? name : "other");
  }
  return out;
}

}  // namespace
