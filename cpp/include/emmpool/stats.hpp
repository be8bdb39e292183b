/**
 * @file stats.hpp
 * @brief Counters a device_pool keeps, read as one consistent snapshot.
 */
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace emmpool {

/// @brief Who asked for a block: statistics are broken down by library.
enum class alloc_tag : std::uint8_t { other = 0, numba = 1, cupy = 2, torch = 3, rmm = 4,
                                      cuda_core = 5 };
inline constexpr std::size_t alloc_tag_count = 6;
/// @brief The names of the tags, in order: what statistics, traces and Python call them.
inline constexpr char const* alloc_tag_names[alloc_tag_count] = {"other", "numba", "cupy",
                                                                 "torch", "rmm", "cuda_core"};

/// @brief A snapshot of one device pool. Sizes are in bytes, as the pool rounds them (256 B).
struct pool_stats {
  std::size_t bytes_in_use{};        ///< held by callers
  std::size_t peak_bytes_in_use{};
  std::size_t bytes_reserved{};      ///< obtained from the driver: fixed segments, and the
                                     ///< pages mapped in growable ones (memory, not addresses)
  std::size_t peak_bytes_reserved{};
  std::size_t bytes_waiting{};       ///< freed, waiting for their fences (reuse_rule.hpp)
  std::size_t bytes_free{};          ///< in the free lists, reusable now
  std::size_t largest_free_block{};
  std::size_t blocks_in_use{};
  std::size_t blocks_waiting{};      ///< records waiting (neighbours freed together join)
  std::size_t segments{};
  std::uint64_t allocations{};       ///< successful allocate() calls
  std::uint64_t frees{};             ///< deallocate() calls
  std::uint64_t segment_allocations{};
  std::uint64_t segment_releases{};
  std::uint64_t batches_closed{};    ///< events recorded to fence freed blocks
  std::uint64_t fence_queries{};     ///< fences asked whether they completed (cuEventQuery)
  std::uint64_t same_stream_reuses{};  ///< blocks handed out again in stream order, unfenced
  std::uint64_t dormant_fences{};    ///< device synchronizations that fenced frees of streams
                                     ///< that may be gone (reuse_rule.hpp)
  std::uint64_t fence_waits{};       ///< allocations that waited for every pending free (each
                                     ///< pending fence synchronized: the ladder's step 4)
  std::uint64_t out_of_memory{};     ///< times the whole ladder failed (a request retried
                                     ///< after an out-of-memory callback counts each time)
  std::uint64_t page_maps{};         ///< growable segments: pages mapped (cuMemMap)
  std::uint64_t page_unmaps{};       ///< growable segments: pages unmapped (cuMemUnmap)
  std::uint64_t page_creates{};      ///< growable segments: pages made (cuMemCreate); a map
                                     ///< without one moved a page freed elsewhere
  std::uint64_t page_releases{};     ///< growable segments: pages released (cuMemRelease)
  std::array<std::size_t, alloc_tag_count> bytes_in_use_by_tag{};
  std::array<std::uint64_t, alloc_tag_count> allocations_by_tag{};

  /// @brief Count a block of `size` bytes of library `tag` handed out (an allocation).
  void count_allocation(std::size_t size, std::uint8_t tag) noexcept
  {
    bytes_in_use += size;
    peak_bytes_in_use = peak_bytes_in_use > bytes_in_use ? peak_bytes_in_use : bytes_in_use;
    ++blocks_in_use;
    ++allocations;
    bytes_in_use_by_tag[tag] += size;
    ++allocations_by_tag[tag];
  }
  /// @brief Count a free of a block in use.
  void count_free(std::size_t size, std::uint8_t tag) noexcept
  {
    count_out_of_use(size, tag);
    ++frees;
  }
  /// @brief Count a block no longer in use (freed, or retired by a reset).
  void count_out_of_use(std::size_t size, std::uint8_t tag) noexcept
  {
    bytes_in_use -= size;
    --blocks_in_use;
    bytes_in_use_by_tag[tag] -= size;
  }
};

/// @brief One line saying what a pool holds, for error messages: its statistics `s` (a full
/// snapshot: device_pool::stats()), its device, and its cap on reserved bytes (SIZE_MAX: none).
[[nodiscard]] std::string describe(pool_stats const& s, int device, std::size_t cap);

}  // namespace emmpool
