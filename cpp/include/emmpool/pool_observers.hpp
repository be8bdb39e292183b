/**
 * @file pool_observers.hpp
 * @brief What a device pool records when asked: its allocations and frees (a trace, for
 * replays) and the memory it takes from and gives back to the driver (segment events, a
 * memory history's segment actions).
 *
 * A view of one pool (device_pool.hpp), made where needed
 * (`pool_observers{pool}.set_tracing(true)`): it holds nothing of its own and takes the pool's
 * lock for each call (a friend of the pool's; the pool never calls it). Off, each costs the
 * pool one branch per call.
 */
#pragma once

#include <emmpool/detail/trace_log.hpp>
#include <emmpool/pool_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace emmpool {

class device_pool;

class pool_observers {
 public:
  explicit pool_observers(device_pool& pool) noexcept : pool_{&pool} {}

  /// @brief Start or stop recording allocations and frees.
  void set_tracing(bool on);
  /// @brief The records since the last call, oldest first; the trace keeps running.
  [[nodiscard]] std::vector<trace_record> take_trace();

  /// @brief Start or stop recording segment events: segments made and released, pages of the
  /// growable segment mapped and unmapped.
  void set_segment_events(bool on);
  /// @brief The oldest events not taken yet, at most `max` (the log keeps at most
  /// detail::segment_log::kept between takes).
  [[nodiscard]] std::vector<segment_event> take_segment_events(std::size_t max = SIZE_MAX);

 private:
  device_pool* pool_;
};

}  // namespace emmpool
