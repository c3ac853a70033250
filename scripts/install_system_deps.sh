#!/usr/bin/env bash
# System tools the tests need and pip cannot provide: `prometheus` and `promtool` (Debian's `prometheus` package).
#   bash scripts/install_system_deps.sh     # called by scripts/test.sh; does nothing when both are on PATH
# Installs with apt-get (as root, or through sudo without a password). Where that is impossible it says
# why and returns 0: the Prometheus tests then skip with that reason instead of failing the suite.
set -uo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "[deps] prometheus/promtool missing and apt-get unavailable: the Prometheus tests will skip" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    sudo=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
else
    echo "[deps] prometheus/promtool missing and apt-get needs root (no passwordless sudo): the Prometheus tests will skip" >&2
    exit 0
fi
echo "[deps] installing Debian's prometheus package (prometheus, promtool)"
export DEBIAN_FRONTEND=noninteractive
if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
    echo "[deps] apt-get install prometheus failed: the Prometheus tests will skip" >&2
fi
# The package enables a system service on some hosts; the tests start their own server on 127.0.0.1 instead.
exit 0
