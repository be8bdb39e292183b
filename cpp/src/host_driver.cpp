#include <emmpool/error.hpp>
#include <emmpool/host_driver.hpp>
#include <emmpool/round_up.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace emmpool {

namespace {
constexpr std::size_t granularity = std::size_t{2} << 20;
constexpr int invalid_value_code  = 1;    // CUDA_ERROR_INVALID_VALUE
constexpr int injected_code       = 999;  // CUDA_ERROR_UNKNOWN
}  // namespace

host_driver::host_driver(int devices, std::size_t capacity)
  : devices_{devices},
    capacity_(static_cast<std::size_t>(devices), capacity),
    used_(static_cast<std::size_t>(devices), 0)
{
  EMMPOOL_EXPECTS(devices > 0, "host_driver needs at least one device");
  // Each device gets its own far-apart range, so addresses never collide across devices.
  for (int d = 0; d < devices; ++d) {
    next_address_.push_back((device_ptr{0x10} + static_cast<device_ptr>(d)) << 40);
  }
}

host_driver::~host_driver()
{
  for (auto& [p, n] : host_allocations_) { std::free(p); }
  for (auto const& e : exports_) { ::close(e.kept); }
}

void host_driver::check_device(int device) const
{
  if (device < 0 || device >= devices_) {
    throw cuda_error{"cuDeviceGet", 101, "CUDA_ERROR_INVALID_DEVICE", EMMPOOL_WHERE};
  }
}

void host_driver::complete_all_events()
{
  std::lock_guard lock{mutex_};
  for (auto& [e, done] : events_) { done = true; }
}

void host_driver::set_auto_complete(bool on)
{
  std::lock_guard lock{mutex_};
  auto_complete_ = on;
}

void host_driver::fail_next_device_syncs(int n)
{
  std::lock_guard lock{mutex_};
  fail_device_syncs_ = n;
}

void host_driver::set_sync_wait(std::function<void()> wait)
{
  std::unique_lock lock{mutex_};
  std::swap(sync_wait_, wait);
  lock.unlock();  // the old one goes outside the lock (a Python callable's needs the GIL)
}

void host_driver::fail_next_allocations(int n)
{
  std::lock_guard lock{mutex_};
  fail_allocations_ = n;
}

void host_driver::fail_next_event_records(int n)
{
  std::lock_guard lock{mutex_};
  fail_event_records_ = n;
}

void host_driver::fail_next_deallocations(int n)
{
  std::lock_guard lock{mutex_};
  fail_deallocations_ = n;
}

void host_driver::set_capacity(int device, std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  capacity_[static_cast<std::size_t>(device)] = bytes;
}

