#!/usr/bin/env python3
""".ci/mutants.py -- one-line changes that break a promise of emmpool's, each of which a test
must catch. A change that touches one of these lines, or the tests that guard it, runs this.

    python3 .ci/mutants.py              every mutant: apply it, build, run its tests, restore
    python3 .ci/mutants.py --list       the mutants and the promise each breaks
    python3 .ci/mutants.py ID ...       those mutants only

Each mutant names a file, a snippet that occurs in it exactly once and what replaces it, and the
tests that must fail: C++ tests by CTest name pattern (both segment kinds' runs), Python tests by
pytest selection. The work happens in a scratch copy of the working tree (tracked and untracked
files that git does not ignore), built once with the C++ tests and the Python extension; each
mutant rebuilds what it touched there, so the checkout is never changed. Python tests run
against the scratch build (its emmpool package first on PYTHONPATH), with the Python that runs
this script, which must have emmpool's test dependencies (pip install '.[test]'). The verdict:
one line per mutant, CAUGHT (with the tests that failed) or SURVIVED; the exit status is 1 if
any survived, 2 if a build failed. tests/test_ci_tools.py checks, without building, that every
snippet still occurs once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    promise: str
    file: str
    find: str
    replace: str
    ctest: str = ""     # a CTest -R pattern of the C++ tests that must catch it
    pytest: tuple = ()  # pytest selections (paths, or path::test) that must catch it


KEY_TEST = ("tests/test_ipc.py::test_the_sender_serves_only_the_block_of_the_key_while_it_is_"
            "the_one_shared")

MUTANTS = (
    Mutant("undo-map", "a map undone gives back what it made and keeps what was held",
           "cpp/src/growable_segment.cpp",
           "it->second ? unmapped_pages::release : unmapped_pages::keep_spare",
           "it->second ? unmapped_pages::keep_spare : unmapped_pages::release",
           ctest="map_undone"),
    Mutant("capture-wait", "a graph capture never waits at a growable new peak",
           "cpp/src/device_pool.cpp",
           "r.at_peak == peak_wait::none && capture_.may_fence() &&",
           "r.at_peak == peak_wait::none &&", ctest="capture"),
    Mutant("wait-once", "the new-peak wait is tried once, for a stream it can wait for",
           "cpp/src/device_pool.cpp", "r.key.identified() && r.at_peak == peak_wait::none &&",
           "!r.key.is_none() &&",
           ctest="growable_a_new_peak"),
    Mutant("own-stream-wait", "the new-peak wait takes its own stream's frees, no other's",
           "cpp/src/device_pool.cpp", "  drain(r.key);\n", "  drain();\n",
           ctest="growable_new_peak"),
    Mutant("cap-give-back", "new pages past the cap give wholly free fixed memory back first",
           "cpp/src/device_pool.cpp",
           "if (fresh != 0 && !cap_.fits(ledger_.reserved(), fresh)) {", "if (false) {",
           ctest="growable_new_pages_past_the_cap"),
    Mutant("placement", "a request reuses mapped pages of a larger free block before mapping any",
           "cpp/include/emmpool/detail/page_policy.hpp",
           "static constexpr int placement_candidates = 16;",
           "static constexpr int placement_candidates = 0;",
           ctest="growable_a_request"),
    Mutant("failed-map-undo", "a failed growable request leaves no more mapped than before",
           "cpp/src/growable_space.cpp",
           "auto const failure = u == unmapping::allowed ? growable_pages::on_failure::undo",
           "auto const failure = false ? growable_pages::on_failure::undo",
           ctest="growable_a_(map|failed)"),
    Mutant("largest-free", "largest_free_block counts the growable segment's free blocks",
           "cpp/src/device_pool.cpp",
           "std::max(free_.largest(), growable_.largest_free())", "free_.largest()",
           ctest="largest"),
    Mutant("page-fd-close", "the pool closes a page's exported descriptor with the page",
           "cpp/src/growable_segment.cpp", "    ::close(it->second);\n", "\n",
           ctest="growable_(exported|an_export|blocks_share)"),
    Mutant("held-free", "a held block's free waits for the last release",
           "cpp/src/device_pool.cpp", "  if (blk->held) {", "  if (false) {",
           ctest="a_held_block", pytest=("tests/test_ipc.py::test_the_block_is_held_until_"
                                         "every_copy_and_import_is_closed",)),
    Mutant("held-fast-free", "the fast free leaves a held block to the full one",
           "cpp/src/device_pool.cpp",
           "!reuse_rule::free_is_local(*it->second, stream) || it->second->held)",
           "!reuse_rule::free_is_local(*it->second, stream))", ctest="a_held_block"),
    Mutant("reset-holds", "a reset releases every hold", "cpp/src/pool_controls.cpp",
           "  p.release_holds();", "  // p.release_holds();",
           ctest="a_reset_releases_every_hold"),
    Mutant("stale-pages", "pages are handed to another process only while they are the block's",
           "cpp/src/growable_space.cpp",
           "pages_->exported_at(first_page + i * page) != fds[i]) { return false; }",
           "false) { return false; }", ctest="growable_shared_pages"),
    Mutant("share-key", "the IPC service serves a block's pages only to a holder of its key",
           "cpp/src/pool_sharing.cpp",
           "    if (detail::same_key(key, it->second)) { shared = it->first; }",
           "    shared = it->first;", ctest="growable_shared_pages",
           pytest=(KEY_TEST,)),
    Mutant("share-forgotten", "a freed block's key reaches no block at its address after it",
           "cpp/include/emmpool/device_pool.hpp",
           "    if (!shares_.empty()) { shares_.erase(at); }", "    (void)at;",
           ctest="growable_shared_pages|growable_a_held_block_keeps", pytest=(KEY_TEST,)),
    Mutant("lease-end", "only a lease's last close lets its block go, not bytes written to it",
           "cpp/src/ipc_service.cpp", "    if (k == 0) { return true; }", "    return true;",
           pytest=("tests/test_ipc.py::test_the_block_is_held_until_every_copy_and_import_is_"
                   "closed",)),
    Mutant("accept-rest", "the IPC service does not spin when it cannot accept a connection",
           "cpp/src/ipc_service.cpp", "        paused = true;", "        paused = false;",
           pytest=("tests/test_ipc.py::test_the_service_rests_while_the_process_has_no_"
                   "descriptor_to_accept_with",)),
    Mutant("serve-apart", "a silent peer delays no other request and no lease's end",
           "cpp/src/ipc_service.cpp", "        accept_one(c);",
           "        serve(c);\n        ::close(c);",
           pytest=("tests/test_ipc.py::test_the_service_survives_what_a_stranger_sends_it",)),
    Mutant("export-budget", "an export counts its descriptors against the limit first",
           "cpp/src/growable_space.cpp",
           "  reserve_descriptors(fresh * driver_->descriptors_per_export(),", "  (void)(fresh * "
           "driver_->descriptors_per_export(),",
           pytest=("tests/test_ipc.py::test_descriptors_are_counted_against_the_limit_before_any_"
                   "is_opened",)),
    Mutant("lease-owned", "a handle's copy owns its lease: collected, it lets the block go",
           "python/emmpool/ipc.py",
           "self._release = weakref.finalize(self, _close_fd, lease) if lease >= 0 else None",
           "self._release = None",
           pytest=("tests/test_ipc.py::test_the_block_is_held_until_every_copy_and_import_is_"
                   "closed",)),
    Mutant("open-checks", "open() checks what a handle describes before it maps anything",
           "python/emmpool/ipc.py", "        _check_description(self)\n", "\n",
           pytest=("tests/test_ipc.py::test_open_checks_what_a_handle_describes_before_it_"
                   "maps_anything",)),
    Mutant("close-order", "an import lets the sender's block go only after its unmap",
           "python/emmpool/ipc.py",
           "            _core.ipc_close(self._base)  # raises: still open, close() again\n",
           "            _close_fd(self._lease)\n            _core.ipc_close(self._base)\n",
           pytest=("tests/test_ipc.py::test_a_close_whose_synchronization_failed_can_be_"
                   "retried",)),
)


def sh(cmd, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def scratch_copy(into: Path) -> None:
    """The working tree as git sees it (tracked and untracked-not-ignored files)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        src = REPO / name
        if src.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, into / name)


