#!/usr/bin/env bash
# The project's test command: installs what is missing, fetches SmolLM2-135M-Instruct into
# the model cache (once), configures a Release build in build/, builds with two jobs and
# runs the CPU test suite. Its exit code is the verdict. Tests that cannot run here end as
# skipped, and their reasons are listed last.
#
#   bash scripts/test.sh              the Release build in build/
#   bash scripts/test.sh --sanitize   AddressSanitizer + UndefinedBehaviorSanitizer, CPU only,
#                                     in build-sanitize/ (findings in CAF's own headers are
#                                     suppressed by scripts/sanitize.supp, nothing else)
set -euo pipefail
cd "$(dirname "$0")/.."

build=build
flags=(-DCMAKE_BUILD_TYPE=Release)
exclude=()
if [ "${1:-}" = "--sanitize" ]; then
  build=build-sanitize
  flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTROUPE_WITH_CUDA=OFF
         "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-omit-frame-pointer"
         "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
         "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined")
  export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
  # Not run under the sanitizers: ASan ends the process on an allocation it cannot serve
  # (the swap-space test wants the error), and the installed-package test builds a program
  # of its own without the sanitizer runtime.
  exclude=(-E "^(cli_refuses_huge_swap_space|host_app_against_installed_prefix)$")
  echo "test: under the sanitizers, cli_refuses_huge_swap_space and" \
       "host_app_against_installed_prefix are left out (see scripts/test.sh)"
  # Recoverable checks that halt, so that the suppressions apply.
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$PWD/scripts/sanitize.supp"
fi

bash scripts/setup-deps.sh
if ! bash scripts/fetch-smollm2.sh > /dev/null; then
  echo "test: SmolLM2-135M-Instruct could not be fetched: the tests of the real model will be" \
       "SKIPPED"
fi
if ! bash scripts/setup-python-clients.sh "$build/pyclients" > /dev/null 2>&1; then
  echo "test: the openai and prometheus_client packages could not be installed: the" \
       "server's Python client test will be SKIPPED"
fi
cmake -S . -B "$build" -DTROUPE_BUILD_TESTS=ON "${flags[@]}"
cmake --build "$build" -j2
status=0
# The Python package as a user gets it: `pip install .` (its own build of the library, in
# $build/wheel) into an environment kept outside the clone, then its pytest suite. Not under
# the sanitizers: their runtime would have to be preloaded into Python.
python_status=skipped
if [ "${1:-}" != "--sanitize" ]; then
  venv=${TROUPE_PYTHON_VENV:-$HOME/.cache/troupe/venv-ref}
  if bash scripts/setup-python-package.sh "$venv"; then
    if CMAKE_BUILD_PARALLEL_LEVEL=2 "$venv/bin/pip" install --quiet --disable-pip-version-check \
         --no-build-isolation --no-deps -C build-dir="$build/wheel" . &&
       (cd "$build" && "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider ../python/tests); then
      python_status=passed
    else
      python_status=failed
      status=1
    fi
  else
    echo "test: the Python environment could not be made: the Python package's tests are SKIPPED"
  fi
fi
cd "$build"
ctest -LE gpu "${exclude[@]}" --output-on-failure --timeout 600 || status=$?
echo "test: the Python package (pip install . and its pytest suite): $python_status"
# ctest names skipped tests without the reason; each printed "skipped: <reason>".
awk '/^[0-9]+\/[0-9]+ Test: / { sub(/^[0-9]+\/[0-9]+ Test: /, ""); name = $0 }
     /^skipped: / { sub(/^skipped: /, ""); print "  " name ": " $0 }' \
  Testing/Temporary/LastTest.log > Testing/Temporary/skip-reasons.txt || true
if [ -s Testing/Temporary/skip-reasons.txt ]; then
  echo "Skipped, and why:"
  cat Testing/Temporary/skip-reasons.txt
fi
exit $status
