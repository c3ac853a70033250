"""GPU-only branch `fleet-nccl`: on a GPU llmtrain installs none of its CPU stand-ins; fleet's own kernels run.

    python -m pytest tests/gpu_paths/test_fleet_nccl.py -q

On CPU, `cpu_backend.install()` replaces fleet's GPU-only pieces (mp_ops kernels, pipeline p2p, sequence-parallel
collectives, ZeRO 2/3 constructors, ...) with stand-ins, and CI trains every layout through them. On a GPU the
same llmtrain calls reach fleet's originals, so every stand-in must accept exactly the arguments its original
accepts. The rehearsal records each replacement without applying it and compares the two signatures (parameter
names, kinds and defaults; the ZeRO constructors' `device` default "gpu" -> "cpu" is the one documented
difference, llmtrain never passes `device`), and checks that `install()` on a GPU device replaces nothing.
The NCCL numerics themselves are the acceptance script's `parity_*` steps.
"""
from __future__ import annotations

import inspect

import paddle

from gpu_rehearsal import REPO, reaches
from llmtrain.paddle_compat import cpu_backend, patching

MODULES = [m for m in vars(cpu_backend).values() if inspect.ismodule(m) and hasattr(m, "install_patches")]
"""Every stand-in module install() applies (each has `install_patches`)."""
DEVICE_DEFAULT = {"GroupShardedOptimizerStage2.__init__", "GroupShardedStage2.__init__", "GroupShardedStage3.__init__"}
"""Constructors whose stand-in defaults `device` to "cpu" instead of "gpu" (cpu_backend/sharding.py)."""


def _recorded(monkeypatch) -> list[tuple]:
    """(owner, name, stand-in) of every replacement install() would make, none applied."""
    seen = []
    for module in MODULES:
        monkeypatch.setattr(module, "replace", lambda owner, name, new: seen.append((owner, name, new)))
        module.install_patches()
    return seen


def _original(owner, name):
    """Fleet's object (also when this process already installed the stand-ins for an earlier test)."""
    if (id(owner), name) in patching._PATCHES:
        return patching.original(owner, name)
    if isinstance(owner, type) and name in owner.__dict__:
        return owner.__dict__[name]
    return getattr(owner, name)


def _params(fn) -> list[tuple]:
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_stand_in_takes_what_its_original_takes(monkeypatch):
    seen = _recorded(monkeypatch)
    assert len(seen) >= 25, f"only {len(seen)} replacements recorded"
    for owner, name, new in seen:
        old = _original(owner, name)
        where = f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name}"
        if isinstance(old, property) or isinstance(new, property):
            assert isinstance(old, property) and isinstance(new, property), where
            continue
        want, got = _params(old), _params(new)
        if any(where.endswith(d) for d in DEVICE_DEFAULT):
            want = [(n, k, "cpu" if n == "device" else d) for n, k, d in want]
        assert got == want, f"{where}: stand-in {got} vs fleet {want}"


def test_llmtrain_never_passes_device_to_the_zero_constructors():
    callers = [p for p in (REPO / "llmtrain").rglob("*.py") if "cpu_backend" not in str(p)]
    for path in callers:
        text = path.read_text(encoding="utf-8")
        for cls in ("GroupShardedOptimizerStage2(", "GroupShardedStage2(", "GroupShardedStage3(", "group_sharded_parallel("):
            at = text.find(cls)
            while at >= 0:
                call = text[at: text.find(")", at) + 1]
                assert "device=" not in call, f"{path}: {call}"
                at = text.find(cls, at + 1)


def test_install_on_a_gpu_replaces_nothing(monkeypatch):
    before = patching.installed()
    monkeypatch.setattr(cpu_backend, "_INSTALLED", False)
    monkeypatch.setattr(paddle, "get_device", lambda *a: "gpu:0")
    with reaches("fleet-nccl"):
        assert cpu_backend.install() is False
    assert patching.installed() == before and not cpu_backend.is_installed()
