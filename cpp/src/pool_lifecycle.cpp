#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/detail/pool_lifecycle.hpp>

namespace emmpool::detail {

pool_lifecycle::pool_lifecycle() { register_for_fork(&mutex_, &forked_); }

pool_lifecycle::~pool_lifecycle() { unregister_for_fork(&mutex_); }

}  // namespace emmpool::detail
