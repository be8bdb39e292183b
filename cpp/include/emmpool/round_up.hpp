/**
 * @file round_up.hpp
 * @brief A size rounded up to a multiple: the one way emmpool's sources write it, the core's
 * and the PyTorch extension's (which ships this header beside emmpool/torch_api.h).
 */
#pragma once

#include <cstddef>

namespace emmpool {

/// @brief The least multiple of `multiple` that is at least `n` (0 for 0). `multiple` must be
/// above 0, a power of two or not, and `n + multiple - 1` must fit in a size_t: a size that
/// comes from a caller is checked against that first.
[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t multiple) noexcept
{
  return (n + multiple - 1) / multiple * multiple;
}

static_assert(round_up(0, 256) == 0 && round_up(1, 256) == 256 && round_up(256, 256) == 256 &&
              round_up(257, 256) == 512 && round_up(7, 3) == 9);

}  // namespace emmpool
