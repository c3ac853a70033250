"""Planner settings: the `plan` section of the root config (`python -m llmtrain.plan plan.devices=64 ...`).

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 train.global_batch_size=1024 plan.devices=64 plan.device=a100-80g
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class PlanConfig:
    devices: int = 8
    """Devices of the job (the world size the layouts must fill)."""

    devices_per_node: int = 8
    """Devices per node: a group within a node talks over NVLink, a group spanning nodes over the network."""

    device: str = "a100-80g"
    """Device profile, a data file llmtrain/plan/profiles/<device>.json: a100-40g, a100-80g, a800, h100, h800, h200,
    h20, l40s, cpu-here (h200 measured on an H200, h100 on an H100, cpu-here on this machine; the others the H200's tables scaled by
    datasheet ratios; docs/planning.md)."""

    top: int = 10
    """Rows of the ranked table."""

    recompute: Optional[str] = None
    """Explaining one layout: none, full, full_attn or core_attn (`selective`: core_attn; default: `train.recompute`
    with its modules and layers); ranking lists the four modes (llmtrain/plan/recompute.py prices them)."""

    profile: Optional[str] = "work/cpu-here.json"
    """A calibrated profile file (`python -m llmtrain.plan --calibrate` writes work/cpu-here.json), relative to the
    working directory; used when it exists and its `name` is `plan.device` (null: never; then the packaged profile)."""

    moe_imbalance: Optional[float] = None
    """Dropless MoE (`model.moe_capacity_factor=0`): the stated load of the busiest expert over the mean load
    (T·k/E), which sizes the dispatch buffer's rows per expert; null: the expected busiest expert of a balanced
    router from E, k and the rank's tokens (llmtrain/plan/moe.py `expected_imbalance`, 1.04-1.14 for 4k-8k tokens,
    a lower bound of real routing). Capacity mode ignores it."""

    format: str = "table"
    """`table` (ranked table, or one layout explained when +parallel= is given) or `json` (a list, best first)."""
