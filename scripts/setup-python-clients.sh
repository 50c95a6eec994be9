#!/usr/bin/env bash
# Makes a Python venv at $1 with the clients the server's tests use: the official openai
# package, prometheus_client (its text-format parser checks /metrics) and jsonschema (it
# validates structured output). Does nothing when they are there already.
set -euo pipefail
venv=$1
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import openai, prometheus_client, jsonschema' 2> /dev/null; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check --timeout 30 openai prometheus_client jsonschema
