// pybind11 glue for emmpool._core. Glue only: no pool logic lives here. The hot pairs of the
// Numba plugin and of the cuda.core memory resource are plain CPython, in numba_entry_points.cpp
// and cuda_core_entry_points.cpp.
#include "cuda_core_entry_points.hpp"
#include "numba_entry_points.hpp"
#include "out_of_memory_callback.hpp"

#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/host_driver.hpp>
#include <emmpool/host_pool.hpp>
#include <emmpool/pool_controls.hpp>
#include <emmpool/pool_observers.hpp>
#include <emmpool/pool_queries.hpp>
#include <emmpool/pool_sharing.hpp>
#include <emmpool/registry.hpp>
#include <emmpool/rmm_api.h>

#include "c_api.hpp"
#include "caller_lock.hpp"
#include "cupy_adapter.hpp"
#include "pool_calls.hpp"
#include "python_gil.hpp"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

namespace py = pybind11;

extern "C" {
void* emmpool_torch_malloc(std::size_t, int, void*);
void emmpool_torch_free(void*, std::size_t, int, void*);
}

namespace emmpool::bindings {

// A pool's statistics as the dict stats() returns (also what an out-of-memory callback gets).
py::dict stats_dict(pool_stats const& s)
{
  py::dict d;
  d["bytes_in_use"]        = s.bytes_in_use;
  d["peak_bytes_in_use"]   = s.peak_bytes_in_use;
  d["bytes_reserved"]      = s.bytes_reserved;
  d["peak_bytes_reserved"] = s.peak_bytes_reserved;
  d["bytes_waiting"]       = s.bytes_waiting;
  d["bytes_free"]          = s.bytes_free;
  d["largest_free_block"]  = s.largest_free_block;
  d["blocks_in_use"]       = s.blocks_in_use;
  d["blocks_waiting"]      = s.blocks_waiting;
  d["segments"]            = s.segments;
  d["allocations"]         = s.allocations;
  d["frees"]               = s.frees;
  d["segment_allocations"] = s.segment_allocations;
  d["segment_releases"]    = s.segment_releases;
  d["batches_closed"]      = s.batches_closed;
  d["fence_queries"]       = s.fence_queries;
  d["same_stream_reuses"]  = s.same_stream_reuses;
  d["dormant_fences"]      = s.dormant_fences;
  d["fence_waits"]         = s.fence_waits;
  d["out_of_memory"]       = s.out_of_memory;
  d["page_maps"]           = s.page_maps;
  d["page_unmaps"]         = s.page_unmaps;
  d["page_creates"]        = s.page_creates;
  d["page_releases"]       = s.page_releases;
  py::dict by_tag;
  for (std::size_t i = 0; i < alloc_tag_count; ++i) {
    py::dict t;
    t["bytes_in_use"] = s.bytes_in_use_by_tag[i];
    t["allocations"]  = s.allocations_by_tag[i];
    by_tag[alloc_tag_names[i]] = t;
  }
  d["by_library"] = by_tag;
  return d;
}

}  // namespace emmpool::bindings

