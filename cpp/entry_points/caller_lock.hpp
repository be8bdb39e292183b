// The caller's own lock — Python's GIL — let go of while the pool may wait. Internal to the
// extension: the core knows no Python; the extension installs the GIL here (module.cpp).
//
// CuPy calls its allocator holding the GIL, PyTorch at times, Numba's entry points always.
// Held while waiting for the pool's lock (whose holder may be waiting for GPU work queued behind
// a host callback that needs the GIL) or for the GPU (the same callback), it deadlocks. So every
// entry point first tries the pool without waiting, holding it, and otherwise works through
// without_caller_lock().
//
// Taking the GIL back would end the thread once the interpreter finalizes: Python before 3.14
// ends a daemon thread that asks for it (pthread_exit, a forced unwind through every frame
// above), and that unwind aborts the process (std::terminate) where it meets a noexcept frame
// or a destructor, which the callers' are at every free (PyTorch's DataPtr deleter, RMM's and
// CCCL's deallocate, Cython's __dealloc__). So restore() stops that unwind where it starts and
// the thread waits there for the process to exit, holding no GIL and no lock of emmpool's, as
// Python 3.14 has such threads wait itself. The rest stays as careful as if it might unwind
// (another cause, pthread_cancel): the lock is taken back outside any destructor or catch
// block; no entry point is noexcept; every catch (...) on the way is preceded by
// EMMPOOL_LET_THREAD_END.
#pragma once

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__GLIBCXX__)
#include <cxxabi.h>
/// Before a catch (...) that a thread's end (pthread_exit) may unwind through: let it go on.
#define EMMPOOL_LET_THREAD_END \
  catch (abi::__forced_unwind const&) { throw; }
#else
#define EMMPOOL_LET_THREAD_END
#endif

namespace emmpool::caller_lock {

/// `release` lets go of the lock if the calling thread holds it and returns what `restore`
/// takes it back with (nullptr: it was not held, nothing to take back).
struct functions {
  void* (*release)() noexcept;
  void (*restore)(void* token);
};
/// Install them (once, at the extension's import); none by default: nothing is let go of.
void install(functions f) noexcept;

void* release() noexcept;
void restore(void* token);

/// @brief work() with the caller's lock let go of, then taken back; work's result, or its
/// exception rethrown once the lock is back.
template <class Work>
auto without_caller_lock(Work&& work) -> decltype(work())
{
  using result = decltype(work());
  if constexpr (std::is_void_v<result>) {
    without_caller_lock([&] {
      work();
      return true;
    });
  } else {
    void* const token = release();
    if (token == nullptr) { return work(); }
    std::optional<result> out;
    std::exception_ptr failure;
    try {
      out.emplace(work());
    } catch (...) {
      failure = std::current_exception();
    }
    restore(token);  // not in a destructor or a catch block: the header says why
    if (failure) { std::rethrow_exception(failure); }
    return std::move(*out);
  }
}

}  // namespace emmpool::caller_lock
