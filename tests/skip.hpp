#pragma once

// A test case that cannot run here ends as skipped, never as passed: `return skip(why);`
// prints "skipped: why", and the suite's main (tests/test_main.cpp) exits with 77, which
// ctest reports as a skip. A test case that ends with no assertion and no skip fails.

#include <string>

namespace troupe::testing {

/// Marks the running test case skipped for `reason` (one line, printed). The test case
/// should return right after; its remaining checks do not run.
void skip(const std::string& reason);

} // namespace troupe::testing
