// bench_core: C++ micro-benchmark of emmpool's core, with no Python in the way.
//
//   bench_core [--out FILE] [--quick] [--device N]   GPU: the process-wide pool over the CUDA
//                                                    driver, against cuMemAllocAsync/
//                                                    cuMemFreeAsync and cuMemAlloc/cuMemFree
//   bench_core --host [--out FILE] [--quick]         no GPU: the pool over host_driver (events
//                                                    complete at once: an idle GPU)
//   bench_core --replay [--trace FILE] [--out FILE]  fragmentation replay over host_driver
//              [--large-segment B] [--small-request B] [--small-segment B]
//              [--seed S] [--ops N] [--live N]
//              [--capacity B] [--maximum-size B] [--passthrough] [--fixed]
//
// Timing: one "pair" is allocate(n) + deallocate(ptr). Each case is warmed up, then timed in
// blocks of `pairs` pairs (sized to ~20 ms, 5 ms with --quick); a block's time / pairs is one
// sample; the table shows the median sample (and min, p90) over 15 blocks (5 with --quick).
// GPU cases synchronize the legacy stream at the end of each block, inside the timing, so that
// asynchronous frees are paid for.
//
// Replay: fill 256 live blocks, then 40,000 operations, each freeing a random live block and
// allocating a new one; sizes log-uniform in [256 B, 64 MiB]. Reports the pool's peak reserved
// bytes over the peak of live bytes (the sum of requested sizes). The trace is generated here
// (std::mt19937_64, fixed seed), or read from a file written by `replay.py --write-trace`.
// By default the fake device is huge (1 TiB: no memory pressure, so the growth policy alone
// decides); --capacity or --maximum-size replay it under pressure (out-of-memory ladder).
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/host_driver.hpp>
#include <emmpool/pool_queries.hpp>
#include <emmpool/registry.hpp>

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

// ---- options ------------------------------------------------------------------------------------

/// --pairs N: a warm-up of 256 pairs and blocks of N pairs, whatever the clock says, so that
/// what runs does not depend on the machine's speed (benchmarks/instructions.py counts it).
std::size_t fixed_pairs = 0;

struct options {
  bool host   = false;
  bool replay = false;
  bool quick  = false;
  int device  = 0;
  std::string out;
  std::string trace;
  std::uint64_t seed = 20240601;
  std::size_t ops    = 40000;
  std::size_t live   = 256;
  std::size_t capacity = std::size_t{1} << 40;  // host_driver capacity in --replay
  emmpool::pool_options pool;
};

[[noreturn]] void usage(char const* why)
{
  std::fprintf(stderr,
               "bench_core: %s\n"
               "usage: bench_core [--host | --replay [--trace FILE]] [--out FILE] [--quick]\n"
               "                  [--pairs N]   (fixed counts, no timing: instructions.py)\n"
               "                  [--device N] [--seed S] [--ops N] [--live N]\n"
               "                  [--large-segment B] [--small-request B] [--small-segment B]\n"
               "                  [--capacity B] [--maximum-size B] [--passthrough]   (replay)\n"
               "                  [--fixed]   (--host, --replay: fixed segments, not the default growable)\n",
               why);
  std::exit(2);
}

