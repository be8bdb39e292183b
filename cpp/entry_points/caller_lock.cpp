#include "caller_lock.hpp"

#include <atomic>

#include <unistd.h>

namespace emmpool::caller_lock {
namespace {

std::atomic<void* (*)() noexcept> release_fn{nullptr};
std::atomic<void (*)(void*)> restore_fn{nullptr};

}  // namespace

void install(functions f) noexcept
{
  // restore first: a thread that sees the new release also sees its restore.
  restore_fn.store(f.restore, std::memory_order_release);
  release_fn.store(f.release, std::memory_order_release);
}

void* release() noexcept
{
  auto* const f = release_fn.load(std::memory_order_acquire);
  return f != nullptr ? f() : nullptr;
}

void restore(void* token)
{
  if (token == nullptr) { return; }
  try {
    restore_fn.load(std::memory_order_acquire)(token);
  }
#if defined(__GLIBCXX__)
  catch (abi::__forced_unwind const&) {  // the interpreter ends this thread: see the header
    for (;;) { ::pause(); }
  }
#endif
}

}  // namespace emmpool::caller_lock
