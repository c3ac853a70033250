#!/usr/bin/env bash
# The test suite (CPU; ~15-17 minutes on 2 cores). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMTRAIN_EXTRAS=dev source scripts/env.sh
bash scripts/install_system_deps.sh   # prometheus + promtool for tests/deploy, etcd for the restart tests (apt on Debian)
python -m pytest -q tests "$@"
