/**
 * @file detail/fork_guard.hpp
 * @brief Pools and fork(): hold every registered pool's mutex across fork() (pthread_atfork),
 * release them in parent and child, and in the child set each pool's `forked` flag, so that
 * no child inherits a mutex another thread held and every pool knows to stay away from CUDA.
 */
#pragma once

#include <emmpool/detail/pool_mutex.hpp>

namespace emmpool::detail {

/// @brief Register a pool's mutex and flag (installs the atfork handlers on first use).
void register_for_fork(pool_mutex* mutex, bool* forked);
void unregister_for_fork(pool_mutex* mutex);

/// @brief Throws the pool_error a forked child gets when it asks a pool for memory.
[[noreturn]] void throw_forked();

}  // namespace emmpool::detail