options parse(int argc, char** argv)
{
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    auto value          = [&]() -> std::string {
      if (i + 1 >= argc) { usage(("missing value after " + a).c_str()); }
      return argv[++i];
    };
    auto number = [&]() { return static_cast<std::size_t>(std::stoull(value())); };
    if (a == "--host") {
      o.host = true;
    } else if (a == "--replay") {
      o.replay = true;
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--pairs") {
      fixed_pairs = static_cast<std::size_t>(std::stoull(value()));
      if (fixed_pairs == 0) { usage("--pairs takes a count above 0"); }
    } else if (a == "--out") {
      o.out = value();
    } else if (a == "--trace") {
      o.trace = value();
    } else if (a == "--device") {
      o.device = static_cast<int>(number());
    } else if (a == "--seed") {
      o.seed = number();
    } else if (a == "--ops") {
      o.ops = number();
    } else if (a == "--live") {
      o.live = number();
    } else if (a == "--capacity") {
      o.capacity = number();
    } else if (a == "--maximum-size") {
      o.pool.maximum_size = number();
    } else if (a == "--passthrough") {
      o.pool.mode = emmpool::pool_mode::passthrough;
    } else if (a == "--fixed") {
      o.pool.segments = emmpool::segment_kind::fixed;
    } else if (a == "--large-segment") {
      o.pool.large_segment = number();
    } else if (a == "--small-request") {
      o.pool.small_request = number();
    } else if (a == "--small-segment") {
      o.pool.small_segment = number();
    } else if (a == "-h" || a == "--help") {
      usage("help");
    } else {
      usage(("unknown argument " + a).c_str());
    }
  }
  return o;
}

// ---- JSON (flat enough to write by hand) -----------------------------------------------------

std::string json_string(std::string const& s)
{
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string num(double v)
{
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string size_label(std::size_t n)
{
  if (n >= MiB && n % MiB == 0) { return std::to_string(n / MiB) + " MiB"; }
  if (n >= KiB && n % KiB == 0) { return std::to_string(n / KiB) + " KiB"; }
  return std::to_string(n) + " B";
}

// ---- timing -------------------------------------------------------------------------------------

struct result {
  std::string name;
  std::string what;
  std::size_t size{};
  double median_ns{}, min_ns{}, p90_ns{};
  std::size_t pairs_per_block{};
  std::size_t blocks{};
  std::size_t pairs_total{};  // warm-up included
  // Pool cases: events recorded and queried per pair (pool_stats batches_closed and
  // fence_queries over every pair of the case, warm-up included); negative: not a pool case.
  double fences_per_pair{-1}, queries_per_pair{-1};
};

/// Time `pair()` (one allocate+deallocate); `fence()` ends each block (a stream sync on GPUs).
result measure(std::string name, std::string what, std::size_t size, bool quick,
               std::function<void()> const& pair, std::function<void()> const& fence)
{
  double const block_seconds = quick ? 0.005 : 0.02;
  std::size_t const blocks   = quick ? 5 : 15;
  // Warm-up, which also sizes the blocks: at least 200 pairs and 50 ms (15 ms quick).
  auto const t0   = clock_type::now();
  std::size_t n   = 0;
  double elapsed  = 0;
  double const wu = quick ? 0.015 : 0.05;
  while (fixed_pairs != 0 ? n < 256 : (n < 200 || elapsed < wu)) {
    pair();
    ++n;
    if ((n & 15) == 0) {
      fence();
      elapsed = std::chrono::duration<double>(clock_type::now() - t0).count();
    }
  }
  fence();
  elapsed           = std::chrono::duration<double>(clock_type::now() - t0).count();
  std::size_t pairs = fixed_pairs != 0 ? fixed_pairs : std::max<std::size_t>(
    10, static_cast<std::size_t>(block_seconds / (elapsed / static_cast<double>(n))));
  std::vector<double> samples;
  for (std::size_t b = 0; b < blocks; ++b) {
    auto const start = clock_type::now();
    for (std::size_t i = 0; i < pairs; ++i) { pair(); }
    fence();
    auto const ns = std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
    samples.push_back(ns / static_cast<double>(pairs));
  }
  std::sort(samples.begin(), samples.end());
  result r;
  r.name            = std::move(name);
  r.what            = std::move(what);
  r.size            = size;
  r.median_ns       = samples[samples.size() / 2];
  r.min_ns          = samples.front();
  r.p90_ns          = samples[std::min(samples.size() - 1, samples.size() * 9 / 10)];
  r.pairs_per_block = pairs;
  r.blocks          = blocks;
  r.pairs_total     = n + pairs * blocks;
  return r;
}

// ---- the CUDA driver, loaded here for the baselines -------------------------------------------

// The driver entry points the baselines call, in one list (X-macro, as the core's
// cpp/src/cuda_driver_api.inc): a field per function and a dlsym per function at load time.
// Names are cuda.h's, which its macros map to the current ABI version (cuMemAlloc ->
// cuMemAlloc_v2, ...): BENCH_STR spells a name after that mapping.
#define BENCH_STR_DETAIL(x) #x
#define BENCH_STR(x) BENCH_STR_DETAIL(x)
#define BENCH_CUDA_API(X)                                                                       \
  X(cuInit) X(cuDeviceGet) X(cuDeviceGetName) X(cuDriverGetVersion) X(cuDevicePrimaryCtxRetain) \
  X(cuCtxSetCurrent) X(cuStreamSynchronize) X(cuMemAlloc) X(cuMemFree) X(cuMemAllocAsync)        \
  X(cuMemFreeAsync) X(cuDeviceGetDefaultMemPool) X(cuMemPoolSetAttribute) X(cuMemPoolTrimTo)     \
  X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventQuery) X(cuMemHostAlloc)          \
  X(cuMemFreeHost) X(cuMemHostGetDevicePointer) X(cuStreamWriteValue32) X(cuMemAddressReserve)  \
  X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) \
  X(cuMemsetD8Async) X(cuStreamCreate) X(cuStreamDestroy)

