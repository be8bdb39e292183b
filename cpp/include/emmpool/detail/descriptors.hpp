/**
 * @file detail/descriptors.hpp
 * @brief This process's budget of file descriptors (RLIMIT_NOFILE), asked before IPC opens
 * many at once: a growable block shares one descriptor per page (an 8 GiB block of 20 MiB pages
 * is 410 of them), and a process that runs out part way has to undo what it did. So each step
 * that opens `n` descriptors asks first: the soft limit is raised toward the hard one where
 * they would not fit, and where even the hard one is too low the step is refused, saying so,
 * before it opened any.
 */
#pragma once

#include <cstddef>
#include <vector>

namespace emmpool::detail {

/// @brief Descriptors this process holds open now (/proc/self/fd).
[[nodiscard]] std::size_t open_descriptors();

/// @brief Make room for `n` more open descriptors than are open now (and a margin for the rest
/// of the program): the soft RLIMIT_NOFILE is raised toward the hard limit where they would
/// not fit.
/// @param what what needs them, for the error ("mapping 410 pages of a shared block")
/// @throws pool_error naming the limits and what to do, when the hard limit is too low
void reserve_descriptors(std::size_t n, char const* what);

/// @brief Close every descriptor of `fds` (this process's own copies), ignoring errors: what each
/// IPC step does with the copies it made or received once they served, or when it fails.
void close_descriptors(std::vector<int> const& fds) noexcept;

/// @brief What reserve_descriptors() keeps free beyond a request: descriptors the rest of the
/// program opens meanwhile (a log file, a socket, an import's own).
inline constexpr std::size_t descriptor_margin = 32;

}  // namespace emmpool::detail