void host_driver::invalidate_device(int device)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  for (auto it = segments_.begin(); it != segments_.end();) {
    if (it->second.device == device) {
      used_[static_cast<std::size_t>(device)] -= it->second.bytes;
      counters_.bytes_reserved -= it->second.bytes;
      --counters_.live_segments;
      it = segments_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    if (it->second.device == device) {
      counters_.bytes_mapped -= it->second.bytes;
      --counters_.live_mappings;
      it = mappings_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = handles_.begin(); it != handles_.end();) {
    if (memories_.at(it->second).device == device) {
      --counters_.live_handles;
      it = handles_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = memories_.begin(); it != memories_.end();) {
    if (it->second.device == device) {
      used_[static_cast<std::size_t>(device)] -= it->second.bytes;
      counters_.bytes_physical -= it->second.bytes;
      it = memories_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    if (it->second.device == device) {
      counters_.bytes_address_reserved -= it->second.bytes;
      --counters_.live_reservations;
      it = reservations_.erase(it);
    } else {
      ++it;
    }
  }
  // Addresses are handed out again from the start of the range, as after a real reset.
  next_address_[static_cast<std::size_t>(device)] = (device_ptr{0x10} + device) << 40;
}

host_driver::counters host_driver::stats() const
{
  std::lock_guard lock{mutex_};
  // Exported descriptors closed since the last call let their memory go now: the kernel closed
  // them already, the model only looks (so a const observer may; no host_driver is const).
  const_cast<host_driver*>(this)->reap_exports();
  auto c        = counters_;
  c.live_exports = exports_.size();
  c.live_events = events_.size();
  return c;
}

device_ptr host_driver::allocate(int device, std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  auto const d = static_cast<std::size_t>(device);
  if (fail_allocations_ > 0) {
    --fail_allocations_;
    throw out_of_memory{"host_driver: injected allocation failure"};
  }
  reap_exports();  // memory an exported descriptor held may be free now
  if (bytes == 0) {
    throw cuda_error{"cuMemAlloc", invalid_value_code, "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  }
  if (bytes > capacity_[d] - used_[d] || used_[d] > capacity_[d]) {
    throw out_of_memory{"host_driver: device " + std::to_string(device) + " is full"};
  }
  device_ptr const p = next_address_[d];
  // A gap after each segment, so a pool that coalesced across segments would be caught.
  next_address_[d] += round_up(bytes, granularity) + granularity;
  segments_.emplace(p, segment{device, bytes, next_buffer_id_++});
  used_[d] += bytes;
  ++counters_.allocations;
  counters_.bytes_reserved += bytes;
  ++counters_.live_segments;
  return p;
}

void host_driver::deallocate(int device, device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  if (fail_deallocations_ > 0) {
    --fail_deallocations_;
    throw cuda_error{"cuMemFree", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", EMMPOOL_WHERE};
  }
  auto it = segments_.find(ptr);
  if (it == segments_.end() || it->second.device != device) {
    throw cuda_error{"cuMemFree", invalid_value_code, "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  }
  used_[static_cast<std::size_t>(device)] -= it->second.bytes;
  counters_.bytes_reserved -= it->second.bytes;
  --counters_.live_segments;
  ++counters_.deallocations;
  segments_.erase(it);
}

std::uint64_t host_driver::buffer_id(int device, device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin()) { return 0; }
  --it;
  if (it->second.device != device || ptr >= it->first + it->second.bytes) { return 0; }
  return it->second.id;
}

event_handle host_driver::create_event(int device)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  auto const e = static_cast<event_handle>(next_event_++);
  events_.emplace(e, true);
  return e;
}

void host_driver::destroy_event(int, event_handle event)
{
  std::lock_guard lock{mutex_};
  if (events_.erase(event) == 0) {
    throw cuda_error{"cuEventDestroy", 400, "CUDA_ERROR_INVALID_HANDLE", EMMPOOL_WHERE};
  }
  recorded_.erase(event);
}

stream_handle host_driver::create_stream()
{
  std::lock_guard lock{mutex_};
  stream_handle s{};
  if (!reusable_handles_.empty()) {
    s = reusable_handles_.back();
    reusable_handles_.pop_back();
    dead_streams_.erase(s);
  } else {
    s = next_stream_;
    next_stream_ += 0x100;
  }
  streams_[s] = next_stream_id_++;
  return s;
}

void host_driver::destroy_stream(stream_handle stream)
{
  std::lock_guard lock{mutex_};
  if (is_context_stream(stream) || dead_streams_.count(stream) != 0) {
    ++counters_.dead_stream_uses;
    throw dead_stream_error{"host_driver: destroy_stream of stream " + std::to_string(stream) +
                            ", a context stream or one already destroyed"};
  }
  streams_.erase(stream);
  dead_streams_.insert(stream);
  reusable_handles_.push_back(stream);
}

std::uint64_t host_driver::live_stream_id(stream_handle stream, char const* call)
{
  if (dead_streams_.count(stream) != 0) {
    ++counters_.dead_stream_uses;
    throw dead_stream_error{std::string{"host_driver: "} + call + " on stream " +
                            std::to_string(stream) + " after it was destroyed"};
  }
  auto [it, fresh] = streams_.try_emplace(stream, next_stream_id_);
  if (fresh) { ++next_stream_id_; }  // a made-up handle: a live stream from now on
  return it->second;
}

void host_driver::set_stream_ids(bool on)
{
  std::lock_guard lock{mutex_};
  stream_ids_ = on;
}

std::uint64_t host_driver::stream_id(int device, stream_handle stream)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  if (is_context_stream(stream)) {
    throw std::logic_error{"host_driver: stream_id of a context stream (the pool never asks)"};
  }
  ++counters_.stream_id_queries;
  auto const id = live_stream_id(stream, "stream_id");
  return stream_ids_ ? id : 0;
}

void host_driver::record_event(int device, event_handle event, stream_handle stream)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  if (!is_context_stream(stream)) { (void)live_stream_id(stream, "record_event"); }
  if (fail_event_records_ > 0) {
    --fail_event_records_;
    throw cuda_error{"cuEventRecord", injected_code, "CUDA_ERROR_UNKNOWN", EMMPOOL_WHERE};
  }
  auto it = events_.find(event);
  if (it == events_.end()) {
    throw cuda_error{"cuEventRecord", 400, "CUDA_ERROR_INVALID_HANDLE", EMMPOOL_WHERE};
  }
  it->second = auto_complete_;
  recorded_[event] = {is_context_stream(stream) ? legacy_stream : stream, ++records_};
  ++counters_.event_records;
}

bool host_driver::event_completed(int, event_handle event)
{
  std::lock_guard lock{mutex_};
  ++counters_.event_queries;
  auto it = events_.find(event);
  if (it == events_.end()) {
    throw cuda_error{"cuEventQuery", 400, "CUDA_ERROR_INVALID_HANDLE", EMMPOOL_WHERE};
  }
  return it->second;
}

void host_driver::synchronize_event(int, event_handle event)
{
  std::unique_lock lock{mutex_};
  ++counters_.event_syncs;
  auto it = events_.find(event);
  if (it == events_.end()) {
    throw cuda_error{"cuEventSynchronize", 400, "CUDA_ERROR_INVALID_HANDLE", EMMPOOL_WHERE};
  }
  it->second = true;  // waiting completes it, and the events recorded on its stream earlier
  if (auto const r = recorded_.find(event); r != recorded_.end()) {
    for (auto const& [e, at] : recorded_) {
      if (at.stream == r->second.stream && at.order < r->second.order) { events_[e] = true; }
    }
  }
  wait_for_work(lock);
}

void host_driver::wait_for_work(std::unique_lock<std::mutex>& lock)
{
  if (!sync_wait_) { return; }
  auto wait = sync_wait_;
  lock.unlock();
  wait();
}

void host_driver::release_context(int device)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  ++counters_.context_releases;
}

void host_driver::synchronize_device(int device)
{
  std::unique_lock lock{mutex_};
  check_device(device);
  if (fail_device_syncs_ > 0) {
    --fail_device_syncs_;
    throw cuda_error{"cuCtxSynchronize", injected_code, "CUDA_ERROR_UNKNOWN", EMMPOOL_WHERE};
  }
  ++counters_.device_syncs;
  for (auto& [e, done] : events_) { done = true; }  // every recorded event has completed
  wait_for_work(lock);
}

ipc_bytes host_driver::ipc_handle(int device, device_ptr segment_base)
{
  std::lock_guard lock{mutex_};
  auto it = segments_.find(segment_base);
  if (it == segments_.end() || it->second.device != device) {
    throw cuda_error{"cuIpcGetMemHandle", invalid_value_code, "CUDA_ERROR_INVALID_VALUE",
                     EMMPOOL_WHERE};
  }
  ipc_bytes h{};
  std::memcpy(h.data(), &segment_base, sizeof segment_base);
  std::memcpy(h.data() + sizeof segment_base, &it->second.id, sizeof it->second.id);
  return h;
}

device_ptr host_driver::ipc_open(int device, ipc_bytes const& handle)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  device_ptr base{};
  std::uint64_t id{};
  std::memcpy(&base, handle.data(), sizeof base);
  std::memcpy(&id, handle.data() + sizeof base, sizeof id);
  auto it = segments_.find(base);
  if (it == segments_.end() || it->second.id != id) {
    throw cuda_error{"cuIpcOpenMemHandle", invalid_value_code, "CUDA_ERROR_INVALID_VALUE",
                     EMMPOOL_WHERE};
  }
  ++counters_.imports;
  ++ipc_opens_[base];  // as CUDA: the same base again, each open to be closed
  return base;
}

void host_driver::ipc_close(int device, device_ptr ptr)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  auto it = ipc_opens_.find(ptr);
  if (it == ipc_opens_.end()) {
    throw cuda_error{"cuIpcCloseMemHandle", invalid_value_code, "CUDA_ERROR_INVALID_VALUE",
                     EMMPOOL_WHERE};
  }
  if (--it->second == 0) { ipc_opens_.erase(it); }
}

std::size_t host_driver::ipc_opens() const
{
  std::lock_guard lock{mutex_};
  std::size_t n = 0;
  for (auto const& [base, count] : ipc_opens_) { n += count; }
  return n;
}

memory_info host_driver::memory_info_of(int device)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  reap_exports();
  auto const d = static_cast<std::size_t>(device);
  return {capacity_[d] - std::min(used_[d], capacity_[d]), capacity_[d]};
}

