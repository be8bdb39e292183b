// Tests of the pinned-host cache over host_driver (real malloc'ed memory; no GPU). The pool's
// Python-level behaviour is also tested in tests/test_pinned_pool_host.py; these run under the
// sanitizers, the stress test under TSan in particular.
#include "check.hpp"

#include <emmpool/error.hpp>
#include <emmpool/host_driver.hpp>
#include <emmpool/host_pool.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

using namespace emmpool;

namespace {
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
}  // namespace

TEST(host_size_classes)
{
  CHECK_EQ(host_pool::size_class(0), 4 * KiB);
  CHECK_EQ(host_pool::size_class(4 * KiB + 1), 5 * KiB);
  CHECK_EQ(host_pool::size_class(MiB), MiB);
  CHECK_EQ(host_pool::size_class(MiB + 1), MiB + MiB / 4);
  for (std::size_t n = 5000; n < 64 * MiB; n = n * 3 / 2) {
    auto const c = host_pool::size_class(n);
    CHECK(c >= n && c <= n + n / 4 + 4 * KiB);
  }
}

TEST(host_reuse_only_after_the_fence)
{
  host_driver drv{1, MiB};
  host_pool pool{drv, 0, 64 * MiB};
  void* p = pool.allocate(100 * KiB, 0);
  std::memset(p, 0x5a, 100 * KiB);  // real memory: ASan would catch an overrun
  pool.deallocate(p);
  void* q = pool.allocate(100 * KiB, 0);  // fence recorded now, not complete
  CHECK_NE(q, p);
  drv.complete_all_events();
  void* r = pool.allocate(100 * KiB, 0);
  CHECK_EQ(r, p);
  auto const s = pool.stats();
  CHECK_EQ(s.cache_hits, 1u);
  CHECK_EQ(s.driver_allocations, 2u);
  pool.deallocate(q);
  pool.deallocate(r);
  CHECK_EQ(pool.trim(), 2 * host_pool::size_class(100 * KiB));
  CHECK_EQ(pool.stats().bytes_held, 0u);
}

TEST(host_limit_ladder_and_error)
{
  host_driver drv{1, MiB};
  host_pool pool{drv, 0, 8 * MiB};
  void* a = pool.allocate(4 * MiB, host_mapped);
  void* b = pool.allocate(3 * MiB, host_mapped);
  pool.deallocate(b);  // pending
  void* c = pool.allocate(4 * MiB, 0);  // fits after waiting for b and returning it
  CHECK(drv.stats().event_syncs >= 1);
  CHECK_EQ(pool.stats().driver_frees, 1u);
  CHECK_THROWS(pool.allocate(MiB, 0), out_of_memory);
  pool.deallocate(a);
  pool.deallocate(c);
  CHECK(pool.allocate(MiB, 0) != nullptr);  // usable right after
}

TEST(host_register_is_passed_through)
{
  host_driver drv{1, MiB};
  host_pool pool{drv, 0, 0};
  std::vector<char> buf(1 << 16);
  pool.register_memory(buf.data(), buf.size(), host_mapped);
  CHECK_THROWS(pool.register_memory(buf.data(), buf.size(), 0), cuda_error);
  pool.unregister_memory(buf.data());
  CHECK_THROWS(pool.unregister_memory(buf.data()), pool_error);
  CHECK_EQ(pool.stats().bytes_registered, 0u);
}

TEST(host_stress_threads)
{
  // Deterministic per thread (fixed seeds), not a benchmark: 4 threads allocate, write and
  // free; a fifth completes fences now and then. At the end nothing is in use and a trim
  // returns everything.
  host_driver drv{1, MiB};
  host_pool pool{drv, 0, 256 * MiB};
  std::atomic<bool> stop{false};
  std::thread completer{[&] {
    while (!stop.load()) {
      drv.complete_all_events();
      std::this_thread::yield();
    }
  }};
  std::vector<std::thread> workers;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      std::uniform_int_distribution<std::size_t> size(1, 2 * MiB);
      std::vector<std::pair<char*, std::size_t>> held;
      for (int i = 0; i < 5000; ++i) {
        if (held.size() < 8) {
          std::size_t const n = size(rng);
          try {
            auto* p = static_cast<char*>(pool.allocate(n, static_cast<unsigned>(rng() % 2) * host_mapped));
            std::memset(p, t, std::min<std::size_t>(n, 64));
            held.emplace_back(p, n);
          } catch (out_of_memory const&) {
            ++errors;
          }
        } else {
          auto [p, n] = held[rng() % held.size()];
          if (p[0] != static_cast<char>(t)) { ++errors; }  // another thread wrote our block
          pool.deallocate(p);
          held.erase(std::find(held.begin(), held.end(), std::make_pair(p, n)));
        }
      }
      for (auto& [p, n] : held) { pool.deallocate(p); }
    });
  }
  for (auto& w : workers) { w.join(); }
  stop.store(true);
  completer.join();
  CHECK_EQ(errors.load(), 0);
  CHECK_EQ(pool.stats().bytes_in_use, 0u);
  pool.trim();
  CHECK_EQ(pool.stats().bytes_held, 0u);
}
