/**
 * @file detail/block.hpp
 * @brief The pools' bookkeeping records. Internal: shared by the pools, the fence queue, the
 * stream lanes and the free lists.
 */
#pragma once

#include <emmpool/detail/stream_key.hpp>
#include <emmpool/driver.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace emmpool::detail {

struct segment;
struct pending_batch;  // fence_queue.hpp

/// Where a block is in its life. A block moves allocated -> pending -> free; straight from
/// pending back to allocated only in the order of one named stream (reuse_rule.hpp).
enum class block_state : std::uint8_t { free, allocated, pending };

/// Which requests a block may serve: a segment serves one kind only (small requests small
/// segments, large ones large fixed segments or the growable segment).
enum class block_kind : std::uint8_t { small, large, growable };
inline constexpr std::size_t block_kinds = 3;

/// @brief A contiguous range of a segment. Blocks of a segment form a doubly linked list in
/// address order, so that a freed block finds its neighbours in O(1) to coalesce.
struct block {
  device_ptr ptr{};
  std::size_t size{};
  segment* seg{};
  block* prev{};  ///< physical neighbour below (same segment), or null
  block* next{};  ///< physical neighbour above (same segment), or null
  block_state state{block_state::free};
  std::uint8_t tag{};  ///< which library allocated it (stats)
  /// Pending, and in its stream's lane (stream_lanes.hpp): an allocation on that stream may
  /// take it, a neighbour freed on that stream may merge with it.
  bool takeable{};
  block_kind kind{};             ///< its segment's kind (seg->kind()), here for the hot path
  std::uint32_t slot{};          ///< its index in owner->blocks while pending
  pending_batch* owner{};        ///< the batch (one fence) it waits in while pending
  /// A second stream the free must wait for (device_pool::record_stream): the block is fenced
  /// on it first (an event recorded at the free), then on the stream of the free.
  stream_ref also_fence{stream_ref::none()};
  stream_ref freed_on{};      ///< the stream of the free, while waiting for also_fence
  stream_ref alloc_stream{};  ///< the stream named at allocation (legacy_stream: none)
  /// Another process may use it (pool_sharing::hold): its free waits for the last release.
  bool held{};
};

/// @brief One allocation from the driver, carved into blocks.
struct segment {
  device_ptr base{};
  std::size_t size{};
  std::uint64_t buffer_id{};           ///< driver's unique id: guards against freeing reused addresses
  bool small{};                        ///< serves small requests only (size classes)
  bool growable{};                     ///< address space with pages mapped on demand
                                       ///< (growable_segment.hpp); never IPC-exported
  std::size_t live_blocks{};           ///< blocks allocated or pending: never released while > 0
                                       ///< (the stream lanes split and merge pending ones)
  std::optional<ipc_bytes> ipc;        ///< cuIpcGetMemHandle, fetched once
  block* first{};

  [[nodiscard]] block_kind kind() const noexcept
  {
    return small ? block_kind::small : growable ? block_kind::growable : block_kind::large;
  }
};

/// @brief A pool's segments by base address.
using segment_map = std::map<device_ptr, std::unique_ptr<segment>>;

/// @brief Make `rest` (a fresh record) the part of `blk` past its first `size` bytes, next to
/// it in the segment's block list.
inline void split_off(block* blk, std::size_t size, block* rest) noexcept
{
  rest->ptr  = blk->ptr + size;
  rest->size = blk->size - size;
  rest->seg  = blk->seg;
  rest->kind = blk->kind;
  rest->prev = blk;
  rest->next = blk->next;
  if (blk->next != nullptr) { blk->next->prev = rest; }
  blk->next = rest;
  blk->size = size;
}

/// @brief Extend `lower` over `upper`, its next neighbour, and unlink upper (whose record the
/// caller recycles).
inline void absorb(block* lower, block* upper) noexcept
{
  lower->size += upper->size;
  lower->next = upper->next;
  if (upper->next != nullptr) { upper->next->prev = lower; }
}

/// @brief split_off()'s mirror: make `front` (a fresh record) the first `size` bytes of `blk`,
/// which keeps the rest. For a caller that wants blk's record to stay where it is (in a
/// size-ordered set: detail/free_list.hpp).
inline void carve_front(block* blk, std::size_t size, block* front) noexcept
{
  front->ptr  = blk->ptr;
  front->size = size;
  front->seg  = blk->seg;
  front->kind = blk->kind;
  front->prev = blk->prev;
  front->next = blk;
  if (blk->prev != nullptr) {
    blk->prev->next = front;
  } else {
    blk->seg->first = front;
  }
  blk->prev = front;
  blk->ptr += size;
  blk->size -= size;
}

/// @brief absorb()'s mirror: extend `upper` down over `lower`, its previous neighbour, and
/// unlink lower (whose record the caller recycles).
inline void absorb_down(block* lower, block* upper) noexcept
{
  upper->ptr = lower->ptr;
  upper->size += lower->size;
  upper->prev = lower->prev;
  if (lower->prev != nullptr) {
    lower->prev->next = upper;
  } else {
    lower->seg->first = upper;
  }
}

/// @brief Merge `blk` into `keep`, its physical neighbour on either side, and `other` too (null,
/// or blk's neighbour on the side opposite keep): keep's record then spans them all, in place.
/// The caller recycles blk's and other's records.
inline void merge_into(block* keep, block* blk, block* other) noexcept
{
  if (keep->next == blk) {
    absorb(keep, blk);
    if (other != nullptr) { absorb(keep, other); }
  } else {
    absorb_down(blk, keep);
    if (other != nullptr) { absorb_down(other, keep); }
  }
}

/// @brief Owns block records and recycles them: splits and frees make and drop records at a
/// high rate, and a free list keeps that off the heap. Not thread-safe (its pool's mutex).
class block_arena {
 public:
  block* make()
  {
    if (spare_.empty()) {
      storage_.push_back(std::make_unique<block>());
      return storage_.back().get();
    }
    auto* b = spare_.back();
    spare_.pop_back();
    *b = block{};
    return b;
  }
  void recycle(block* b) { spare_.push_back(b); }

 private:
  std::vector<std::unique_ptr<block>> storage_;
  std::vector<block*> spare_;
};

}  // namespace emmpool::detail