void* host_driver::host_allocate(int device, std::size_t bytes, unsigned)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  if (fail_allocations_ > 0) {
    --fail_allocations_;
    throw out_of_memory{"host_driver: injected host allocation failure"};
  }
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) { throw out_of_memory{"host_driver: malloc failed"}; }
  host_allocations_.emplace(p, bytes);
  return p;
}

void host_driver::host_deallocate(int, void* ptr)
{
  std::lock_guard lock{mutex_};
  if (host_allocations_.erase(ptr) == 0) {
    throw cuda_error{"cuMemFreeHost", invalid_value_code, "CUDA_ERROR_INVALID_VALUE",
                     EMMPOOL_WHERE};
  }
  std::free(ptr);
}

void host_driver::host_register(int, void* ptr, std::size_t bytes, unsigned)
{
  std::lock_guard lock{mutex_};
  auto const key = reinterpret_cast<std::uintptr_t>(ptr);
  if (!host_registrations_.emplace(key, bytes).second) {
    throw cuda_error{"cuMemHostRegister", 712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
                     EMMPOOL_WHERE};
  }
}

void host_driver::host_unregister(int, void* ptr)
{
  std::lock_guard lock{mutex_};
  if (host_registrations_.erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0) {
    throw cuda_error{"cuMemHostUnregister", 713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
                     EMMPOOL_WHERE};
  }
}

}  // namespace emmpool

