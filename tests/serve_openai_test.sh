#!/usr/bin/env bash
# Runs tests/serve_openai_test.py with the Python that has the openai and prometheus_client
# packages: the build's pyclients venv (scripts/setup-python-clients.sh), else python3.
# Exits 77 (skipped) when neither has them. Arguments: the troupe binary, the source tree,
# the build tree.
set -uo pipefail
python=python3
[ -x "$3/pyclients/bin/python" ] && python=$3/pyclients/bin/python
if ! "$python" -c 'import openai, prometheus_client' 2> /dev/null; then
  echo "skipped: the openai and prometheus_client Python packages are not installed" \
       "(scripts/setup-python-clients.sh $3/pyclients installs them)"
  exit 77
fi
exec "$python" "$2/tests/serve_openai_test.py" "$1" "$2"
