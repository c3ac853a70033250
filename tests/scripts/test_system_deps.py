"""A missing system tool fails CI instead of skipping (scripts/install_system_deps.sh and tests/launch.py).

    python -m pytest -q tests/scripts/test_system_deps.py

Under CI (`CI=true`, exported by .ci/run) the install script exits 1 when it cannot install Debian's
prometheus / etcd-server, and a test needing `prometheus`, `promtool` or `etcd` fails naming the package;
locally both say so and the tests skip.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from launch import REPO, require_binary

SCRIPT = os.path.join(REPO, "scripts", "install_system_deps.sh")


def test_missing_binary_fails_under_ci_and_skips_locally(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI=true: the `llmtrain-no-such-tool` binary .* Debian's "
                                                    r"`llmtrain-pkg` package"):
        require_binary("llmtrain-no-such-tool", "llmtrain-pkg")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"`llmtrain-pkg`.*skipped locally"):
        require_binary("llmtrain-no-such-tool", "llmtrain-pkg")
    assert require_binary("bash", "bash") == shutil.which("bash")


@pytest.mark.parametrize("ci", ["true", None])
def test_install_script_fails_under_ci_when_it_cannot_install(tmp_path, ci):
    """A PATH with none of the tools and no apt-get (only `id`): CI=true exits 1 naming both packages."""
    (tmp_path / "bin").mkdir()
    os.symlink(shutil.which("id"), tmp_path / "bin" / "id")
    env = {"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path)} | ({"CI": ci} if ci else {})
    proc = subprocess.run([shutil.which("bash"), SCRIPT], env=env, capture_output=True, text=True, timeout=30)
    assert "prometheus etcd-server missing and apt-get unavailable" in proc.stderr, proc.stderr
    if ci:
        assert proc.returncode == 1 and "CI=true: failing" in proc.stderr, (proc.returncode, proc.stderr)
    else:
        assert proc.returncode == 0 and "their tests will skip" in proc.stderr, (proc.returncode, proc.stderr)
