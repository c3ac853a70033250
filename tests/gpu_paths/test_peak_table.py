"""GPU-only branch `peak-table`: on a GPU the MFU denominator is the datasheet peak of the device, found by name.

    python -m pytest tests/gpu_paths/test_peak_table.py -q

`llmtrain.train.peak.peak_flops` asks `paddle.device.cuda.get_device_name()` on a GPU and looks the name up in the
planner's device profiles (llmtrain/plan/profiles/*.json). On CPU `paddle.get_device` answers "gpu:0" and
`get_device_name` is a stand-in checked against the installed function's signature that answers with the names
the CUDA driver reports. The expected peaks are NVIDIA's published dense bf16 figures (H100/H200/H800 SXM 989
TFLOP/s, A100/A800 312, H20 148, L40S 362), not read from the profiles. On a GPU the real name is looked up.
"""
from __future__ import annotations

import paddle
import pytest

from gpu_rehearsal import ON_GPU, checked, reaches
from llmtrain.train import peak

DATASHEET = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12,
             "NVIDIA H800": 989e12, "NVIDIA H20": 148e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA A800-SXM4-80GB": 312e12, "NVIDIA L40S": 362e12}
"""Device name as the driver reports it -> NVIDIA's dense bf16 peak (FLOP/s). H100 PCIe's is 756 TFLOP/s."""


def _pretend(monkeypatch, name: str):
    monkeypatch.setattr(paddle, "get_device", checked(paddle.get_device, lambda input: "gpu:0", ()))
    stand_in = checked(paddle.device.cuda.get_device_name, lambda device: name, ())
    monkeypatch.setattr(paddle.device.cuda, "get_device_name", stand_in)
    return stand_in


@pytest.mark.skipif(ON_GPU, reason="CPU rehearsal; on a GPU test_real_device_name runs")
@pytest.mark.parametrize("name", sorted(set(DATASHEET) - {"NVIDIA H100 PCIe"}))
def test_known_gpu_names_give_their_datasheet_peak(monkeypatch, name):
    stand_in = _pretend(monkeypatch, name)
    with reaches("peak-table"):
        value, source = peak.peak_flops(None)
    assert value is not None and abs(value - DATASHEET[name]) <= 0.01 * DATASHEET[name], (name, value)
    assert name in source and "datasheet" in source
    assert stand_in.calls == [{"device": None}]


@pytest.mark.skipif(ON_GPU, reason="CPU rehearsal")
@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB", "NVIDIA H100 PCIe"])
def test_unknown_gpus_ask_for_the_peak_and_a_configured_peak_wins(monkeypatch, name):
    """Names without a profile give no MFU and say which setting to use; H100 PCIe (756, not 989) must not be read
    as an SXM H100 (the h100 profile once matched any name holding "H100")."""
    _pretend(monkeypatch, name)
    with reaches("peak-table"):
        value, source = peak.peak_flops(None)
    assert value is None and source == f"unknown GPU {name!r}: set train.peak_tflops"
    assert peak.peak_flops(400.0) == (400e12, "config train.peak_tflops")


@pytest.mark.skipif(not ON_GPU, reason="reads the real GPU name; the CPU tests above rehearse the table with a pretended name")
def test_real_device_name():
    name = paddle.device.cuda.get_device_name()
    with reaches("peak-table"):
        value, _ = peak.peak_flops(None)
    if name in DATASHEET:
        assert abs(value - DATASHEET[name]) <= 0.01 * DATASHEET[name]