struct cuda_api {
  void* handle = nullptr;
#define BENCH_CUDA_FIELD(fn) decltype(&::fn) fn{};
  BENCH_CUDA_API(BENCH_CUDA_FIELD)
#undef BENCH_CUDA_FIELD

  void load()
  {
    handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      char const* why = ::dlerror();
      throw std::runtime_error{std::string{"dlopen(libcuda.so.1) failed: "} + (why ? why : "?")};
    }
#define BENCH_CUDA_LOAD(fn)                                                       \
  fn = reinterpret_cast<decltype(fn)>(::dlsym(handle, BENCH_STR(fn)));            \
  if (fn == nullptr) {                                                            \
    throw std::runtime_error{std::string{"libcuda.so.1 lacks "} + BENCH_STR(fn)}; \
  }
    BENCH_CUDA_API(BENCH_CUDA_LOAD)
#undef BENCH_CUDA_LOAD
  }
};

void cu_check(CUresult r, char const* what)
{
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error{std::string{what} + " failed: CUresult " + std::to_string(r)};
  }
}

// ---- the cases ----------------------------------------------------------------------------------

constexpr std::size_t sizes[] = {256, 64 * KiB, 4 * MiB};

/// measure() for a case of `pool`, with the fences it recorded and queried per pair.
result measure_pool(emmpool::device_pool& pool, std::string name, std::string what,
                    std::size_t size, bool quick, std::function<void()> const& pair,
                    std::function<void()> const& fence)
{
  auto const before = pool.stats();
  auto r            = measure(std::move(name), std::move(what), size, quick, pair, fence);
  auto const after  = pool.stats();
  auto const pairs  = static_cast<double>(r.pairs_total);
  r.fences_per_pair  = static_cast<double>(after.batches_closed - before.batches_closed) / pairs;
  r.queries_per_pair = static_cast<double>(after.fence_queries - before.fence_queries) / pairs;
  return r;
}

void bench_pool(std::vector<result>& out, std::string const& prefix, emmpool::device_pool& pool,
                bool quick, std::function<void()> const& fence)
{
  for (auto n : sizes) {
    out.push_back(measure_pool(pool, prefix, "allocate+deallocate", n, quick,
                               [&] { pool.deallocate(pool.allocate(n)); }, fence));
  }
  // CuPy's and PyTorch's path: a named stream (the null stream, 0), the free fenced on the
  // allocation's stream; the block goes straight back to the next allocation on that stream.
  auto const tag = emmpool::alloc_tag::cupy;
  for (auto n : sizes) {
    out.push_back(measure_pool(pool, prefix + ", stream-ordered",
                               "allocate(n, 0)+deallocate(p, allocation_stream, library)", n,
                               quick,
                               [&] {
                                 auto const owner = emmpool::block_owner::of_library(tag);
                                 pool.deallocate(pool.allocate(n, 0, tag),
                                                 emmpool::allocation_stream, owner);
                               },
                               fence));
  }
}

