"""A tp rank's slice of the full logical tensor: init and loading cut what one process would hold."""
from __future__ import annotations

import numpy as np

from llmtrain.contracts import tags
from llmtrain.models import build_model
from llmtrain.models.stages import canonical_parameters
from llmtrain.models.init import init_parameters, initial_value, load_full_state
from llmtrain.parallel.slicing import TensorSlices, full_shape, local_slice


def _model(cfg, seed):
    m = build_model(cfg)
    init_parameters(canonical_parameters(m), cfg, seed)
    return m


def test_tp_slices_tile_the_full_tensor(tiny_llama):
    """The slices two tp ranks keep concatenate to the single-device tensor."""
    m = _model(tiny_llama, seed=5)
    for name, p in canonical_parameters(m):
        tags.set_split_axis(p, 1 if name.endswith("q_proj.weight") else tags.split_axis(p))
        if name.endswith("q_proj.weight"):
            full = initial_value(name, p, tiny_llama, 5, full_shape(p, 1))
            halves = [local_slice(full, p, r, 2) for r in range(2)]
            np.testing.assert_array_equal(np.concatenate(halves, axis=1), p.numpy())


def _half(layer, param, axis):
    """A stand-in for a tp2 rank's parameter: `param` with half of `axis`, tagged as split there."""
    shape = list(param.shape)
    shape[axis] //= 2
    local = layer.create_parameter(shape)
    tags.set_split_axis(local, axis)
    return local


def test_init_and_load_cut_the_rank_slice(tiny_gpt):
    """A parameter tagged as split holds rank r's chunk of the full draw; untagged ones stay whole."""
    full_model = _model(tiny_gpt, seed=9)
    full = {n: p.numpy() for n, p in canonical_parameters(full_model)}
    split = {"layers.0.mlp.up_proj.weight": 1, "layers.0.mlp.up_proj.bias": 0, "embed.word.weight": 0}
    for rank in range(2):
        m = build_model(tiny_gpt)
        named = [(n, _half(m, p, split[n]) if n in split else p) for n, p in canonical_parameters(m)]
        slices = TensorSlices(rank, 2)
        assert slices.full_shape(dict(named)["embed.word.weight"]) == list(full["embed.word.weight"].shape)
        init_parameters(named, tiny_gpt, 9, slices)
        for name, p in named:
            want = local_slice(full[name], p, rank, 2)
            np.testing.assert_array_equal(p.numpy(), want)
            if name in split:
                assert want.shape[split[name]] * 2 == full[name].shape[split[name]]
        for _, p in named:
            p.set_value(np.zeros(p.shape, np.float32))
        load_full_state(named, full, slices, source="test")
        for name, p in named:
            np.testing.assert_array_equal(p.numpy(), local_slice(full[name], p, rank, 2))
