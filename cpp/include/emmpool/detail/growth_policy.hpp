/**
 * @file detail/growth_policy.hpp
 * @brief How big a fixed segment the pool asks the driver for (RMM's size_to_grow): policy
 * only; device_pool::grow() checks the cap, gives wholly free memory back at a new peak and
 * makes the segment.
 */
#pragma once

#include <emmpool/pool_options.hpp>

#include <cstddef>

namespace emmpool::detail {

/// The driver's own allocation granularity: a segment's size is a multiple of it.
inline constexpr std::size_t large_granularity = std::size_t{2} << 20;

[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t a) noexcept
{
  return (n + a - 1) / a * a;
}

/// @brief Whether a request of `rounded` bytes is served by small segments (pool mode).
[[nodiscard]] constexpr bool small_request(std::size_t rounded, pool_options const& o) noexcept
{
  return o.mode == pool_mode::pool && rounded <= o.small_request;
}

/// @brief The size of the segment to make for a request of `rounded` bytes. In pool mode a
/// small request gets a small segment (size classes share it); a mid-sized one, unless
/// `exact`, a large segment that several such requests share (the out-of-memory ladder asks
/// for exact sizes once that failed); a larger one its size in driver granules. Passthrough:
/// the request itself, one segment per allocation.
[[nodiscard]] constexpr std::size_t segment_size_for(std::size_t rounded, bool exact,
                                                     pool_options const& o) noexcept
{
  if (o.mode != pool_mode::pool) { return rounded; }
  if (rounded <= o.small_request) { return o.small_segment; }
  if (!exact && rounded <= o.large_segment / 2) { return o.large_segment; }
  return round_up(rounded, large_granularity);
}

}  // namespace emmpool::detail
