#!/usr/bin/env bash
# Runs a Python test of the server (tests/serve_openai_test.py, or the script given fourth)
# with the Python that has the openai, prometheus_client and jsonschema packages: the
# build's pyclients venv (scripts/setup-python-clients.sh), else python3. Exits 77 (skipped)
# when neither has them. Arguments: the troupe binary, the source tree, the build tree[, the
# test script's name in tests/].
set -uo pipefail
python=python3
[ -x "$3/pyclients/bin/python" ] && python=$3/pyclients/bin/python
if ! "$python" -c 'import openai, prometheus_client, jsonschema' 2> /dev/null; then
  echo "skipped: the openai, prometheus_client and jsonschema Python packages are not" \
       "installed (scripts/setup-python-clients.sh $3/pyclients installs them)"
  exit 77
fi
exec "$python" "$2/tests/${4:-serve_openai_test.py}" "$1" "$2"
