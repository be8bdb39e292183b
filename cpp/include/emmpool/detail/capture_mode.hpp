/**
 * @file detail/capture_mode.hpp
 * @brief When a pool must keep its hands off the driver, and what waits meanwhile.
 *
 * Two reasons, which nest and overlap:
 *  - cleanup deferred (Numba's defer_cleanup; both pools): nothing goes back to the driver
 *    (cuMemFree synchronizes the device), blocks still flow back into the pool;
 *  - a CUDA graph being captured on the device (PyTorch's private pools say when; device pools
 *    only): beside that, no CUDA call that a capture forbids or would record into the graph:
 *    no event query, record or synchronization. Blocks freed with a record_stream fence wait,
 *    unfenced, until the last capture ended (their first fence is an event recorded at the
 *    free); growth still asks the driver (the driver seam relaxes the calling thread's
 *    capture mode for those calls, cuda_driver.cpp).
 *
 * State only: the pool asks it what it may do, and settles what it held once it may. Not
 * thread-safe: the pool's mutex.
 */
#pragma once

#include <emmpool/detail/block.hpp>
#include <emmpool/detail/stream_key.hpp>
#include <emmpool/error.hpp>

#include <utility>
#include <vector>

namespace emmpool::detail {

/// @brief Nested cleanup deferrals: while any is in force, nothing goes back to the driver.
class cleanup_deferrals {
 public:
  void begin() noexcept { ++count_; }
  /// @return whether that ended the last deferral
  bool end()
  {
    EMMPOOL_EXPECTS(count_ > 0, "defer_cleanup_end without defer_cleanup_begin");
    return --count_ == 0;
  }
  [[nodiscard]] bool active() const noexcept { return count_ > 0; }
  /// For a reset, which frees what it can regardless: run f with no deferral in force,
  /// ignoring its errors (the context is going anyway).
  template <class F>
  void lifted(F&& f) noexcept
  {
    int const count = std::exchange(count_, 0);
    try {
      f();
    } catch (...) {
    }
    count_ = count;
  }

 private:
  int count_{};
};

class capture_mode {
 public:
  // ---- defer_cleanup --------------------------------------------------------------------------
  void defer_cleanup_begin() noexcept { deferrals_.begin(); }
  /// @return whether no deferral (nor capture) is left in force
  bool defer_cleanup_end() { return deferrals_.end(); }
  [[nodiscard]] cleanup_deferrals& deferrals() noexcept { return deferrals_; }

  // ---- captures -------------------------------------------------------------------------------
  /// A capture begins: until its end, the rules of both reasons.
  void capture_begin() noexcept
  {
    ++captures_;
    deferrals_.begin();
  }
  struct ended {
    bool last_capture;   ///< the blocks held for it may be settled now
    bool last_deferral;  ///< what a deferral held back may go to the driver now
  };
  /// @throws pool_error without a matching capture_begin()
  ended capture_end(int device);
  [[nodiscard]] bool capturing() const noexcept { return captures_ > 0; }

  // ---- what the pool may do now ---------------------------------------------------------------
  /// Query, record or wait for events, or synchronize.
  [[nodiscard]] bool may_fence() const noexcept { return captures_ == 0; }
  /// Give memory back to the driver.
  [[nodiscard]] bool may_give_back() const noexcept { return !deferrals_.active(); }

  // ---- held until the last capture ends -------------------------------------------------------
  /// blk was freed on key with a record_stream fence during a capture.
  void hold(block* blk, stream_ref key) { held_.emplace_back(blk, key); }
  [[nodiscard]] bool holds_any() const noexcept { return !held_.empty(); }
  /// The newest held block (settle it, then pop_held(): what a failure leaves stays held).
  [[nodiscard]] std::pair<block*, stream_ref> newest_held() const { return held_.back(); }
  void pop_held() noexcept { held_.pop_back(); }

 private:
  int captures_{};
  cleanup_deferrals deferrals_;
  std::vector<std::pair<block*, stream_ref>> held_;
};

inline capture_mode::ended capture_mode::capture_end(int device)
{
  if (captures_ == 0) {
    throw pool_error{"emmpool: capture_end without capture_begin on device " +
                     std::to_string(device)};
  }
  --captures_;
  bool const last_deferral = deferrals_.end();
  return {captures_ == 0, last_deferral};
}

}  // namespace emmpool::detail
