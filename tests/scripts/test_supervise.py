"""scripts/supervise.py's relaunch rule for a configuration error (status 2): never relaunched.

    python -m pytest -q tests/scripts/test_supervise.py

(Status 5, the divergence guard's stop, is tests/train/test_anomaly.py::test_supervisor_does_not_relaunch_a_diverged_run;
a relaunch after a SIGKILL is tests/checkpoint/test_resume.py.)
"""
from __future__ import annotations

import subprocess
import sys

from llmtest import REPO


def test_a_configuration_error_is_not_relaunched(tmp_path):
    attempts = tmp_path / "attempts"
    job = f"open({str(attempts)!r}, 'a').write('x'); import sys; sys.exit(2)"
    proc = subprocess.run([sys.executable, f"{REPO}/scripts/supervise.py", "--max-restarts", "3", "--delay", "0", "--",
                           sys.executable, "-c", job], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert attempts.read_text() == "x", proc.stderr  # one attempt, no relaunch
    assert "refused its configuration (status 2" in proc.stderr and "attempt 2" not in proc.stderr
