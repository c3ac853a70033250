#!/usr/bin/env bash
# System tools the tests need and pip cannot provide: `prometheus` and `promtool` (Debian's `prometheus` package)
# and `etcd` (Debian's `etcd-server` package: the rendezvous store of Paddle's restarting launcher).
#   bash scripts/install_system_deps.sh     # called by scripts/test.sh; does nothing when all three are on PATH
# Installs with apt-get (as root, or through sudo without a password). Where that is impossible it says
# why, naming the Debian packages; under CI (CI=true, as .ci/run and CI services set it) it then exits 1, so a
# CI run never goes green with the Prometheus / etcd tests unrun. Locally it returns 0 and those tests skip,
# saying why (and under CI=true they fail instead, naming the package: tests/launch.py `require_binary`).
set -uo pipefail
give_up() {  # $1: why the packages cannot be installed
    if [ "${CI:-}" = "true" ]; then
        echo "[deps] ERROR: Debian package(s) ${packages[*]} missing and $1; CI=true: failing (install them: apt-get install ${packages[*]})" >&2
        exit 1
    fi
    echo "[deps] Debian package(s) ${packages[*]} missing and $1: their tests will skip (with CI=true they fail)" >&2
    exit 0
}
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
    give_up "apt-get unavailable"
fi
if [ "$(id -u)" -eq 0 ]; then
    sudo=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
else
    give_up "apt-get needs root (no passwordless sudo)"
fi
echo "[deps] installing Debian's ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; }; then
    give_up "apt-get install failed"
fi
for tool in prometheus promtool etcd; do
    command -v "$tool" >/dev/null || give_up "\`$tool\` is still not on PATH after the install"
done
# The packages enable system services on some hosts; the tests start their own servers on 127.0.0.1 instead.
exit 0
