"""Throwaway shape-only builds leave Paddle's parameter names alone.

    python -m pytest tests/models/test_shape_only.py -q

Paddle names layers and parameters from per-process counters ("layer_norm_51.w_0"). The planner's parameter list is
built from a lazy model unless an earlier process stored it on disk, so under a launch one rank may build it and
another not; had the build used the process's counters, the two ranks would name every later model's parameters
differently, and ZeRO-3 lays out the gradients it all-reduces by name (tests/parallel/zero3_checks.py reproduces that in
the zero3 parity launch). Every shape-only build goes through `llmtrain.models.shape_only`.
"""
from __future__ import annotations


def _next(key: str) -> int:
    from paddle.utils import unique_name

    return int(unique_name.generate(key).rsplit("_", 1)[1])


def test_shape_only_builds_consume_no_parameter_names(tiny_gpt, tmp_path, monkeypatch):
    from llmtrain.interop.keys import model_shapes
    from llmtrain.models import build_model, shape_only
    from llmtrain.models.init import expected_names
    from llmtrain.models.lora import LoraConfig
    from llmtrain.models.lora_targets import lora_targets
    from llmtrain.plan import params

    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path))  # a cold on-disk cache: the list is built here
    monkeypatch.setattr(params, "_CACHE", {})
    keys = ("layer_norm", "embedding", "role_linear")
    before = {k: _next(k) for k in keys}
    assert params.model_param_specs(tiny_gpt)  # built (a lazy model), then stored
    assert list(tmp_path.glob("param_specs/*.json"))
    assert expected_names(tiny_gpt) and model_shapes(tiny_gpt)
    assert lora_targets(tiny_gpt, LoraConfig(rank=4))[1]
    with shape_only():
        build_model(tiny_gpt)
    assert {k: _next(k) for k in keys} == {k: n + 1 for k, n in before.items()}  # nothing taken in between
    build_model(tiny_gpt)  # a real build does take names: the check above can fail
    assert _next("layer_norm") > before["layer_norm"] + 2
