#!/usr/bin/env bash
# Prometheus for the tests of `lora-opt replan/place --prometheus` (Debian's `prometheus` package): each
# test starts its own server on 127.0.0.1 with a config it writes, and stops it (lora_opt/bench/prometheus_server.py).
# Nothing to do where a `prometheus` executable is found already; no apt: says so and leaves the tests to skip
# (under CI they fail instead).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "tools/prometheus/install.sh: no apt-get here; install Prometheus (>= 2.30) yourself for the --prometheus tests" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# the package's own service (if this machine runs services) is not what the tests use
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
prometheus --version | head -1
