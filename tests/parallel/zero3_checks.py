"""ZeRO-3's unsliced gradients under different parameter names per rank, and llmtrain's two guards refusing
(entries of the zero3 parity launch, tests/parallel/test_parity.py).

    {"call": "tests/parallel/zero3_checks.py:skew"}, <a zero3 run>, {"call": "tests/parallel/zero3_checks.py:even"},
    {"call": "tests/parallel/zero3_checks.py:check_refusals"}

Paddle names each layer and parameter from a per-process counter ("layer_norm_51.w_0"). A rank that built more layers
earlier in its process (a second model, a helper built on one rank) names the same parameters differently, and
Paddle's ZeRO-3 orders the flat storage of the unsliced gradients it all-reduces by those names
(llmtrain/paddle_compat/zero.py). `skew` sets the GPT's counters (`KEYS`) of rank 0 to a power of ten (1000 for
counters under 100) and rank 1's three below it, so rank 1's first three of each kind sort last ("layer_norm_997" >
"layer_norm_1002") and a layout ordered by name pairs different parameters across the two ranks (measured without
llmtrain's layout: the GPT's step-1 grad norm 1.400 for one process's 1.565, its loss equal). `even` puts them at one
power of ten on both ranks, so later runs of the launch name their parameters alike again.
"""
from __future__ import annotations


KEYS = ("embedding", "layer_norm", "role_linear")
"""The naming counters of the GPT's layers (its parameters are "<key>_<number>.w_0" / ".b_0")."""


def skew() -> None:
    import paddle.distributed as dist
    from paddle.base import unique_name

    ids = unique_name.generator.ids  # {key: next number}
    for key in KEYS:
        power = 10 ** (len(str(ids[key])) + 1)
        ids[key] = power - 3 if dist.get_rank() == 1 else power


def even() -> None:
    import paddle.distributed as dist
    from paddle.base import unique_name

    ids = unique_name.generator.ids
    for key in KEYS:  # rank 1's counters are 3 behind rank 0's: both move to the same power of ten above rank 0's
        ids[key] = 10 ** (len(str(ids[key] + (3 if dist.get_rank() == 1 else 0))) + 1)


def check_refusals() -> None:
    """In the zero3 launch's processes: llmtrain's two ZeRO-3 guards raise (a tiny model, Paddle's stage 3 over the
    two ranks, every parameter left whole): the layout check when one rank's layout differs, and the before-update
    check when an unsliced parameter's gradient was re-allocated outside its all-reduced storage."""
    import paddle
    import paddle.distributed as dist

    from llmtrain.paddle_compat.zero import stage3_unsliced_grad_problems
    from llmtrain.parallel.zero import UnslicedGradCheck, _check_same_layout, _lay_out_by_structure

    group = dist.new_group([0, 1])
    core = paddle.nn.Sequential(paddle.nn.Linear(8, 8), paddle.nn.LayerNorm(8))  # 72 + 16 elements: none sliced
    opt = paddle.optimizer.AdamW(1e-3, parameters=core.parameters(),
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    model, opt, _ = paddle.distributed.sharding.group_sharded_parallel(core, opt, level="p_g_os", group=group)
    layout = _lay_out_by_structure(core, model)
    assert [name for name, *_ in layout] == ["0.bias", "0.weight", "1.bias", "1.weight"], layout
    _check_same_layout(layout, [group])  # the same on both ranks: passes
    try:
        _check_same_layout(layout[::-1] if dist.get_rank() == 1 else layout, [group])
        raise AssertionError("a layout differing between the ranks was not refused")
    except RuntimeError as e:
        assert "lay out their unsliced gradients differently" in str(e), e
    x = paddle.ones([2, 8])
    model(x).sum().backward()
    UnslicedGradCheck(model).before_update(None)  # every gradient in its storage: passes
    assert not stage3_unsliced_grad_problems(model)
    core[1].weight.clear_gradient(False)  # released: the next backward allocates a gradient of its own
    model(x).sum().backward()
    try:
        UnslicedGradCheck(model).before_update(None)
        raise AssertionError("a re-allocated unsliced gradient was not refused")
    except RuntimeError as e:
        assert core[1].weight.name in str(e) and "left the storage" in str(e), e
