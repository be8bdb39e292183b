#include <emmpool/error.hpp>
#include <emmpool/stats.hpp>

#include <cstdint>

namespace emmpool {

std::string describe(pool_stats const& s, int device, std::size_t cap)
{
  using detail::human_bytes;
  std::string d = "pool on device " + std::to_string(device) + " holds " +
                  human_bytes(s.bytes_reserved) + " in " + std::to_string(s.segments) +
                  " segments: " + human_bytes(s.bytes_in_use) + " in use, " +
                  human_bytes(s.bytes_free) + " free (largest block " +
                  human_bytes(s.largest_free_block) + "), " + human_bytes(s.bytes_waiting) +
                  " waiting for pending frees";
  if (cap != SIZE_MAX) { d += "; cap " + human_bytes(cap); }
  return d;
}

}  // namespace emmpool
