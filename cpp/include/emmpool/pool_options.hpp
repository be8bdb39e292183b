/**
 * @file pool_options.hpp
 * @brief How a device pool grows and what it keeps (device_pool.hpp).
 */
#pragma once

#include <emmpool/round_up.hpp>

#include <cstddef>
#include <cstdint>

namespace emmpool {

/// Every block's size and address are a multiple of this (device_pool::alignment).
inline constexpr std::size_t block_alignment = 256;
/// The bytes a block of a request of `requested` bytes spans: rounded up to the alignment, and
/// one alignment for 0 (every block has an address of its own). `requested` at most half of
/// SIZE_MAX (device_pool checks it first).
[[nodiscard]] constexpr std::size_t block_bytes(std::size_t requested) noexcept
{
  return requested == 0 ? block_alignment : round_up(requested, block_alignment);
}
/// The largest growable page one may ask for (pool_options::growable_page_size).
inline constexpr std::size_t max_growable_page_size = std::size_t{1} << 30;

/// The driver's own allocation granularity: a fixed segment's size is a multiple of it.
inline constexpr std::size_t segment_granularity = std::size_t{2} << 20;
/// pool_options::growable_page_size unless set.
inline constexpr std::size_t default_growable_page_size = std::size_t{20} << 20;
/// pool_options::growable_free_limit unless set.
inline constexpr std::size_t default_growable_free_limit = std::size_t{64} << 20;

enum class pool_mode : std::uint8_t { pool, passthrough };

/// How pool mode gets memory for requests above small_request. `growable` (the default): one
/// address reservation whose pages are mapped on demand, freed pages kept mapped up to
/// growable_free_limit (detail/growable_space.hpp), where the device supports virtual memory
/// management (fixed elsewhere); it holds less memory than fixed segments on programs that mix
/// libraries and on shapes that churn (docs/limits.md). Its blocks have no legacy IPC handle
/// (cuIpcGetMemHandle cannot export VMM memory): their pages are shared as file descriptors
/// instead. `fixed`: cuMemAlloc segments, each a legacy IPC handle.
enum class segment_kind : std::uint8_t { fixed, growable };

/// @brief How a pool grows and what it keeps.
struct pool_options {
  pool_mode mode{pool_mode::pool};
  std::size_t initial_size{0};          ///< bytes reserved when the pool is created
  std::size_t maximum_size{0};          ///< cap on bytes reserved; 0: no cap but the device's
  double maximum_fraction{0.0};         ///< cap as a fraction of the device's memory; 0: unused
  std::size_t small_request{1u << 20};  ///< requests up to this size use small segments
  std::size_t small_segment{2u << 20};  ///< size of a small segment
  std::size_t large_segment{20u << 20}; ///< minimum size of a large segment
  std::size_t open_batch_limit{64u << 20};  ///< fence freed blocks past this many bytes
                                            ///< unfenced (dormant streams: one device sync)
  bool trace{false};                    ///< record every allocation and free (set_tracing)
  bool segment_events{false};           ///< record segment events (set_segment_events)
  segment_kind segments{segment_kind::growable};  ///< see segment_kind
  // The growable segment's policy (detail/page_policy.hpp says what each does and why):
  std::size_t growable_reserve{0};      ///< its address space; 0: the device's memory (at most
                                        ///< the cap)
  std::size_t growable_room{20u << 20};  ///< what a map covers of the free block it carves
                                         ///< beyond the request; 0: the request's pages only
  std::size_t growable_free_limit{default_growable_free_limit};  ///< mapped bytes free blocks
                                                                ///< keep before pages move
  std::size_t growable_page_size{default_growable_page_size};  ///< its page; 0: the driver's
                                                               ///< granularity

  /// @brief Check that the options are consistent (the device's own limits aside).
  /// @throws std::invalid_argument saying which is not
  void check() const;

  /// @brief Whether a request of `rounded` bytes is served by small segments.
  [[nodiscard]] constexpr bool small(std::size_t rounded) const noexcept
  {
    return mode == pool_mode::pool && rounded <= small_request;
  }
  /// @brief How big a fixed segment to make for a request of `rounded` bytes (the growth
  /// policy, RMM's size_to_grow; device_pool::grow checks the cap and makes it). In pool mode a
  /// small request gets a small segment (size classes share it); a mid-sized one, unless
  /// `exact`, a large segment that several such requests share (the out-of-memory ladder asks
  /// for exact sizes once that failed); a larger one its size in driver granules. Passthrough:
  /// the request itself, one segment per allocation.
  [[nodiscard]] constexpr std::size_t segment_size(std::size_t rounded, bool exact) const noexcept
  {
    if (mode != pool_mode::pool) { return rounded; }
    if (rounded <= small_request) { return small_segment; }
    if (!exact && rounded <= large_segment / 2) { return large_segment; }
    return round_up(rounded, segment_granularity);
  }
};

}  // namespace emmpool
