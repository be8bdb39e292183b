// The pools' mutex, its contended half (detail/pool_mutex.hpp).
#include <emmpool/detail/pool_mutex.hpp>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <thread>
#endif

namespace emmpool::detail {

namespace {

void cpu_relax() noexcept
{
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

#if defined(__linux__)
static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free,
              "the futex word is the atomic's int");

int* futex_word(std::atomic<int>& a) noexcept { return reinterpret_cast<int*>(&a); }
#endif

}  // namespace

void pool_mutex::lock_contended() noexcept
{
  // Most critical sections are short (an allocate's or a free's: bench_core times them): spin
  // a little (64 pauses: far less than a sleep and a wake-up cost) before sleeping.
  for (int i = 0; i < 64; ++i) {
    cpu_relax();
    int expected = unlocked;
    if (state_.load(std::memory_order_relaxed) == unlocked &&
        state_.compare_exchange_weak(expected, locked, std::memory_order_acquire,
                                     std::memory_order_relaxed)) {
      return;
    }
  }
  // From here on the lock is taken as waited_for even when free: unlock() cannot tell whether
  // other waiters still sleep, so it wakes one more than needed at worst, never one less.
  while (state_.exchange(waited_for, std::memory_order_acquire) != unlocked) {
#if defined(__linux__)
    // Sleeps only while the word is still waited_for: an unlock in between returns at once.
    ::syscall(SYS_futex, futex_word(state_), FUTEX_WAIT_PRIVATE, waited_for, nullptr, nullptr, 0);
#else
    std::this_thread::yield();
#endif
  }
}

void pool_mutex::wake_one() noexcept
{
#if defined(__linux__)
  ::syscall(SYS_futex, futex_word(state_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
#endif
}

}  // namespace emmpool::detail
