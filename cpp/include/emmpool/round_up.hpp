/**
 * @file round_up.hpp
 * @brief A size rounded up to a multiple, and how many multiples cover it: the one way
 * emmpool's sources write them, the core's and the PyTorch extension's (which ships this
 * header beside emmpool/torch_api.h).
 */
#pragma once

#include <cstddef>

namespace emmpool {

/// @brief How many multiples of `multiple` cover `n` bytes (0 for 0): n / multiple, rounded
/// up. `multiple` must be above 0, and `n + multiple - 1` must fit in a size_t: a size that
/// comes from a caller is checked against that first.
[[nodiscard]] constexpr std::size_t multiples_covering(std::size_t n,
                                                       std::size_t multiple) noexcept
{
  return (n + multiple - 1) / multiple;
}

/// @brief The least multiple of `multiple` that is at least `n` (0 for 0), a power of two or
/// not; the same limits as multiples_covering().
[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t multiple) noexcept
{
  return multiples_covering(n, multiple) * multiple;
}

static_assert(round_up(0, 256) == 0 && round_up(1, 256) == 256 && round_up(256, 256) == 256 &&
              round_up(257, 256) == 512 && round_up(7, 3) == 9);
static_assert(multiples_covering(0, 20) == 0 && multiples_covering(20, 20) == 1 &&
              multiples_covering(21, 20) == 2);

}  // namespace emmpool
