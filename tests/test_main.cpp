// The main of every doctest suite. Beyond doctest's own verdict it enforces three rules:
// a test case that calls testing::skip ends as skipped (exit code 77, ctest's
// SKIP_RETURN_CODE, when nothing failed); a test case that finishes without a single
// assertion and without a skip fails the run: it would pass while checking nothing; and a
// run asked for named test cases that runs none fails (ctest passes each name as a filter,
// and a name CMake cuts, at a ';' say, would match nothing and pass).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "tests/skip.hpp"

#include <cstdio>
#include <string>
#include <vector>

namespace {

struct run_outcome {
  int ran = 0;
  bool current_skipped = false;
  int skipped = 0;
  std::vector<std::string> without_assertions;
};

run_outcome outcome;

/// Watches every test case end: skipped, or how many assertions it made.
struct assertion_watch : doctest::IReporter {
  const doctest::TestCaseData* current = nullptr;

  explicit assertion_watch(const doctest::ContextOptions&) {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    current = &tc;
    ++outcome.ran;
    outcome.current_skipped = false;
  }
  void test_case_end(const doctest::CurrentTestCaseStats& stats) override {
    if (outcome.current_skipped)
      ++outcome.skipped;
    else if (stats.numAssertsCurrentTest == 0 && current)
      outcome.without_assertions.push_back(current->m_name);
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

REGISTER_LISTENER("assertion_watch", 1, assertion_watch);

} // namespace

void troupe::testing::skip(const std::string& reason) {
  std::printf("skipped: %s\n", reason.c_str());
  std::fflush(stdout);
  outcome.current_skipped = true;
}

int main(int argc, char** argv) {
  doctest::Context context{argc, argv};
  int result = context.run();
  if (context.shouldExit() || result != 0)
    return result;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    bool filtered = arg.rfind("--test-case=", 0) == 0 || arg.rfind("-tc=", 0) == 0;
    if (filtered && outcome.ran == 0) {
      std::printf("FAILED: no test case matches %s\n", arg.c_str());
      return 1;
    }
  }
  if (!outcome.without_assertions.empty()) {
    for (auto& name : outcome.without_assertions)
      std::printf("FAILED: test case \"%s\" made no assertion: it would pass checking nothing\n",
                  name.c_str());
    return 1;
  }
  return outcome.skipped > 0 ? 77 : 0;
}
