#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/error.hpp>

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace emmpool::detail {

namespace {

// Never destroyed: atfork handlers may run while the process exits.
std::mutex& list_mutex()
{
  static auto* m = new std::mutex{};
  return *m;
}

std::vector<std::pair<pool_mutex*, bool*>>& pools()
{
  static auto* v = new std::vector<std::pair<pool_mutex*, bool*>>{};
  return *v;
}

void prepare()
{
  list_mutex().lock();
  for (auto& [m, f] : pools()) { m->lock(); }
}

void parent()
{
  for (auto& [m, f] : pools()) { m->unlock(); }
  list_mutex().unlock();
}

void child()
{
  for (auto& [m, f] : pools()) {
    *f = true;
    m->unlock();
  }
  list_mutex().unlock();
}

}  // namespace

void register_for_fork(pool_mutex* mutex, bool* forked)
{
  static std::once_flag installed;
  std::call_once(installed, [] { ::pthread_atfork(&prepare, &parent, &child); });
  std::lock_guard lock{list_mutex()};
  pools().emplace_back(mutex, forked);
}

void unregister_for_fork(pool_mutex* mutex)
{
  std::lock_guard lock{list_mutex()};
  auto& v = pools();
  v.erase(std::remove_if(v.begin(), v.end(), [mutex](auto const& p) { return p.first == mutex; }),
          v.end());
}

void throw_forked()
{
  throw pool_error{
    "emmpool: this process was forked after its parent used the GPU, and CUDA cannot be used "
    "in such a child; start worker processes with multiprocessing's 'spawn' (or "
    "'forkserver') method instead"};
}

}  // namespace emmpool::detail
