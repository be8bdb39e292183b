/**
 * @file pool_fixture.hpp
 * @brief What the device_pool tests share: a pool over its own host_driver, on the segments the
 * run tests, and the byte accounting every consistency() check starts from.
 *
 * Segments: the pool-level test binaries run twice (cpp/tests/CMakeLists.txt): as they are,
 * pools get pool_options' default, growable segments; under --variant=fixed (check.hpp),
 * fixed ones. A test asks which with test::growable_run(), and one written for one kind only
 * says so with TEST_ONLY(name, "fixed") or TEST_ONLY(name, "").
 *
 * Each test file keeps its own consistency() for what only it checks (tags, segment counts,
 * peaks). No CHECK here: check.hpp defines main() and belongs to the test file.
 */
#pragma once

#include "check.hpp"

#include <emmpool/device_pool.hpp>
#include <emmpool/host_driver.hpp>
#include <emmpool/pool_controls.hpp>
#include <emmpool/pool_observers.hpp>
#include <emmpool/pool_queries.hpp>
#include <emmpool/pool_sharing.hpp>
#include <emmpool/stats.hpp>

#include <cstddef>
#include <memory>
#include <string>

namespace emmpool::test {

/// Shorthands for the owners of a free (block_owner): a reset generation, a library.
[[nodiscard]] inline constexpr block_owner gen(std::uint64_t g) noexcept
{
  return block_owner::of_generation(g);
}
[[nodiscard]] inline constexpr block_owner lib(alloc_tag t) noexcept
{
  return block_owner::of_library(t);
}

inline constexpr std::size_t default_capacity = std::size_t{1} << 34;  // host_driver's default

/// Whether this run tests growable segments (the default), not --variant=fixed.
[[nodiscard]] inline bool growable_run() { return ::check::variant() != "fixed"; }

/// `o` on the segments this run tests: fixed under --variant=fixed, else as given (the default
/// growable, or what a growable-only test asked for).
[[nodiscard]] inline pool_options for_this_run(pool_options o)
{
  if (!growable_run()) { o.segments = segment_kind::fixed; }
  return o;
}

/// A pool over its own host_driver (declared first: it must outlive the pool).
struct pool_fixture {
  host_driver drv;
  std::unique_ptr<device_pool> pool;
  /// @param capacity bytes the driver hands out before it reports out of memory
  /// @param vmm off: a device without virtual memory management (growable falls back to fixed)
  explicit pool_fixture(pool_options options = {}, std::size_t capacity = default_capacity,
                        bool vmm = true)
    : drv{1, capacity}
  {
    drv.set_vmm_supported(vmm);  // before the pool, which asks when it is built
    pool = std::make_unique<device_pool>(drv, 0, for_this_run(options));
  }
  device_pool* operator->() { return pool.get(); }
  // The pool's views (pool_controls.hpp, ...), as the tests reach them.
  pool_controls controls() { return pool_controls{*pool}; }
  pool_queries queries() { return pool_queries{*pool}; }
  pool_sharing sharing() { return pool_sharing{*pool}; }
  pool_observers observers() { return pool_observers{*pool}; }
};

/// Every byte of the pool is in use, waiting or free (free counts only mapped bytes of a
/// growable segment); the driver holds what the pool reserved: its fixed segments plus its
/// mapped pages (host_driver counts them apart). Takes one snapshot of each, which the
/// caller's own checks share. Returns the problems found, "" if none.
/// @param driver_matches false once a reset retired segments the pool no longer counts
inline std::string byte_accounting(pool_stats const& s, host_driver::counters const& c,
                                   bool driver_matches = true)
{
  std::string problems;
  if (s.bytes_in_use + s.bytes_waiting + s.bytes_free != s.bytes_reserved) {
    problems += "in_use " + std::to_string(s.bytes_in_use) + " + waiting " +
                std::to_string(s.bytes_waiting) + " + free " + std::to_string(s.bytes_free) +
                " != reserved " + std::to_string(s.bytes_reserved) + "; ";
  }
  if (driver_matches && c.bytes_reserved + c.bytes_physical != s.bytes_reserved) {
    problems += "driver holds segments " + std::to_string(c.bytes_reserved) + " + pages " +
                std::to_string(c.bytes_physical) + " != pool reserved " +
                std::to_string(s.bytes_reserved) + "; ";
  }
  return problems;
}

}  // namespace emmpool::test
