#!/usr/bin/env bash
# Installs the Debian packages troupe builds against, and only those that are missing.
# Runs as root (CI and the development machines do); prints what it installs; does nothing
# when everything is already there. The CUDA toolkit and NCCL come with the machine.
set -euo pipefail

packages=(
  cmake g++ make
  libcaf-dev            # C++ Actor Framework 0.17.6: core, io, openssl
  libspdlog-dev libfmt-dev
  doctest-dev
  libboost-dev
  libboost-regex-dev libicu-dev   # the tokenizer's Unicode pre-tokenizer
  libopenblas-dev
  libgloo-dev
  nlohmann-json3-dev
  libcli11-dev
  libssl-dev openssl    # HMAC-SHA256 of the node handshake; test certificates
  curl                  # the HTTP client of the server tests
  clang-format          # the format check (scripts/check-format.sh)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup-deps: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "setup-deps: must run as root to install packages (missing: ${missing[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup-deps: done"