// ---- virtual memory management ------------------------------------------------------------

namespace emmpool {

void host_driver::set_vmm_supported(bool on)
{
  std::lock_guard lock{mutex_};
  vmm_supported_ = on;
}

void host_driver::fail_next_creates(int n)
{
  std::lock_guard lock{mutex_};
  fail_creates_ = n;
}

void host_driver::fail_next_maps(int n, int after)
{
  std::lock_guard lock{mutex_};
  fail_maps_ = fault{n, after};
}

void host_driver::fail_next_exports(int n, int after)
{
  std::lock_guard lock{mutex_};
  fail_exports_ = fault{n, after};
}

void host_driver::fail_next_imports(int n, int after)
{
  std::lock_guard lock{mutex_};
  fail_imports_ = fault{n, after};
}

void host_driver::fail_next_unmaps(int n)
{
  std::lock_guard lock{mutex_};
  fail_unmaps_ = n;
}

void host_driver::fail_next_reservations(int n)
{
  std::lock_guard lock{mutex_};
  fail_reservations_ = n;
}

std::size_t host_driver::vmm_page_size(int device)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  return vmm_supported_ ? granularity : 0;
}

device_ptr host_driver::reserve_address(int device, std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  if (!vmm_supported_) {
    throw cuda_error{"cuMemAddressReserve", 801, "CUDA_ERROR_NOT_SUPPORTED", EMMPOOL_WHERE};
  }
  if (fail_reservations_ > 0) {
    --fail_reservations_;
    throw cuda_error{"cuMemAddressReserve", 2, "CUDA_ERROR_OUT_OF_MEMORY", EMMPOOL_WHERE};
  }
  if (bytes == 0 || bytes % granularity != 0) {
    throw cuda_error{"cuMemAddressReserve", invalid_value_code, "CUDA_ERROR_INVALID_VALUE",
                     EMMPOOL_WHERE};
  }
  auto& next         = next_address_[static_cast<std::size_t>(device)];
  device_ptr const p = next;
  next += bytes + granularity;  // a gap: nothing may coalesce across reservations
  reservations_.emplace(p, reservation{device, bytes});
  counters_.bytes_address_reserved += bytes;
  ++counters_.live_reservations;
  return p;
}

