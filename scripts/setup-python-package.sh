#!/usr/bin/env bash
# Makes (once) the Python environment the package's tests run in, at $1: pytest, NumPy and
# the build's own tools (scikit-build-core, nanobind), then tries PyTorch and transformers,
# which the RL loop and the PyTorch tests use (those tests are skipped, with the reason,
# when PyTorch cannot be installed). The environment is kept outside the clone: PyTorch's
# wheels are gigabytes.
set -euo pipefail
venv=$1
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check --timeout 60)
if ! "$venv/bin/python" -c 'import pytest, numpy, nanobind, scikit_build_core' 2> /dev/null; then
  "${pip[@]}" pytest numpy nanobind scikit-build-core
fi
if ! "$venv/bin/python" -c 'import torch, transformers' 2> /dev/null; then
  echo "setup-python-package: installing PyTorch and transformers into $venv (once)" >&2
  "${pip[@]}" torch transformers safetensors ||
    echo "setup-python-package: PyTorch could not be installed: its tests will be SKIPPED" >&2
fi
