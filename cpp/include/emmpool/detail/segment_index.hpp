/**
 * @file detail/segment_index.hpp
 * @brief What a device pool holds, indexed: its segments by base address and its allocated
 * blocks by address, and the questions asked of them that change no block: whether a pointer
 * is a live block, the live block holding an address, a block's IPC description, the layout.
 *
 * The pool adds and removes segments and live blocks (growth, release, hand-out, free, reset);
 * nothing here moves a block between allocated, pending and free. Not thread-safe: the pool's
 * mutex.
 */
#pragma once

#include <emmpool/detail/address_map.hpp>
#include <emmpool/detail/block.hpp>
#include <emmpool/driver.hpp>
#include <emmpool/pool_layout.hpp>

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace emmpool::detail {

class segment_index {
 public:
  segment_index() { live_.reserve(4096); }

  // ---- what the pool changes ------------------------------------------------------------------

  /// @brief The segments, by base: the pool makes, releases and retires them.
  [[nodiscard]] segment_map& segments() noexcept { return segments_; }
  [[nodiscard]] segment_map const& segments() const noexcept { return segments_; }
  /// @brief The allocated blocks, by address: the pool hands them out and takes them back.
  [[nodiscard]] live_map& live() noexcept { return live_; }

  // ---- questions ------------------------------------------------------------------------------

  /// @brief Whether ptr is the start of a live block.
  [[nodiscard]] bool owns(device_ptr ptr) const { return live_.count(ptr) != 0; }

  /// @brief The segment holding ptr, if a block in it is live (allocated or pending); else null.
  [[nodiscard]] segment* holding_live(device_ptr ptr) const;

  /// @brief The block of `seg` holding ptr, whatever its state; null if none does.
  [[nodiscard]] static block const* block_at(segment const& seg, device_ptr ptr) noexcept;

  /// @brief The live block holding ptr (which may point inside it), as {address, size}.
  [[nodiscard]] std::optional<std::pair<device_ptr, std::size_t>> live_extent(device_ptr ptr) const;

  /// @brief The IPC description of the live block holding ptr (the segment's handle, asked of
  /// the driver once per segment); std::nullopt if no live block holds it.
  /// @throws pool_error for a block of the growable segment (no legacy IPC handle)
  [[nodiscard]] std::optional<ipc_info> ipc(device_ptr ptr, driver& drv, int device) const;

  /// @brief Every block of every segment, in address order.
  [[nodiscard]] std::vector<layout_block> layout() const;

 private:
  segment_map segments_;
  live_map live_;
};

}  // namespace emmpool::detail
