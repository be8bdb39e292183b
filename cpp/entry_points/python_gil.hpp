// Whether the calling thread holds the GIL, and letting go of it for a while: what the C entry
// points, which CuPy and PyTorch call from C with or without it, need to know and do. Internal
// to the Python extension.
#pragma once

#include <Python.h>

namespace emmpool::python {

/// @brief True only if this thread holds the GIL. Not PyGILState_Check(), which answers 1 for
/// every thread once a sub-interpreter was made, and without an interpreter at all: letting go
/// of a GIL not held aborts the process.
[[nodiscard]] inline bool holds_gil() noexcept
{
  if (Py_IsInitialized() == 0) { return false; }
#if PY_VERSION_HEX >= 0x030D0000
  return PyThreadState_GetUnchecked() != nullptr;  // this thread's, attached: the GIL is held
#elif PY_VERSION_HEX >= 0x030C0000
  return _PyThreadState_UncheckedGet() != nullptr;
#else
  // 3.10 and 3.11: the thread state that holds the GIL, whichever thread's: is it this one's?
  PyThreadState* const current = _PyThreadState_UncheckedGet();
  return current != nullptr && current == PyGILState_GetThisThreadState();
#endif
}

[[nodiscard]] inline bool finalizing() noexcept
{
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

/// @brief Let go of the GIL if this thread holds it and the interpreter is not finalizing;
/// what to pass to take_gil_back() (nullptr: nothing was let go of).
[[nodiscard]] inline void* let_go_of_gil() noexcept
{
  if (!holds_gil() || finalizing()) { return nullptr; }
  return PyEval_SaveThread();
}

/// @brief Take the GIL back. Once the interpreter finalizes this ends a daemon thread (Python
/// before 3.14: pthread_exit), unwinding every frame above: see caller_lock.hpp.
inline void take_gil_back(void* state)
{
  if (state != nullptr) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); }
}

}  // namespace emmpool::python
