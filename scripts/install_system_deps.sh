#!/usr/bin/env bash
# System tools the tests need and pip cannot provide: `prometheus` and `promtool` (Debian's `prometheus` package)
# and `etcd` (Debian's `etcd-server` package: the rendezvous store of Paddle's restarting launcher).
#   bash scripts/install_system_deps.sh     # called by scripts/test.sh; does nothing when all three are on PATH
# Installs with apt-get (as root, or through sudo without a password). Where that is impossible it says
# why and returns 0: the Prometheus / etcd tests then skip with that reason instead of failing the suite.
set -uo pipefail
packages=()
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    packages+=(prometheus)
fi
if ! command -v etcd >/dev/null; then
    packages+=(etcd-server)
fi
if [ ${#packages[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "[deps] ${packages[*]} missing and apt-get unavailable: their tests will skip" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    sudo=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
else
    echo "[deps] ${packages[*]} missing and apt-get needs root (no passwordless sudo): their tests will skip" >&2
    exit 0
fi
echo "[deps] installing Debian's ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; }; then
    echo "[deps] apt-get install ${packages[*]} failed: their tests will skip" >&2
fi
# The packages enable system services on some hosts; the tests start their own servers on 127.0.0.1 instead.
exit 0