namespace {

using namespace emmpool;
using emmpool::bindings::stats_dict;


pool_mode parse_mode(std::string const& mode)
{
  if (mode == "pool") { return pool_mode::pool; }
  if (mode == "passthrough") { return pool_mode::passthrough; }
  throw std::invalid_argument{"unknown mode '" + mode + "': expected 'pool' or 'passthrough'"};
}

segment_kind parse_segments(std::string const& segments)
{
  if (segments == "fixed") { return segment_kind::fixed; }
  if (segments == "growable") { return segment_kind::growable; }
  throw std::invalid_argument{"unknown segments '" + segments +
                              "': expected 'fixed' or 'growable'"};
}

pool_options make_options(std::string const& mode, std::size_t initial_size,
                          std::size_t maximum_size, double maximum_fraction,
                          std::size_t small_request, std::size_t small_segment,
                          std::size_t large_segment)
{
  pool_options o;
  o.mode             = parse_mode(mode);
  o.initial_size     = initial_size;
  o.maximum_size     = maximum_size;
  o.maximum_fraction = maximum_fraction;
  o.small_request    = small_request;
  o.small_segment    = small_segment;
  o.large_segment    = large_segment;
  return o;
}

py::dict options_dict(pool_options const& o)
{
  py::dict d;
  d["mode"]             = o.mode == pool_mode::pool ? "pool" : "passthrough";
  d["initial_size"]     = o.initial_size;
  d["maximum_size"]     = o.maximum_size;
  d["maximum_fraction"] = o.maximum_fraction;
  d["small_request"]    = o.small_request;
  d["small_segment"]    = o.small_segment;
  d["large_segment"]    = o.large_segment;
  d["segments"]         = o.segments == segment_kind::growable ? "growable" : "fixed";
  d["growable_free_limit"] = o.growable_free_limit;
  d["growable_page_size"]  = o.growable_page_size;
  return d;
}


alloc_tag to_tag(int tag)
{
  if (tag < 0 || tag >= static_cast<int>(alloc_tag_count)) {
    std::string what = "tag must be one of";
    for (std::size_t i = 0; i < alloc_tag_count; ++i) {
      what += (i == 0 ? " " : ", ") + std::to_string(i) + " (" + alloc_tag_names[i] + ")";
    }
    throw std::invalid_argument{what};
  }
  return static_cast<alloc_tag>(tag);
}

// A hidden helper for tests: raise each C++ exception kind, to check how it maps to Python.
void raise_for_test(std::string const& kind)
{
  if (kind == "cuda") { throw cuda_error{"cuTest", 2, "CUDA_ERROR_OUT_OF_MEMORY", "test"}; }
  if (kind == "driver") { throw driver_unavailable{"cuInit", 100, "test: no driver."}; }
  if (kind == "oom") { throw out_of_memory{"test out of memory"}; }
  if (kind == "pool") { throw pool_error{"test pool error"}; }
  if (kind == "invalid") { throw std::invalid_argument{"test invalid argument"}; }
  throw std::invalid_argument{"unknown kind"};
}

// A pool method bound to run without the GIL (a thread holding the pool's mutex may be waiting
// for GPU work queued behind a host callback that needs the GIL). Not pybind11's
// gil_scoped_release: it takes the GIL back in a destructor, and a daemon thread that does so
// while the interpreter finalizes is ended by an unwind that aborts there (caller_lock.hpp).
// C is the class that declares the method: not for one of a private base (`generation`).
template <class R, class C, class... A, bool NE>
auto without_gil(R (C::*method)(A...) noexcept(NE))
{
  return [method](C& self, A... args) -> R {
    return caller_lock::without_caller_lock(
      [&]() -> R { return (self.*method)(std::forward<A>(args)...); });
  };
}
template <class R, class C, class... A, bool NE>
auto without_gil(R (C::*method)(A...) const noexcept(NE))
{
  return [method](C const& self, A... args) -> R {
    return caller_lock::without_caller_lock(
      [&]() -> R { return (self.*method)(std::forward<A>(args)...); });
  };
}

// A method of one of the pool's views (pool_controls, pool_queries, pool_sharing,
// pool_observers) bound as the pool's own, run without the GIL as above.
template <class V, class R, class... A, bool NE>
auto through(R (V::*method)(A...) noexcept(NE))
{
  return [method](device_pool& self, A... args) -> R {
    return caller_lock::without_caller_lock(
      [&]() -> R { return (V{self}.*method)(std::forward<A>(args)...); });
  };
}
template <class V, class R, class... A, bool NE>
auto through(R (V::*method)(A...) const noexcept(NE))
{
  return [method](device_pool& self, A... args) -> R {
    return caller_lock::without_caller_lock(
      [&]() -> R { return (V{self}.*method)(std::forward<A>(args)...); });
  };
}

}  // namespace

