/**
 * @file check.hpp
 * @brief A tiny test harness (no GoogleTest on CI machines, and no network to fetch it).
 *
 *   TEST(name) { CHECK(cond); CHECK_EQ(a, b); CHECK_THROWS(expr, type); }
 *
 * Failed checks print file:line and the test keeps going; REQUIRE(cond) stops the current test
 * (for a condition the rest of the test depends on). An exception escaping a test fails it.
 * The binary runs every test, or the one named by its argument (else those whose name contains
 * it); `--list` prints the names.
 *
 * Variants: `--variant=NAME` runs the tests under a named variant of the code under test, which
 * the test file reads with check::variant() (the pool tests: which segments a pool uses, see
 * pool_fixture.hpp). TEST(name) runs under every variant; TEST_ONLY(name, "NAME") only under
 * that one ("" being the binary run without --variant), and is skipped under another.
 * It exits nonzero if any test failed; its last line of output is "N passed, N failed" (and
 * ", N skipped" when tests were skipped). A run in which every test that matched was skipped
 * exits with check::skipped_exit_code, which CTest reports as skipped (SKIP_RETURN_CODE).
 * Include this header in exactly one translation unit per test binary (it defines main()).
 */
#pragma once

#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace check {

struct test_case {
  char const* name;
  void (*fn)();
  char const* only;  ///< the one variant the test runs under, or null: every variant
};

/// What a run in which every matching test was skipped exits with (Automake's, CTest's
/// SKIP_RETURN_CODE in cpp/tests/CMakeLists.txt).
inline constexpr int skipped_exit_code = 77;

/// The variant this run tests (--variant=NAME), "" without one.
inline std::string& variant()
{
  static std::string name;
  return name;
}

inline std::vector<test_case>& registry()
{
  static std::vector<test_case> tests;
  return tests;
}

inline int& failures_in_current_test()
{
  static int n = 0;
  return n;
}

struct registrar {
  registrar(char const* name, void (*fn)(), char const* only = nullptr)
  {
    registry().push_back({name, fn, only});
  }
};

/// Thrown by REQUIRE to abandon the current test (already counted as a failure).
struct abort_test {};

template <class T, class = void>
struct is_streamable : std::false_type {};
template <class T>
struct is_streamable<T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<T>())>>
  : std::true_type {};

template <class T>
std::string show(T const& v)
{
  if constexpr (std::is_enum_v<T>) {
    return std::to_string(static_cast<long long>(v));
  } else if constexpr (is_streamable<T>::value) {
    std::ostringstream os;
    os << v;
    return os.str();
  } else {
    return "<value>";
  }
}

inline void fail(char const* file, int line, std::string const& what)
{
  ++failures_in_current_test();
  std::printf("%s:%d: FAILED: %s\n", file, line, what.c_str());
  std::fflush(stdout);
}

}  // namespace check

#define CHECK_CONCAT_DETAIL(a, b) a##b
#define CHECK_CONCAT(a, b) CHECK_CONCAT_DETAIL(a, b)

#define TEST(name)                                                                    \
  static void CHECK_CONCAT(test_fn_, name)();                                         \
  static ::check::registrar CHECK_CONCAT(test_reg_, name){#name,                      \
                                                          &CHECK_CONCAT(test_fn_, name)}; \
  static void CHECK_CONCAT(test_fn_, name)()