def configure(src: Path, build: Path) -> str | None:
    try:
        import pybind11  # a build requirement of emmpool's
    except ImportError:
        return f"{sys.executable} has no pybind11, which the build needs: pip install pybind11"

    p = sh(["cmake", "-S", str(src), "-B", str(build), "-DEMMPOOL_BUILD_TESTS=ON",
            "-DEMMPOOL_BUILD_PYTHON=ON", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}"], cwd=src)
    return None if p.returncode == 0 else p.stdout + p.stderr


def build(build_dir: Path) -> str | None:
    p = sh(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)], cwd=build_dir)
    return None if p.returncode == 0 else (p.stdout + p.stderr)[-3000:]


def overlay(src: Path, build_dir: Path, into: Path) -> None:
    """python/emmpool with the scratch build's extension and data, as an installed package."""
    pkg = into / "emmpool"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(src / "python" / "emmpool", pkg)
    for so in build_dir.glob("_core*.so"):
        shutil.copy2(so, pkg)
    shutil.copytree(src / "cpp" / "torch", pkg / "torch_extension")
    (pkg / "torch_extension" / "include" / "emmpool").mkdir(parents=True)
    for header in ("torch_api.h", "round_up.hpp"):  # what CMakeLists.txt installs with it
        shutil.copy2(src / "cpp" / "include" / "emmpool" / header,
                     pkg / "torch_extension" / "include" / "emmpool")


