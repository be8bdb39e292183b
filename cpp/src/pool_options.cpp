#include <emmpool/error.hpp>
#include <emmpool/pool_options.hpp>

namespace emmpool {

void pool_options::check() const
{
  EMMPOOL_EXPECTS(maximum_fraction >= 0.0 && maximum_fraction <= 1.0,
                  "maximum_fraction must lie in [0, 1]");
  EMMPOOL_EXPECTS(small_request % block_alignment == 0 && small_request > 0,
                  "small_request must be a positive multiple of 256");
  EMMPOOL_EXPECTS(small_segment % block_alignment == 0 && small_segment >= small_request,
                  "small_segment must be a multiple of 256 and at least small_request");
  EMMPOOL_EXPECTS(large_segment % block_alignment == 0 && large_segment > small_request,
                  "large_segment must be a multiple of 256 larger than small_request");
  EMMPOOL_EXPECTS(growable_page_size <= max_growable_page_size,
                  "growable_page_size must be at most 1 GiB");
}

}  // namespace emmpool