void host_driver::free_address(int device, device_ptr base, std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  auto it = reservations_.find(base);
  if (it == reservations_.end() || it->second.device != device || it->second.bytes != bytes) {
    throw cuda_error{"cuMemAddressFree", invalid_value_code, "CUDA_ERROR_INVALID_VALUE",
                     EMMPOOL_WHERE};
  }
  auto m = mappings_.lower_bound(base);
  if (m != mappings_.end() && m->first < base + bytes) {
    // CUDA leaves the physical memory mapped and unreachable: in the model, a pool bug.
    throw cuda_error{"cuMemAddressFree", invalid_value_code,
                     "CUDA_ERROR_INVALID_VALUE (range still mapped)", EMMPOOL_WHERE};
  }
  counters_.bytes_address_reserved -= bytes;
  --counters_.live_reservations;
  reservations_.erase(it);
}

physical_handle host_driver::create_physical(int device, std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  auto const d = static_cast<std::size_t>(device);
  if (fail_creates_ > 0) {
    --fail_creates_;
    throw out_of_memory{"host_driver: injected cuMemCreate failure"};
  }
  reap_exports();  // memory an exported descriptor held may be free now
  if (bytes == 0 || bytes % granularity != 0) {
    throw cuda_error{"cuMemCreate", invalid_value_code, "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  }
  if (bytes > capacity_[d] - used_[d] || used_[d] > capacity_[d]) {
    throw out_of_memory{"host_driver: device " + std::to_string(device) + " is full (cuMemCreate)"};
  }
  auto const m = next_memory_++;
  memories_.emplace(m, memory{device, bytes, 1});
  physical_handle const h = next_handle_++;
  handles_.emplace(h, m);
  used_[d] += bytes;
  counters_.bytes_physical += bytes;
  ++counters_.creates;
  ++counters_.live_handles;
  return h;
}

void host_driver::drop_holder(std::uint64_t m)
{
  auto it = memories_.find(m);
  if (it == memories_.end() || --it->second.holders != 0) { return; }
  used_[static_cast<std::size_t>(it->second.device)] -= it->second.bytes;
  counters_.bytes_physical -= it->second.bytes;
  memories_.erase(it);
}

void host_driver::release_physical(int device, physical_handle h)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  auto it = handles_.find(h);
  if (it == handles_.end() || memories_.at(it->second).device != device) {
    throw cuda_error{"cuMemRelease", invalid_value_code, "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  }
  auto const m = it->second;
  handles_.erase(it);
  --counters_.live_handles;
  ++counters_.releases;
  drop_holder(m);
}

void host_driver::map_physical(int device, device_ptr at, std::size_t bytes, physical_handle h)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  auto const invalid = [] {
    return cuda_error{"cuMemMap", invalid_value_code, "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  };
  if (fail_maps_.due()) {
    throw cuda_error{"cuMemMap", injected_code, "CUDA_ERROR_UNKNOWN", EMMPOOL_WHERE};
  }
  auto hit = handles_.find(h);
  if (hit == handles_.end()) { throw invalid(); }
  auto& mem = memories_.at(hit->second);
  if (mem.device != device || mem.bytes != bytes) { throw invalid(); }  // all of the handle
  if (bytes == 0 || bytes % granularity != 0 || at % granularity != 0) { throw invalid(); }
  auto r = reservations_.upper_bound(at);
  if (r == reservations_.begin()) { throw invalid(); }
  --r;
  if (r->second.device != device || at + bytes > r->first + r->second.bytes) { throw invalid(); }
  auto m = mappings_.lower_bound(at);
  if (m != mappings_.end() && m->first < at + bytes) { throw invalid(); }  // overlaps above
  if (m != mappings_.begin() && std::prev(m)->first + std::prev(m)->second.bytes > at) {
    throw invalid();  // overlaps below
  }
  mappings_.emplace(at, mapping{device, bytes, hit->second});
  ++mem.holders;
  ++counters_.maps;
  counters_.bytes_mapped += bytes;
  ++counters_.live_mappings;
}

void host_driver::unmap_physical(int device, device_ptr at, std::size_t bytes)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  if (fail_unmaps_ > 0) {
    --fail_unmaps_;
    throw cuda_error{"cuMemUnmap", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", EMMPOOL_WHERE};
  }
  auto m = mappings_.find(at);
  if (m == mappings_.end() || m->second.device != device || m->second.bytes != bytes) {
    throw cuda_error{"cuMemUnmap", invalid_value_code, "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  }
  auto const mem = m->second.memory;
  mappings_.erase(m);
  ++counters_.unmaps;
  counters_.bytes_mapped -= bytes;
  --counters_.live_mappings;
  drop_holder(mem);
}

int host_driver::export_physical(int device, physical_handle h)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  if (fail_exports_.due()) {
    throw cuda_error{"cuMemExportToShareableHandle", injected_code, "CUDA_ERROR_UNKNOWN",
                     EMMPOOL_WHERE};
  }
  auto it = handles_.find(h);
  if (it == handles_.end() || memories_.at(it->second).device != device) {
    throw cuda_error{"cuMemExportToShareableHandle", invalid_value_code,
                     "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  }
  // A real descriptor, as CUDA's: it can be passed over a socket, duplicated and closed, and
  // holds the memory until its last copy is closed (the driver's end then hangs up). It reads
  // back the memory's number, which the driver's end wrote into it.
  int pair[2] = {-1, -1};
  std::uint64_t const m = it->second;
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0 ||
      ::send(pair[1], &m, sizeof m, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof m)) {
    if (pair[0] >= 0) { ::close(pair[0]); }
    if (pair[1] >= 0) { ::close(pair[1]); }
    throw cuda_error{"cuMemExportToShareableHandle", injected_code, "CUDA_ERROR_UNKNOWN",
                     EMMPOOL_WHERE};
  }
  ::shutdown(pair[1], SHUT_WR);  // nothing more to say: a peek at the other end sees it all
  exports_.push_back({pair[1], m});
  ++memories_.at(m).holders;
  ++counters_.exports;
  return pair[0];
}

void host_driver::reap_exports()
{
  for (auto it = exports_.begin(); it != exports_.end();) {
    pollfd p{it->kept, POLLIN | POLLRDHUP, 0};
    // Nobody writes to an exported descriptor: any event on the driver's end is the last copy
    // of the other closing.
    if (::poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLRDHUP | POLLIN)) != 0) {
      ::close(it->kept);
      auto const m = it->memory;
      it = exports_.erase(it);
      drop_holder(m);
    } else {
      ++it;
    }
  }
}

physical_handle host_driver::import_physical(int device, int fd)
{
  std::lock_guard lock{mutex_};
  check_device(device);
  auto const invalid = [] {
    return cuda_error{"cuMemImportFromShareableHandle", invalid_value_code,
                      "CUDA_ERROR_INVALID_VALUE", EMMPOOL_WHERE};
  };
  if (fail_imports_.due()) {
    throw cuda_error{"cuMemImportFromShareableHandle", injected_code, "CUDA_ERROR_UNKNOWN",
                     EMMPOOL_WHERE};
  }
  std::uint64_t m = 0;
  if (::recv(fd, &m, sizeof m, MSG_PEEK | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof m)) {
    throw invalid();
  }
  auto it = memories_.find(m);
  if (it == memories_.end() || it->second.device != device) { throw invalid(); }
  ++it->second.holders;
  physical_handle const h = next_handle_++;
  handles_.emplace(h, m);
  ++counters_.imports;
  ++counters_.live_handles;
  return h;
}

}  // namespace emmpool

namespace emmpool {

bool host_driver::accessible(int device, device_ptr ptr, std::size_t bytes) const
{
  std::lock_guard lock{mutex_};
  device_ptr const end = ptr + bytes;
  auto s = segments_.upper_bound(ptr);
  if (s != segments_.begin()) {
    --s;
    if (s->second.device == device && end <= s->first + s->second.bytes) { return true; }
  }
  // Mappings are page-granular and may be adjacent: walk them from the one holding ptr.
  auto m = mappings_.upper_bound(ptr);
  if (m == mappings_.begin()) { return false; }
  --m;
  device_ptr covered = ptr;
  while (m != mappings_.end() && m->first <= covered && m->second.device == device) {
    covered = std::max(covered, m->first + m->second.bytes);
    if (covered >= end) { return true; }
    ++m;
  }
  return false;
}

}  // namespace emmpool