def failed_tests(m: Mutant, src: Path, build_dir: Path, site: Path) -> list[str]:
    failed = []
    if m.ctest:
        p = sh(["ctest", "--test-dir", str(build_dir), "-R", m.ctest, "-j",
                str(os.cpu_count() or 2)], cwd=build_dir)
        failed += re.findall(r"\d+ - (\S+) \(Failed\)", p.stdout)
        if "No tests were found" in p.stdout + p.stderr:
            failed.append(f"(no C++ test matches {m.ctest!r})")
    if m.pytest:
        env = dict(os.environ, PYTHONPATH=str(site))
        p = sh([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *m.pytest],
               cwd=src, env=env)
        failed += [f"{t}" for t in re.findall(r"^FAILED (\S+)", p.stdout, re.M)]
    return failed


def check_snippets() -> list[str]:
    """Problems with the list itself: a snippet gone or repeated, a duplicate id."""
    problems = []
    ids = [m.id for m in MUTANTS]
    problems += [f"id {i} repeated" for i in set(ids) if ids.count(i) > 1]
    for m in MUTANTS:
        n = (REPO / m.file).read_text().count(m.find)
        if n != 1:
            problems.append(f"{m.id}: its snippet occurs {n} times in {m.file}")
        if not (m.ctest or m.pytest):
            problems.append(f"{m.id}: no test named to catch it")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and stop")
    ap.add_argument("--check", action="store_true",
                    help="check that every snippet occurs once, build nothing")
    args = ap.parse_args()
    if args.list:
        for m in MUTANTS:
            print(f"{m.id:16} {m.file:28} {m.promise}")
        return 0
    problems = check_snippets()
    if problems or args.check:
        print("\n".join(problems) or f"{len(MUTANTS)} mutants, every snippet found once")
        return 1 if problems else 0
    chosen = [m for m in MUTANTS if not args.ids or m.id in args.ids]
    if args.ids and len(chosen) != len(set(args.ids)):
        ap.error(f"unknown mutant: {sorted(set(args.ids) - {m.id for m in MUTANTS})}")
    with tempfile.TemporaryDirectory(prefix="emmpool-mutants-") as tmp:
        src, build_dir, site = Path(tmp, "src"), Path(tmp, "build"), Path(tmp, "site")
        scratch_copy(src)
        error = configure(src, build_dir) or build(build_dir)
        if error:
            print(f"the unchanged tree does not build:\n{error}")
            return 2
        survived = 0
        for m in chosen:
            start = time.monotonic()
            path = src / m.file
            original = path.read_text()
            path.write_text(original.replace(m.find, m.replace))
            try:
                error = build(build_dir)
                if error:
                    print(f"{m.id:16} BUILD FAILED\n{error}")
                    return 2
                overlay(src, build_dir, site)
                failed = failed_tests(m, src, build_dir, site)
            finally:
                path.write_text(original)
            took = time.monotonic() - start
            if failed:
                print(f"{m.id:16} CAUGHT   {took:5.0f} s  {', '.join(failed[:4])}"
                      f"{' ...' if len(failed) > 4 else ''}")
            else:
                survived += 1
                print(f"{m.id:16} SURVIVED {took:5.0f} s  ({m.promise})")
        build(build_dir)  # the unchanged tree again, for a rerun by hand
        print(f"{len(chosen) - survived} of {len(chosen)} mutants caught")
        return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