/// A test that runs under one variant only (see the file comment); say why beside it.
#define TEST_ONLY(name, only_variant)                                                 \
  static void CHECK_CONCAT(test_fn_, name)();                                         \
  static ::check::registrar CHECK_CONCAT(test_reg_, name){                            \
    #name, &CHECK_CONCAT(test_fn_, name), only_variant};                              \
  static void CHECK_CONCAT(test_fn_, name)()

#define CHECK(cond)                                                               \
  do {                                                                            \
    if (!(cond)) { ::check::fail(__FILE__, __LINE__, "CHECK(" #cond ")"); }       \
  } while (0)

#define REQUIRE(cond)                                                             \
  do {                                                                            \
    if (!(cond)) {                                                                \
      ::check::fail(__FILE__, __LINE__, "REQUIRE(" #cond ")");                    \
      throw ::check::abort_test{};                                                \
    }                                                                             \
  } while (0)

#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    auto const& check_a_ = (a);                                                            \
    auto const& check_b_ = (b);                                                            \
    if (!(check_a_ == check_b_)) {                                                         \
      ::check::fail(__FILE__, __LINE__,                                                    \
                    "CHECK_EQ(" #a ", " #b "): " + ::check::show(check_a_) +               \
                      " != " + ::check::show(check_b_));                                   \
    }                                                                                      \
  } while (0)

#define CHECK_NE(a, b)                                                                     \
  do {                                                                                     \
    auto const& check_a_ = (a);                                                            \
    auto const& check_b_ = (b);                                                            \
    if (check_a_ == check_b_) {                                                            \
      ::check::fail(__FILE__, __LINE__,                                                    \
                    "CHECK_NE(" #a ", " #b "): both are " + ::check::show(check_a_));      \
    }                                                                                      \
  } while (0)

/// Passes if evaluating expr throws `type` (or a class derived from it).
#define CHECK_THROWS(expr, type)                                                           \
  do {                                                                                     \
    bool check_threw_ = false;                                                             \
    try {                                                                                  \
      (void)(expr);                                                                        \
    } catch (type const&) {                                                                \
      check_threw_ = true;                                                                 \
    } catch (::check::abort_test const&) {                                                 \
      throw;                                                                               \
    } catch (std::exception const& check_e_) {                                             \
      ::check::fail(__FILE__, __LINE__,                                                    \
                    "CHECK_THROWS(" #expr ", " #type "): threw another exception: " +      \
                      std::string{check_e_.what()});                                       \
      check_threw_ = true;                                                                 \
    } catch (...) {                                                                        \
      ::check::fail(__FILE__, __LINE__,                                                    \
                    "CHECK_THROWS(" #expr ", " #type "): threw a non-std exception");      \
      check_threw_ = true;                                                                 \
    }                                                                                      \
    if (!check_threw_) {                                                                   \
      ::check::fail(__FILE__, __LINE__, "CHECK_THROWS(" #expr ", " #type "): did not throw"); \
    }                                                                                      \
  } while (0)

/// Passes if evaluating expr throws nothing.
#define CHECK_NOTHROW(expr)                                                                \
  do {                                                                                     \
    try {                                                                                  \
      (void)(expr);                                                                        \
    } catch (::check::abort_test const&) {                                                 \
      throw;                                                                               \
    } catch (std::exception const& check_e_) {                                             \
      ::check::fail(__FILE__, __LINE__,                                                    \
                    "CHECK_NOTHROW(" #expr "): threw: " + std::string{check_e_.what()});   \
    } catch (...) {                                                                        \
      ::check::fail(__FILE__, __LINE__, "CHECK_NOTHROW(" #expr "): threw a non-std exception"); \
    }                                                                                      \
  } while (0)

int main(int argc, char** argv)
{
  char const* filter = nullptr;
  bool list          = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--variant=", 10) == 0) {
      ::check::variant() = argv[i] + 10;
    } else if (std::strcmp(argv[i], "--list") == 0) {
      list = true;
    } else {
      filter = argv[i];
    }
  }
  if (list) {
    for (auto const& t : ::check::registry()) { std::printf("%s\n", t.name); }
    return 0;
  }
  // A filter that names a test exactly runs that test alone; otherwise, every test whose name
  // contains it.
  bool exact = false;
  if (filter != nullptr) {
    for (auto const& t : ::check::registry()) { exact = exact || std::strcmp(t.name, filter) == 0; }
  }
  int passed = 0, failed = 0, skipped = 0;
  for (auto const& t : ::check::registry()) {
    if (filter != nullptr && (exact ? std::strcmp(t.name, filter) != 0
                                    : std::strstr(t.name, filter) == nullptr)) {
      continue;
    }
    if (t.only != nullptr && ::check::variant() != t.only) {
      ++skipped;
      std::printf("[ SKIP ] %s (runs under the variant '%s' only)\n", t.name, t.only);
      continue;
    }
    ::check::failures_in_current_test() = 0;
    std::printf("[ RUN  ] %s\n", t.name);
    std::fflush(stdout);
    try {
      t.fn();
    } catch (::check::abort_test const&) {
      // already reported
    } catch (std::exception const& e) {
      ::check::fail(__FILE__, __LINE__,
                    std::string{"uncaught exception in test "} + t.name + ": " + e.what());
    } catch (...) {
      ::check::fail(__FILE__, __LINE__, std::string{"uncaught non-std exception in test "} + t.name);
    }
    if (::check::failures_in_current_test() == 0) {
      ++passed;
      std::printf("[  OK  ] %s\n", t.name);
    } else {
      ++failed;
      std::printf("[ FAIL ] %s (%d failed checks)\n", t.name, ::check::failures_in_current_test());
    }
    std::fflush(stdout);
  }
  if (filter != nullptr && passed + failed + skipped == 0) {
    std::printf("no test matches '%s'\n", filter);
    std::printf("0 passed, 1 failed\n");
    return 1;
  }
  if (skipped != 0) {
    std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  } else {
    std::printf("%d passed, %d failed\n", passed, failed);
  }
  if (failed != 0) { return 1; }
  return passed == 0 && skipped != 0 ? ::check::skipped_exit_code : 0;
}
