/**
 * @file pool_queries.hpp
 * @brief Questions asked of a device pool that change nothing: whether a pointer is one of
 * its blocks, the block holding an address, the layout of its segments, a line saying what it
 * holds.
 *
 * A view of one pool (device_pool.hpp), made where needed (`pool_queries{pool}.owns(p)`): it
 * holds nothing of its own and takes the pool's lock for each question (a friend of the
 * pool's; the pool never calls it). The answers come from detail/segment_index.hpp.
 */
#pragma once

#include <emmpool/driver.hpp>
#include <emmpool/pool_layout.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace emmpool {

class device_pool;

class pool_queries {
 public:
  explicit pool_queries(device_pool const& pool) noexcept : pool_{&pool} {}

  /// @brief Whether ptr is a live block of this pool (the start of one).
  [[nodiscard]] bool owns(device_ptr ptr) const;

  /// @brief The live block containing ptr (which may point inside it), as {address, size};
  /// std::nullopt if no live block of this pool holds ptr. What "the allocation" of an array
  /// is for a caller that asks the driver (Numba's device_extents: cuMemGetAddressRange would
  /// answer with the whole segment, which other arrays share).
  [[nodiscard]] std::optional<std::pair<device_ptr, std::size_t>> live_extent(device_ptr ptr) const;

  /// @brief Every block of every segment, in address order (a memory snapshot). A growable
  /// segment counts only its mapped pages in reserved; its free blocks are reported whole.
  [[nodiscard]] std::vector<layout_block> layout() const;

  /// @brief A one-line description of what the pool holds, for error messages.
  [[nodiscard]] std::string describe() const;

 private:
  device_pool const* pool_;
};

}  // namespace emmpool
