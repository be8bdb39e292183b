// PyTorch's accumulated statistics (the "allocated" and "freed" values and the counts of
// torch.cuda.memory_stats(), which torch.cuda.reset_accumulated_memory_stats() starts again)
// over a device pool's, which every library shares and which PyTorch's reset leaves alone:
// what was counted since a baseline taken at the reset. The one number the pool's statistics
// lack, the bytes of the blocks handed to PyTorch, is counted here as the C entry points hand
// them (c_api_torch.cpp). Internal to _core.
#pragma once

#include <emmpool/torch_api.h>

#include <cstddef>
#include <cstdint>

namespace emmpool::torch_accumulated {

/// A block of `bytes` was handed to PyTorch on `device` for a request of `requested` bytes.
/// One atomic add each.
void count(int device, std::size_t requested, std::size_t bytes) noexcept;

/// What count() added up on `device` since the process began.
struct handed {
  std::uint64_t bytes;      ///< as the pool rounds them
  std::uint64_t requested;
};
[[nodiscard]] handed handed_on(int device) noexcept;

/// `ever` (counts since the pool began) less the baseline of `device`: what was counted since
/// the last reset. A count that went down since (a block PyTorch's private pools cached at the
/// reset, freed since) is 0.
[[nodiscard]] emmpool_torch_accumulated since_reset(int device,
                                                    emmpool_torch_accumulated const& ever);

/// `ever` becomes the baseline of `device`.
void reset(int device, emmpool_torch_accumulated const& ever);

}  // namespace emmpool::torch_accumulated