std::string gpu_benchmarks(options const& o, std::vector<result>& out)
{
  cuda_api cu;
  cu.load();
  cu_check(cu.cuInit(0), "cuInit");
  CUdevice dev{};
  cu_check(cu.cuDeviceGet(&dev, o.device), "cuDeviceGet");
  char name[256] = {};
  cu_check(cu.cuDeviceGetName(name, sizeof name, dev), "cuDeviceGetName");
  int version = 0;
  cu.cuDriverGetVersion(&version);
  CUcontext ctx{};
  cu_check(cu.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  // Current on this thread, as under Numba/CuPy/PyTorch: the pool then never pushes a context.
  cu_check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  auto* const legacy = CU_STREAM_LEGACY;
  auto fence         = [&] { cu_check(cu.cuStreamSynchronize(legacy), "cuStreamSynchronize"); };

  auto& pool = emmpool::pool_registry::instance().pool(o.device);
  bench_pool(out, "emmpool pool (process-wide, CUDA)", pool, o.quick, fence);
  if (pool.growable()) {
    // The default's segments are growable: the same pool on fixed segments beside it, so that
    // what they cost shows in one run (EMMPOOL_SEGMENTS=fixed's pool).
    emmpool::pool_options fixed;
    fixed.segments = emmpool::segment_kind::fixed;
    emmpool::device_pool fixed_pool{emmpool::cuda_driver(), o.device, fixed};
    bench_pool(out, "emmpool pool (fixed segments, CUDA)", fixed_pool, o.quick, fence);
  }

  CUmemoryPool mempool{};
  cu_check(cu.cuDeviceGetDefaultMemPool(&mempool, dev), "cuDeviceGetDefaultMemPool");
  for (bool keep : {false, true}) {
    // Default: release threshold 0 (the driver may return memory at each synchronization);
    // then the usual tuning, a threshold of "never".
    cuuint64_t threshold = keep ? ~cuuint64_t{0} : 0;
    cu_check(cu.cuMemPoolSetAttribute(mempool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold),
             "cuMemPoolSetAttribute");
    std::string const label = keep ? "cuMemAllocAsync (release threshold max)"
                                   : "cuMemAllocAsync (default mem pool)";
    for (auto n : sizes) {
      out.push_back(measure(label, "cuMemAllocAsync+cuMemFreeAsync, legacy stream", n, o.quick,
                            [&] {
                              CUdeviceptr p{};
                              cu_check(cu.cuMemAllocAsync(&p, n, legacy), "cuMemAllocAsync");
                              cu_check(cu.cuMemFreeAsync(p, legacy), "cuMemFreeAsync");
                            },
                            fence));
    }
    cu_check(cu.cuMemPoolTrimTo(mempool, 0), "cuMemPoolTrimTo");
  }
  std::size_t const n = 64 * KiB;
  out.push_back(measure("cuMemAlloc/cuMemFree", "cuMemAlloc+cuMemFree", n, o.quick,
                        [&] {
                          CUdeviceptr p{};
                          cu_check(cu.cuMemAlloc(&p, n), "cuMemAlloc");
                          cu_check(cu.cuMemFree(p), "cuMemFree");
                        },
                        fence));
  // What one of the pool's fences costs (reuse_rule.hpp: an event recorded on the legacy
  // stream, then queried), which a Numba pair pays whenever its request misses the free lists:
  // once per five pairs at 4 MiB (five such blocks per 20 MiB segment).
  CUevent event{};
  cu_check(cu.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  out.push_back(measure("one fence of the pool", "cuEventRecord+cuEventQuery, legacy stream", 0,
                        o.quick,
                        [&] {
                          cu_check(cu.cuEventRecord(event, legacy), "cuEventRecord");
                          (void)cu.cuEventQuery(event);  // CUDA_SUCCESS on an idle GPU
                        },
                        fence));
  // Its parts, and the one stream-ordered alternative that needs no query (a counter the GPU
  // writes into pinned host memory, read by a plain load): on an H200 a write cost 4.6 records
  // (results/H200/bench_core.md), so the fence stays an event.
  out.push_back(measure("a fence's record", "cuEventRecord, legacy stream", 0, o.quick,
                        [&] { cu_check(cu.cuEventRecord(event, legacy), "cuEventRecord"); },
                        fence));
  fence();
  out.push_back(measure("a fence's query", "cuEventQuery of a completed event", 0, o.quick,
                        [&] { (void)cu.cuEventQuery(event); }, fence));
  void* word = nullptr;
  cu_check(cu.cuMemHostAlloc(&word, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
           "cuMemHostAlloc");
  CUdeviceptr word_dev{};
  cu_check(cu.cuMemHostGetDevicePointer(&word_dev, word, 0), "cuMemHostGetDevicePointer");
  cuuint32_t count = 0;
  out.push_back(measure("a counter fence (not used)",
                        "cuStreamWriteValue32 to pinned host memory, legacy stream", 0, o.quick,
                        [&] {
                          cu_check(cu.cuStreamWriteValue32(legacy, word_dev, ++count, 0),
                                   "cuStreamWriteValue32");
                        },
                        fence));
  cu.cuMemFreeHost(word);
  cu.cuEventDestroy(event);
  // What moving one of the growable segment's pages costs (detail/page_policy.hpp): unmapped,
  // mapped at the other end of a two-page reservation, given access. Then the same behind a
  // memset queued on another stream, and that memset alone: a move that waits for the device
  // costs about the sum of the two rows, one that does not about the larger. Last, the same
  // 20 MiB as ten 2 MiB pages, unmapped in one call and given access in one call: what finer
  // pages under one map would cost, if the driver's cost were per call and not per page.
  std::size_t const page = 20 * MiB, big = 1024 * MiB, granule = 2 * MiB;
  CUmemAllocationProp prop{};
  prop.type          = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id   = o.device;
  CUmemAccessDesc const access{prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CUdeviceptr va{}, busy{};
  CUmemGenericAllocationHandle h{};
  CUstream other{};
  cu_check(cu.cuMemAddressReserve(&va, 2 * page, 0, 0, 0), "cuMemAddressReserve");
  cu_check(cu.cuMemCreate(&h, page, &prop, 0), "cuMemCreate");
  cu_check(cu.cuMemMap(va, page, 0, h, 0), "cuMemMap");
  cu_check(cu.cuMemAlloc(&busy, big), "cuMemAlloc");
  cu_check(cu.cuStreamCreate(&other, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  std::size_t at = 0;  // the page's offset in the reservation
  auto const move = [&] {
    cu_check(cu.cuMemUnmap(va + at, page), "cuMemUnmap");
    at = page - at;
    cu_check(cu.cuMemMap(va + at, page, 0, h, 0), "cuMemMap");
    cu_check(cu.cuMemSetAccess(va + at, page, &access, 1), "cuMemSetAccess");
  };
  auto const fill = [&] { cu_check(cu.cuMemsetD8Async(busy, 1, big, other), "cuMemset"); };
  auto const both   = [&] { fence(); cu_check(cu.cuStreamSynchronize(other), "cuStreamSync"); };
  out.push_back(measure("a growable page move", "cuMemUnmap+cuMemMap+cuMemSetAccess, GPU idle",
                        page, o.quick, move, both));
  out.push_back(measure("a growable page move", "the same behind a 1 GiB memset, another stream",
                        page, o.quick, [&] { fill(); move(); }, both));
  out.push_back(measure("a 1 GiB memset", "cuMemsetD8Async, another stream", big, o.quick, fill,
                        both));
  cu_check(cu.cuMemUnmap(va + at, page), "cuMemUnmap");
  std::vector<CUmemGenericAllocationHandle> granules(page / granule);
  for (auto& g : granules) { cu_check(cu.cuMemCreate(&g, granule, &prop, 0), "cuMemCreate"); }
  auto const map_granules = [&] {
    for (std::size_t i = 0; i < granules.size(); ++i) {
      cu_check(cu.cuMemMap(va + at + i * granule, granule, 0, granules[i], 0), "cuMemMap");
    }
    cu_check(cu.cuMemSetAccess(va + at, page, &access, 1), "cuMemSetAccess");
  };
  map_granules();
  out.push_back(measure("ten 2 MiB pages moved", "one cuMemUnmap+ten cuMemMap+one cuMemSetAccess",
                        page, o.quick,
                        [&] {
                          cu_check(cu.cuMemUnmap(va + at, page), "cuMemUnmap");
                          at = page - at;
                          map_granules();
                        },
                        both));
  cu.cuMemUnmap(va + at, page);
  for (auto g : granules) { cu.cuMemRelease(g); }
  cu.cuStreamDestroy(other);
  cu.cuMemFree(busy);
  cu.cuMemRelease(h);
  cu.cuMemAddressFree(va, 2 * page);
  auto const s = pool.stats();
  std::printf("process-wide pool after the run: %s (%llu batches closed)\n",
              emmpool::pool_queries{pool}.describe().c_str(), static_cast<unsigned long long>(s.batches_closed));
  return std::string{name} + ", driver " + std::to_string(version / 1000) + "." +
         std::to_string(version % 1000 / 10);
}

std::string host_benchmarks(options const& o, std::vector<result>& out)
{
  emmpool::host_driver drv;
  drv.set_auto_complete(true);  // an idle GPU: a fence completes as soon as it is recorded
  emmpool::device_pool pool{drv, 0, o.pool};
  bench_pool(out, "emmpool pool (host_driver)", pool, o.quick, [] {});
  if (pool.growable()) {  // fixed segments (EMMPOOL_SEGMENTS=fixed), beside the default
    emmpool::pool_options f = o.pool;
    f.segments              = emmpool::segment_kind::fixed;
    emmpool::device_pool fixed{drv, 0, f};
    bench_pool(out, "emmpool pool (host_driver, fixed segments)", fixed, o.quick, [] {});
  }
  emmpool::pool_options pt = o.pool;
  pt.mode                  = emmpool::pool_mode::passthrough;
  emmpool::device_pool passthrough{drv, 0, pt};
  bench_pool(out, "emmpool passthrough (host_driver)", passthrough, o.quick, [] {});
  return "host_driver (no GPU)";
}

// ---- fragmentation replay ---------------------------------------------------------------------

struct trace {
  std::size_t live{};
  std::vector<std::size_t> fill;                          // the first `live` allocations
  std::vector<std::pair<std::size_t, std::size_t>> ops;  // (slot to free, size to allocate)
  std::string origin;
};

trace generate_trace(std::uint64_t seed, std::size_t live, std::size_t ops)
{
  std::mt19937_64 rng{seed};
  std::uniform_real_distribution<double> u{std::log(256.0), std::log(64.0 * MiB)};
  std::uniform_int_distribution<std::size_t> slot{0, live - 1};
  auto size = [&] { return static_cast<std::size_t>(std::exp(u(rng))); };
  trace t;
  t.live = live;
  for (std::size_t i = 0; i < live; ++i) { t.fill.push_back(size()); }
  for (std::size_t i = 0; i < ops; ++i) {
    auto const s = slot(rng);
    t.ops.emplace_back(s, size());
  }
  t.origin = "bench_core std::mt19937_64 seed " + std::to_string(seed);
  return t;
}

/// Format written by replay.py --write-trace: a header line "emmpool-trace 1 LIVE OPS", then
/// LIVE lines "SIZE" (the fill), then OPS lines "SLOT SIZE".
trace read_trace(std::string const& path)
{
  std::ifstream in{path};
  if (!in) { throw std::runtime_error{"cannot open trace " + path}; }
  std::string magic;
  int version = 0;
  trace t;
  std::size_t ops = 0;
  in >> magic >> version >> t.live >> ops;
  if (magic != "emmpool-trace" || version != 1) {
    throw std::runtime_error{path + " is not an emmpool-trace 1 file"};
  }
  t.fill.resize(t.live);
  for (auto& s : t.fill) { in >> s; }
  t.ops.resize(ops);
  for (auto& [slot, size] : t.ops) { in >> slot >> size; }
  if (!in) { throw std::runtime_error{"truncated trace " + path}; }
  t.origin = path;
  return t;
}

struct replay_result {
  std::size_t peak_live{}, peak_reserved{}, final_reserved{}, segments{}, driver_allocations{},
    driver_deallocations{};
  double seconds{};
};

replay_result run_replay(trace const& t, emmpool::pool_options const& po, std::size_t capacity)
{
  emmpool::host_driver drv{1, capacity};
  drv.set_auto_complete(true);
  emmpool::device_pool pool{drv, 0, po};
  std::vector<emmpool::device_ptr> ptr(t.live);
  std::vector<std::size_t> size(t.live);
  std::size_t live = 0;
  replay_result r;
  auto const start = clock_type::now();
  for (std::size_t i = 0; i < t.live; ++i) {
    ptr[i]  = pool.allocate(t.fill[i]);
    size[i] = t.fill[i];
    live += size[i];
    r.peak_live = std::max(r.peak_live, live);
  }
  for (auto const& [slot, n] : t.ops) {
    pool.deallocate(ptr[slot]);
    live -= size[slot];
    ptr[slot]  = pool.allocate(n);
    size[slot] = n;
    live += n;
    r.peak_live = std::max(r.peak_live, live);
  }
  r.seconds             = std::chrono::duration<double>(clock_type::now() - start).count();
  auto const s          = pool.stats();
  r.peak_reserved       = s.peak_bytes_reserved;
  r.final_reserved      = s.bytes_reserved;
  r.segments            = s.segments;
  r.driver_allocations  = drv.stats().allocations;
  r.driver_deallocations = drv.stats().deallocations;
  for (auto p : ptr) { pool.deallocate(p); }
  return r;
}

void write_file(std::string const& path, std::string const& text)
{
  std::ofstream f{path};
  f << text;
  if (!f) {
    std::fprintf(stderr, "bench_core: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

int replay_main(options const& o)
{
  trace const t = o.trace.empty() ? generate_trace(o.seed, o.live, o.ops) : read_trace(o.trace);
  replay_result r;
  try {
    r = run_replay(t, o.pool, o.capacity);
  } catch (emmpool::out_of_memory const& e) {
    std::printf("fragmentation replay: out of memory (capacity %zu, maximum_size %zu): %s\n",
                o.capacity, o.pool.maximum_size, e.what());
    return 4;
  }
  double const ratio = static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_live);
  std::printf("fragmentation replay (%zu live, %zu ops; trace: %s)\n", t.live, t.ops.size(),
              t.origin.c_str());
  std::printf("  pool options: %s, small_request %zu, small_segment %zu, large_segment %zu, "
              "maximum_size %zu; device capacity %zu\n",
              o.pool.mode == emmpool::pool_mode::pool ? "pool" : "passthrough",
              o.pool.small_request, o.pool.small_segment, o.pool.large_segment,
              o.pool.maximum_size, o.capacity);
  std::printf("  peak live      %10.1f MiB\n", static_cast<double>(r.peak_live) / MiB);
  std::printf("  peak reserved  %10.1f MiB\n", static_cast<double>(r.peak_reserved) / MiB);
  std::printf("  ratio          %10.3f\n", ratio);
  std::printf("  driver: %zu allocations, %zu deallocations; %zu segments at the end; %.2f s\n",
              r.driver_allocations, r.driver_deallocations, r.segments, r.seconds);
  if (!o.out.empty()) {
    std::ostringstream j;
    j << "{\n  \"benchmark\": \"replay\",\n  \"backend\": \"emmpool-host (bench_core)\",\n"
      << "  \"trace\": " << json_string(t.origin) << ",\n  \"live\": " << t.live
      << ",\n  \"ops\": " << t.ops.size() << ",\n  \"options\": {\"small_request\": "
      << o.pool.small_request << ", \"small_segment\": " << o.pool.small_segment
      << ", \"large_segment\": " << o.pool.large_segment
      << ", \"maximum_size\": " << o.pool.maximum_size << ", \"passthrough\": "
      << (o.pool.mode == emmpool::pool_mode::passthrough ? "true" : "false")
      << "},\n  \"capacity\": " << o.capacity << ",\n  \"peak_live\": " << r.peak_live
      << ",\n  \"peak_reserved\": " << r.peak_reserved << ",\n  \"ratio\": " << num(ratio)
      << ",\n  \"final_reserved\": " << r.final_reserved
      << ",\n  \"driver_allocations\": " << r.driver_allocations
      << ",\n  \"driver_deallocations\": " << r.driver_deallocations
      << ",\n  \"seconds\": " << num(r.seconds) << "\n}\n";
    write_file(o.out, j.str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv)
{
  auto const o = parse(argc, argv);
  try {
    if (o.replay) { return replay_main(o); }
    std::vector<result> results;
    std::string device;
    if (o.host) {
      device = host_benchmarks(o, results);
    } else {
      try {
        device = gpu_benchmarks(o, results);
      } catch (std::exception const& e) {
        std::fprintf(stderr, "bench_core: no usable GPU (%s); use --host to run without one\n",
                     e.what());
        return 3;
      }
    }
    std::printf("device: %s\n", device.c_str());
    std::printf("%-52s %9s %11s %11s %11s %13s\n", "allocator", "size", "median ns", "min ns",
                "p90 ns", "fences/query");
    for (auto const& r : results) {
      std::printf("%-52s %9s %11.0f %11.0f %11.0f", r.name.c_str(), size_label(r.size).c_str(),
                  r.median_ns, r.min_ns, r.p90_ns);
      if (r.fences_per_pair >= 0) {
        std::printf("  %.4f/%.4f", r.fences_per_pair, r.queries_per_pair);
      }
      std::printf("\n");
    }
    if (!o.out.empty()) {
      std::ostringstream j;
      j << "{\n  \"benchmark\": \"bench_core\",\n  \"unit\": \"ns per allocate+deallocate pair\","
        << "\n  \"statistic\": \"median of per-block means\",\n  \"device\": "
        << json_string(device) << ",\n  \"host_driver\": " << (o.host ? "true" : "false")
        << ",\n  \"quick\": " << (o.quick ? "true" : "false") << ",\n  \"results\": [\n";
      for (std::size_t i = 0; i < results.size(); ++i) {
        auto const& r = results[i];
        j << "    {\"allocator\": " << json_string(r.name) << ", \"what\": " << json_string(r.what)
          << ", \"size\": " << r.size << ", \"median_ns\": " << num(r.median_ns)
          << ", \"min_ns\": " << num(r.min_ns) << ", \"p90_ns\": " << num(r.p90_ns)
          << ", \"pairs_per_block\": " << r.pairs_per_block << ", \"blocks\": " << r.blocks;
        if (r.fences_per_pair >= 0) {
          j << ", \"fences_per_pair\": " << num(r.fences_per_pair)
            << ", \"queries_per_pair\": " << num(r.queries_per_pair);
        }
        j << "}"
          << (i + 1 < results.size() ? ",\n" : "\n");
      }
      j << "  ]\n}\n";
      write_file(o.out, j.str());
      std::printf("wrote %s\n", o.out.c_str());
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "bench_core: %s\n", e.what());
    return 1;
  }
  return 0;
}
