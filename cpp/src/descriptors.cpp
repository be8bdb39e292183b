#include <emmpool/detail/descriptors.hpp>
#include <emmpool/error.hpp>

#include <string>

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

namespace emmpool::detail {

std::size_t open_descriptors()
{
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) { return 0; }  // no /proc: the limit itself decides
  std::size_t n = 0;
  while (auto const* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') { ++n; }
  }
  ::closedir(dir);
  return n > 0 ? n - 1 : 0;  // the directory's own descriptor, open while it was read
}

void reserve_descriptors(std::size_t n, char const* what)
{
  rlimit limit{};
  if (n == 0 || ::getrlimit(RLIMIT_NOFILE, &limit) != 0) { return; }
  auto const wanted = open_descriptors() + n + descriptor_margin;
  if (limit.rlim_cur == RLIM_INFINITY || wanted <= limit.rlim_cur) { return; }
  if (limit.rlim_max == RLIM_INFINITY || wanted <= limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = static_cast<rlim_t>(wanted);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) { return; }
  }
  throw pool_error{"emmpool: " + std::string{what} + " needs " + std::to_string(n) +
                   " file descriptors, and this process has " +
                   std::to_string(open_descriptors()) + " open of the " +
                   std::to_string(limit.rlim_cur) + " it may open (hard limit " +
                   (limit.rlim_max == RLIM_INFINITY ? std::string{"unlimited"}
                                                    : std::to_string(limit.rlim_max)) +
                   "): raise the limit (ulimit -n, or the container's nofile limit), or share "
                   "smaller blocks (one descriptor per page of EMMPOOL_GROWABLE_PAGE_SIZE)"};
}

void close_descriptors(std::vector<int> const& fds) noexcept
{
  for (int fd : fds) { ::close(fd); }
}

}  // namespace emmpool::detail