PYBIND11_MODULE(_core, m)
{
  m.doc() = "emmpool's C++ core: device pools over one CUDA driver seam (private module)";

  // Exception types live as long as the interpreter (never decref'ed: no teardown ordering).
  static PyObject* cuda_exc = PyErr_NewException("emmpool._core.CudaError", PyExc_RuntimeError, nullptr);
  static PyObject* driver_exc =
    PyErr_NewException("emmpool._core.DriverUnavailableError", cuda_exc, nullptr);
  static PyObject* oom_exc =
    PyErr_NewException("emmpool._core.OutOfMemoryError", PyExc_MemoryError, nullptr);
  static PyObject* pool_exc = PyErr_NewException("emmpool._core.PoolError", PyExc_RuntimeError, nullptr);
  m.add_object("CudaError", py::handle(cuda_exc));
  m.add_object("DriverUnavailableError", py::handle(driver_exc));
  m.add_object("OutOfMemoryError", py::handle(oom_exc));
  m.add_object("PoolError", py::handle(pool_exc));
  py::register_exception_translator([](std::exception_ptr p) {
    auto raise_cuda = [](PyObject* type, cuda_error const& e) {
      py::object exc = py::reinterpret_borrow<py::object>(type)(py::str(e.what()));
      exc.attr("code") = e.code();
      exc.attr("call") = e.call();
      PyErr_SetObject(type, exc.ptr());
    };
    try {
      if (p) { std::rethrow_exception(p); }
    } catch (driver_unavailable const& e) {
      raise_cuda(driver_exc, e);
    } catch (cuda_error const& e) {
      raise_cuda(cuda_exc, e);
    } catch (out_of_memory const& e) {
      PyObject* const exc = PyObject_CallFunction(oom_exc, "s", e.what());
      if (exc == nullptr) { return; }  // its own error is set
      emmpool::bindings::chain_callback_error(exc, e.what());
      PyErr_SetObject(oom_exc, exc);
      Py_DECREF(exc);
    } catch (pool_error const& e) {
      PyErr_SetString(pool_exc, e.what());
    }
  });

  m.attr("LEGACY_STREAM")     = legacy_stream;
  m.attr("PER_THREAD_STREAM") = per_thread_stream;
  m.attr("ALLOCATION_STREAM") = allocation_stream;
  m.attr("ALIGNMENT")         = device_pool::alignment;
  {
    py::tuple names(alloc_tag_count);
    for (std::size_t i = 0; i < alloc_tag_count; ++i) { names[i] = alloc_tag_names[i]; }
    m.attr("LIBRARIES") = names;
  }

  py::class_<host_driver>(m, "HostDriver",
                          "A driver with no GPU (fake address space, hand-completed events), for "
                          "testing the pool logic")
    .def(py::init<int, std::size_t>(), py::arg("devices") = 1,
         py::arg("capacity") = std::size_t{1} << 34)
    .def("complete_all_events", &host_driver::complete_all_events)
    .def("set_auto_complete", &host_driver::set_auto_complete, py::arg("on"))
    .def(
      "set_sync_wait",
      [](host_driver& d, py::object wait) {
        if (wait.is_none()) {
          d.set_sync_wait({});
          return;
        }
        // Called without the GIL (the pool lets go of it around a wait for the GPU).
        auto held = std::shared_ptr<py::object>(new py::object(std::move(wait)), [](py::object* o) {
          py::gil_scoped_acquire gil;
          delete o;
        });
        d.set_sync_wait([held] {
          // On a thread of its own, as CUDA runs host callbacks: it deadlocks if the thread
          // waiting for the GPU holds the GIL.
          std::thread callback{[held] {
            py::gil_scoped_acquire gil;
            try {
              (*held)();
            } catch (py::error_already_set& e) {
              e.discard_as_unraisable("emmpool HostDriver sync wait");
            }
          }};
          callback.join();
        });
      },
      py::arg("wait"),
      "Every event and device synchronization waits for wait() to run on a thread of its own, "
      "holding the GIL there: GPU work queued behind a host callback that needs the GIL. "
      "None: stop.")
    .def("fail_next_allocations", &host_driver::fail_next_allocations, py::arg("n"))
    .def("fail_next_event_records", &host_driver::fail_next_event_records, py::arg("n"))
    .def("fail_next_deallocations", &host_driver::fail_next_deallocations, py::arg("n"))
    .def("fail_next_device_syncs", &host_driver::fail_next_device_syncs, py::arg("n"))
    .def("set_vmm_supported", &host_driver::set_vmm_supported, py::arg("on"),
         "Off: the device lacks virtual memory management (growable segments fall back).")
    .def("fail_next_creates", &host_driver::fail_next_creates, py::arg("n"))
    .def("fail_next_maps", &host_driver::fail_next_maps, py::arg("n"), py::arg("after") = 0)
    .def("fail_next_exports", &host_driver::fail_next_exports, py::arg("n"), py::arg("after") = 0)
    .def("fail_next_imports", &host_driver::fail_next_imports, py::arg("n"), py::arg("after") = 0)
    .def("fail_next_unmaps", &host_driver::fail_next_unmaps, py::arg("n"))
    .def("fail_next_reservations", &host_driver::fail_next_reservations, py::arg("n"))
    .def("accessible", &host_driver::accessible, py::arg("device"), py::arg("ptr"),
         py::arg("size"), "Whether the range is memory: a live segment or mapped pages.")
    .def("set_capacity", &host_driver::set_capacity, py::arg("device"), py::arg("bytes"))
    .def("invalidate_device", &host_driver::invalidate_device, py::arg("device"))
    .def("create_stream", &host_driver::create_stream,
         "A new stream (a destroyed stream's handle may be reused, as CUDA may).")
    .def("destroy_stream", &host_driver::destroy_stream, py::arg("stream"),
         "Destroy a stream: any later use of its handle raises (see host_driver.hpp).")
    .def("stats", [](host_driver const& d) {
      auto const c = d.stats();
      py::dict out;
      out["allocations"]    = c.allocations;
      out["deallocations"]  = c.deallocations;
      out["event_records"]  = c.event_records;
      out["event_queries"]  = c.event_queries;
      out["event_syncs"]    = c.event_syncs;
      out["bytes_reserved"] = c.bytes_reserved;
      out["live_segments"]  = c.live_segments;
      out["live_events"]    = c.live_events;
      out["context_releases"] = c.context_releases;
      out["device_syncs"]     = c.device_syncs;
      out["stream_id_queries"] = c.stream_id_queries;
      out["dead_stream_uses"]  = c.dead_stream_uses;
      out["maps"]              = c.maps;
      out["unmaps"]            = c.unmaps;
      out["bytes_mapped"]      = c.bytes_mapped;
      out["live_mappings"]     = c.live_mappings;
      out["creates"]           = c.creates;
      out["releases"]          = c.releases;
      out["exports"]           = c.exports;
      out["imports"]           = c.imports;
      out["bytes_physical"]    = c.bytes_physical;
      out["live_handles"]      = c.live_handles;
      out["live_exports"]      = c.live_exports;
      out["live_reservations"] = c.live_reservations;
      return out;
    });

  py::class_<device_pool>(m, "DevicePool", "A stream-safe pool of one device's memory")
    .def(py::init([](host_driver* drv, int device, std::string const& mode,
                     std::size_t initial_size, std::size_t maximum_size, double maximum_fraction,
                     std::size_t small_request, std::size_t small_segment,
                     std::size_t large_segment, std::string const& segments,
                     std::optional<std::size_t> growable_room,
                     std::optional<std::size_t> growable_free_limit,
                     std::size_t growable_page_size) {
           driver& d = drv != nullptr ? static_cast<driver&>(*drv) : cuda_driver();
           auto o    = make_options(mode, initial_size, maximum_size, maximum_fraction,
                                    small_request, small_segment, large_segment);
           o.segments = parse_segments(segments);
           if (growable_room) { o.growable_room = *growable_room; }
           if (growable_free_limit) { o.growable_free_limit = *growable_free_limit; }
           o.growable_page_size = growable_page_size;
           return new device_pool{d, device, o};
         }),
         py::arg("driver"), py::arg("device") = 0, py::kw_only(), py::arg("mode") = "pool",
         py::arg("initial_size") = 0, py::arg("maximum_size") = 0,
         py::arg("maximum_fraction") = 0.0, py::arg("small_request") = pool_options{}.small_request,
         py::arg("small_segment") = pool_options{}.small_segment,
         py::arg("large_segment") = pool_options{}.large_segment, py::arg("segments") = "growable",
         py::arg("growable_room") = py::none(),
         py::arg("growable_free_limit") = py::none(),
         py::arg("growable_page_size") = default_growable_page_size, py::keep_alive<1, 2>())
    // Every call that takes a pool's mutex lets go of the GIL first: a thread holding that
    // mutex may be waiting for GPU work queued behind a host callback that needs the GIL. The
    // hot pair first tries without letting go (pool_calls.hpp).
    .def(
      "allocate",
      [](device_pool& p, std::size_t size, stream_handle stream, int tag) {
        return pool_calls::allocate(p, size, stream, to_tag(tag));
      },
      py::arg("size"), py::arg("stream") = legacy_stream, py::arg("tag") = 0)
    .def(
      "deallocate",
      [](device_pool& p, device_ptr ptr, stream_handle stream, std::optional<std::uint64_t> gen) {
        if (gen) {
          pool_calls::deallocate(p, ptr, stream, block_owner::of_generation(*gen));
        } else {
          caller_lock::without_caller_lock([&] { p.deallocate(ptr, stream); });
        }
      },
      py::arg("ptr"), py::arg("stream") = legacy_stream, py::arg("generation") = py::none())
    .def(
      "deallocate_tagged",
      [](device_pool& p, device_ptr ptr, stream_handle stream, int tag) {
        pool_calls::deallocate(p, ptr, stream, block_owner::of_library(to_tag(tag)));
      },
      py::arg("ptr"), py::arg("stream"), py::arg("tag"),
      "The free of a library that knows no reset generation (block_owner::of_library).")
    .def("record_stream", without_gil(&device_pool::record_stream), py::arg("ptr"),
         py::arg("stream"))
    .def("owns", through(&pool_queries::owns), py::arg("ptr"))
    .def(
      "hold",
      [](device_pool& p, device_ptr ptr) {
        return caller_lock::without_caller_lock([&] { return pool_sharing{p}.hold(ptr); });
      },
      py::arg("ptr"), "Keep the block holding ptr from reuse until release_hold(): its address.")
    .def(
      "release_hold",
      [](device_pool& p, device_ptr block) {
        caller_lock::without_caller_lock([&] { pool_sharing{p}.release_hold(block); });
      },
      py::arg("block"))
    .def("held_blocks", through(&pool_sharing::held_blocks))
    .def(
      "ipc_handle",
      [](device_pool& p, device_ptr ptr) -> py::object {
        auto const info = caller_lock::without_caller_lock([&] { return pool_sharing{p}.ipc_handle(ptr); });
        if (!info) { return py::none(); }
        auto const* bytes = reinterpret_cast<char const*>(info->handle.data());
        return py::make_tuple(py::bytes(bytes, info->handle.size()), info->segment_base,
                              info->segment_size, info->offset);
      },
      py::arg("ptr"))
    .def(
      "share_pages",
      [](device_pool& p, device_ptr ptr) -> py::object {
        auto const shared = caller_lock::without_caller_lock([&] { return pool_sharing{p}.share_pages(ptr); });
        if (!shared) { return py::none(); }
        py::tuple fds(shared->fds.size());
        for (std::size_t i = 0; i < shared->fds.size(); ++i) { fds[i] = shared->fds[i]; }
        return py::make_tuple(
          shared->first_page, shared->page_size, shared->offset, shared->block_size, fds,
          py::bytes(reinterpret_cast<char const*>(shared->key.data()), shared->key.size()));
      },
      py::arg("ptr"),
      "(first page, page size, offset of ptr, block bytes from ptr on, the pool's descriptor "
      "per page, the block's key) of the growable block holding ptr, else None "
      "(pool_sharing.hpp).")
    .def(
      "live_extent",
      [](device_pool& p, device_ptr ptr) -> py::object {
        auto const extent = caller_lock::without_caller_lock([&] { return pool_queries{p}.live_extent(ptr); });
        if (!extent) { return py::none(); }
        return py::make_tuple(extent->first, extent->second);
      },
      py::arg("ptr"),
      "(address, size) of the live block holding ptr (which may point inside it), else None.")
    .def("trim", without_gil(&device_pool::trim))
    .def("synchronize", without_gil(&device_pool::synchronize))
    .def("reset", through(&pool_controls::reset))
    .def("defer_cleanup_begin", through(&pool_controls::defer_cleanup_begin))
    .def("defer_cleanup_end", through(&pool_controls::defer_cleanup_end))
    .def("set_tracing", through(&pool_observers::set_tracing), py::arg("on"))
    .def(
      "take_trace",
      [](device_pool& p) {
        auto const records = caller_lock::without_caller_lock([&] { return pool_observers{p}.take_trace(); });
        py::list out;
        for (auto const& r : records) {
          out.append(py::make_tuple(r.time_ns, std::string(1, r.op), r.ptr, r.size, r.stream,
                                    static_cast<int>(r.tag)));
        }
        return out;
      },
      "Records since the last call: (time_ns, 'a'|'f', ptr, size, stream, tag), oldest first.")
    .def("stats",
         [](device_pool const& p) {
           return stats_dict(caller_lock::without_caller_lock([&] { return p.stats(); }));
         })
    .def("reset_peaks", through(&pool_controls::reset_peaks))
    .def("describe", through(&pool_queries::describe))
    .def_property_readonly("generation", [](device_pool const& p) {
      return caller_lock::without_caller_lock([&] { return p.generation(); });  // under the lock
    })
    .def_property_readonly("forked", [](device_pool const& p) {
      return caller_lock::without_caller_lock([&] { return p.forked(); });
    })
    .def_property_readonly("device", &device_pool::device)
    .def_property_readonly("options", [](device_pool const& p) { return options_dict(p.options()); })
    .def_property_readonly("growable", &device_pool::growable,
                           "Whether growable segments are in use (asked for and supported).");

  py::class_<host_pool>(m, "HostPool", "A cache of pinned host memory for one device's context")
    .def(py::init([](host_driver* drv, int device, std::size_t limit) {
           driver& d = drv != nullptr ? static_cast<driver&>(*drv) : cuda_driver();
           return new host_pool{d, device, limit};
         }),
         py::arg("driver"), py::arg("device") = 0, py::kw_only(), py::arg("limit") = 0,
         py::keep_alive<1, 2>())
    .def_static("size_class", &host_pool::size_class, py::arg("bytes"))
    .def(
      "allocate",
      [](host_pool& p, std::size_t size, unsigned flags) {
        return reinterpret_cast<std::uintptr_t>(
          caller_lock::without_caller_lock([&] { return p.allocate(size, flags); }));
      },
      py::arg("size"), py::arg("flags") = 0)
    .def(
      "allocate_labelled",
      [](host_pool& p, std::size_t size, unsigned flags) {
        // The plugin's memhostalloc: without the GIL as the Numba entry points (a daemon
        // thread's end at exit unwinds here: caller_lock.hpp; pybind11's dispatcher lets it).
        std::uint64_t generation = 0;
        void* const ptr          = caller_lock::without_caller_lock(
          [&] { return p.allocate(size, flags, &generation); });
        return py::make_tuple(reinterpret_cast<std::uintptr_t>(ptr), generation);
      },
      py::arg("size"), py::arg("flags") = 0,
      "(address, the reset generation it was allocated in): to free it with, whatever reset "
      "another thread makes meanwhile")
    .def(
      "deallocate",
      [](host_pool& p, std::uintptr_t ptr, stream_handle stream, std::optional<std::uint64_t> gen) {
        caller_lock::without_caller_lock([&] {
          if (gen) {
            p.deallocate(reinterpret_cast<void*>(ptr), stream, *gen);
          } else {
            p.deallocate(reinterpret_cast<void*>(ptr), stream);
          }
        });
      },
      py::arg("ptr"), py::arg("stream") = legacy_stream, py::arg("generation") = py::none())
    .def(
      "register_memory",
      [](host_pool& p, std::uintptr_t ptr, std::size_t size, unsigned flags) {
        caller_lock::without_caller_lock(
          [&] { p.register_memory(reinterpret_cast<void*>(ptr), size, flags); });
      },
      py::arg("ptr"), py::arg("size"), py::arg("flags") = 0)
    .def(
      "unregister_memory",
      [](host_pool& p, std::uintptr_t ptr) {
        caller_lock::without_caller_lock(
          [&] { p.unregister_memory(reinterpret_cast<void*>(ptr)); });
      },
      py::arg("ptr"))
    .def("trim", without_gil(&host_pool::trim))
    .def("reset", without_gil(&host_pool::reset))
    .def("defer_cleanup_begin", without_gil(&host_pool::defer_cleanup_begin))
    .def("defer_cleanup_end", without_gil(&host_pool::defer_cleanup_end))
    .def_property_readonly("generation", [](host_pool const& p) {
      return caller_lock::without_caller_lock([&] { return p.generation(); });
    })
    .def_property_readonly("device", &host_pool::device)
    .def("stats", [](host_pool const& p) {
      auto const s = caller_lock::without_caller_lock([&] { return p.stats(); });
      py::dict d;
      d["bytes_in_use"]       = s.bytes_in_use;
      d["bytes_waiting"]      = s.bytes_waiting;
      d["bytes_cached"]       = s.bytes_cached;
      d["bytes_held"]         = s.bytes_held;
      d["peak_bytes_held"]    = s.peak_bytes_held;
      d["limit"]              = s.limit;
      d["bytes_registered"]   = s.bytes_registered;
      d["allocations"]        = s.allocations;
      d["cache_hits"]         = s.cache_hits;
      d["driver_allocations"] = s.driver_allocations;
      d["driver_frees"]       = s.driver_frees;
      return d;
    });
  m.attr("MAX_GROWABLE_PAGE_SIZE")      = max_growable_page_size;
  m.attr("DEFAULT_GROWABLE_PAGE_SIZE")  = default_growable_page_size;
  m.attr("DEFAULT_GROWABLE_FREE_LIMIT") = default_growable_free_limit;
  m.attr("HOST_PORTABLE")      = static_cast<unsigned>(host_portable);
  m.attr("HOST_MAPPED")        = static_cast<unsigned>(host_mapped);
  m.attr("HOST_WRITECOMBINED") = static_cast<unsigned>(host_writecombined);

  // ---- the process-wide pools, over the CUDA driver ---------------------------------------
  m.def(
    "configure",
    [](std::string const& mode, std::size_t initial_size, std::size_t maximum_size,
       double maximum_fraction, std::size_t pinned_limit, std::string const& segments,
       std::optional<std::size_t> growable_free_limit, std::size_t growable_page_size) {
      pool_options o = pool_registry::instance().options();
      o.mode             = parse_mode(mode);
      o.segments         = parse_segments(segments);
      o.initial_size     = initial_size;
      o.maximum_size     = maximum_size;
      o.maximum_fraction = maximum_fraction;
      o.growable_free_limit =
        growable_free_limit.value_or(pool_options{}.growable_free_limit);
      o.growable_page_size = growable_page_size;
      pool_registry::instance().configure(o, pinned_limit);
    },
    py::kw_only(), py::arg("mode") = "pool", py::arg("initial_size") = 0,
    py::arg("maximum_size") = 0, py::arg("maximum_fraction") = 0.0, py::arg("pinned_limit") = 0,
    py::arg("segments") = "growable", py::arg("growable_free_limit") = py::none(),
    py::arg("growable_page_size") = default_growable_page_size,
    "Set the options of the process-wide pools; only before the first one exists.");
  m.def(
    "set_tracing",
    [](bool on) {
      caller_lock::without_caller_lock([&] { pool_registry::instance().set_tracing(on); });
    },
    py::arg("on"),
    "Trace every process-wide pool, present and future.");
  m.def("configured_options", [] {
    auto& registry     = pool_registry::instance();
    py::dict d         = options_dict(registry.options());
    d["pinned_limit"] = registry.pinned_limit();
    return d;
  });
  m.def(
    "pool",
    [](int device) -> device_pool& {
      auto& registry = pool_registry::instance();
      return *caller_lock::without_caller_lock([&] { return &registry.pool(device); });
    },
    py::arg("device"), py::return_value_policy::reference,
    "The process-wide pool of a device, created on first use.");
  m.def(
    "pinned_pool",
    [](int device) -> host_pool& {
      auto& registry = pool_registry::instance();
      return *caller_lock::without_caller_lock([&] { return &registry.pinned(device); });
    },
    py::arg("device"), py::return_value_policy::reference,
    "The process-wide pinned-host pool of a device's context, created on first use.");
  m.def("pinned_pools", [] {
    py::list out;
    for (auto* p : pool_registry::instance().pinned_pools()) {
      out.append(py::cast(p, py::return_value_policy::reference));
    }
    return out;
  });
  m.def("pools", [] {
    py::list out;
    for (auto* p : pool_registry::instance().pools()) {
      out.append(py::cast(p, py::return_value_policy::reference));
    }
    return out;
  });
  m.def("driver_name", [] { return pool_registry::instance().get_driver().name(); });
  m.def(
    "_use_driver_for_all_pools",
    [](py::object host) {
      auto& drv = host.cast<host_driver&>();
      pool_registry::instance().use_driver(drv);
      host.inc_ref();  // the pools never die: neither may their driver
    },
    py::arg("host_driver"),
    "For tests without a GPU: the process-wide pools (and so the CuPy and PyTorch entry "
    "points) use this HostDriver. Only before the first pool exists.");
  m.def(
    "ipc_service_address",
    [] { return py::bytes(pool_registry::instance().service().address()); },
    "The address of this process's IPC service, started on first use (ipc_service.hpp).");
  m.def(
    "ipc_service_stats",
    [] {
      auto& service = pool_registry::instance().service();
      py::dict out;
      out["leases"]  = service.leases();
      out["served"]  = service.served();
      out["refused"] = service.refused();
      return out;
    },
    "Leases open, requests served and refused by this process's IPC service.");
  m.def(
    "ipc_lease",
    [](int device, device_ptr ptr) {
      return caller_lock::without_caller_lock(
        [&] { return pool_registry::instance().service().lease(device, ptr); });
    },
    py::arg("device"), py::arg("ptr"),
    "Hold the block of the device's pool holding ptr until every copy of the returned "
    "descriptor is closed, in any process: (descriptor, block address).");
  m.def(
    "ipc_open_offer",
    [](int device, py::bytes address, py::bytes key, int sender_device, device_ptr first_page,
       std::size_t page_size, std::vector<int> const& fds) {
      page_offer offer;
      offer.address  = std::string{address};
      auto const k = std::string{key};
      if (k.size() != offer.key.size()) {
        throw std::invalid_argument{"a shared block's key has 16 bytes, not " +
                                    std::to_string(k.size())};
      }
      std::memcpy(offer.key.data(), k.data(), k.size());
      offer.device     = sender_device;
      offer.first_page = first_page;
      offer.page_size  = page_size;
      offer.fds        = fds;
      return caller_lock::without_caller_lock(
        [&] { return pool_registry::instance().imports().open_offer(device, offer); });
    },
    py::arg("device"), py::arg("address"), py::arg("key"), py::arg("sender_device"),
    py::arg("first_page"), py::arg("page_size"), py::arg("fds"),
    "Map another process's pages on a device, their descriptors asked of its IPC service: "
    "their base.");
  m.def(
    "ipc_open_handle",
    [](int device, py::bytes handle) {
      auto const text = std::string{handle};
      ipc_bytes h{};
      if (text.size() != h.size()) {
        throw std::invalid_argument{"a CUDA IPC handle has 64 bytes, not " +
                                    std::to_string(text.size())};
      }
      std::memcpy(h.data(), text.data(), h.size());
      return caller_lock::without_caller_lock(
        [&] { return pool_registry::instance().imports().open_handle(device, h); });
    },
    py::arg("device"), py::arg("handle"),
    "Map another process's legacy CUDA IPC handle on a device: its base.");
  m.def(
    "ipc_close",
    [](device_ptr base) {
      caller_lock::without_caller_lock([&] { pool_registry::instance().imports().close(base); });
    },
    py::arg("base"), "Unmap an import (ipc_open_pages, ipc_open_handle), the device synchronized.");
  m.def("ipc_open_count", [] { return pool_registry::instance().imports().open_count(); });
  m.def("device_count", [] { return cuda_driver().device_count(); });
  m.def(
    "vmm_page_size", [](int device) { return cuda_driver().vmm_page_size(device); },
    py::arg("device"),
    "The driver's page granularity for growable segments on a device; 0 where it has none.");
  m.def("current_device", [] { return cuda_driver().current_device(); });
  m.def(
    "memory_info",
    [](int device) {
      auto const i = cuda_driver().memory_info_of(device);
      return py::make_tuple(i.free, i.total);
    },
    py::arg("device"));
  bind_cupy(m);  // cupy_malloc, set_cupy_failure, set_cupy_stream_source
  m.def("c_function_addresses", [] {
    py::dict d;
    d["cupy_malloc"]  = reinterpret_cast<std::uintptr_t>(&emmpool_cupy_malloc);
    d["cupy_free"]    = reinterpret_cast<std::uintptr_t>(&emmpool_cupy_free);
    d["torch_malloc"] = reinterpret_cast<std::uintptr_t>(&emmpool_torch_malloc);
    d["torch_free"]   = reinterpret_cast<std::uintptr_t>(&emmpool_torch_free);
    return d;
  });
  m.def(
    "_rmm_api",
    [] {
      return py::capsule(const_cast<emmpool_rmm_api*>(emmpool::c_api::rmm_api()),
                         EMMPOOL_RMM_CAPSULE);
    },
    "emmpool/rmm_api.h's table, for the native RMM resource (emmpool._rmm).");
  m.def("_raise_for_test", &raise_for_test, py::arg("kind"));

  emmpool::bindings::add_numba_entry_points(m.ptr());
  emmpool::bindings::add_cuda_core_entry_points(m.ptr());
  emmpool::bindings::add_out_of_memory_callback(m);
  // The entry points' caller lock (caller_lock.hpp) is the GIL: CuPy calls them holding it.
  emmpool::caller_lock::install({&emmpool::python::let_go_of_gil, &emmpool::python::take_gil_back});
}
