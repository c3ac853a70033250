"""Degrees and batch arithmetic are checked up front, with numbers in the message."""
from __future__ import annotations

import pytest

from llmtrain.models.config import ModelConfig
from llmtrain.parallel.config import ParallelConfig
from llmtrain.parallel.layout import ConfigError, check_model_fits, resolve_layout
from llmtrain.train.config import TrainConfig


def T(**kw):
    base = dict(global_batch_size=None, micro_batch_size=None, grad_accum=None)
    base.update(kw)
    return TrainConfig(**base)


def test_single_device_default():
    lay = resolve_layout(None, T(global_batch_size=8), 1)
    assert (lay.world, lay.micro_batch, lay.grad_accum, lay.global_batch) == (1, 8, 1, 8)


@pytest.mark.parametrize(
    "kw, dp, expect",
    [
        (dict(global_batch_size=16, micro_batch_size=2), 2, (16, 2, 4)),
        (dict(global_batch_size=16, grad_accum=2), 2, (16, 4, 2)),
        (dict(micro_batch_size=2, grad_accum=3), 2, (12, 2, 3)),
        (dict(global_batch_size=12, micro_batch_size=2, grad_accum=3), 2, (12, 2, 3)),
        (dict(micro_batch_size=4), 4, (16, 4, 1)),
    ],
)
def test_batch_arithmetic_derives_the_rest(kw, dp, expect):
    lay = resolve_layout(ParallelConfig(dp=dp), T(**kw), dp)
    assert (lay.global_batch, lay.micro_batch, lay.grad_accum) == expect


def test_inconsistent_batch_names_all_numbers():
    with pytest.raises(ConfigError) as e:
        resolve_layout(ParallelConfig(dp=2), T(global_batch_size=10, micro_batch_size=2, grad_accum=3), 2)
    msg = str(e.value)
    assert "train.global_batch_size=10" in msg and "2 x 3 x 2 = 12" in msg


def test_indivisible_global_batch():
    with pytest.raises(ConfigError, match=r"global batch 10 is not divisible by micro x data-parallel = 4 x 2 = 8"):
        resolve_layout(ParallelConfig(dp=2), T(global_batch_size=10, micro_batch_size=4), 2)


def test_world_size_mismatch_and_hint():
    with pytest.raises(ConfigError, match=r"parallel.dp=2 x parallel.tp=2 .* = 4 processes, but the job has 2"):
        resolve_layout(ParallelConfig(dp=2, tp=2), T(global_batch_size=8), 2)
    with pytest.raises(ConfigError, match=r"add e.g. \+parallel=dp2"):
        resolve_layout(None, T(global_batch_size=8), 2)


def test_unsupported_combinations_give_reasons():
    with pytest.raises(ConfigError) as e:
        resolve_layout(ParallelConfig(pp=2, sharding=2, sharding_stage=3), T(global_batch_size=8), 4)
    assert "sharding_stage=3 with parallel.pp=2" in str(e.value)
    with pytest.raises(ConfigError, match="needs pp > 2"):
        resolve_layout(ParallelConfig(pp=2, pp_schedule="interleaved", virtual_pp=2), T(global_batch_size=8), 2)
    with pytest.raises(ConfigError, match="a multiple of pp from 4"):
        resolve_layout(ParallelConfig(pp=4, pp_schedule="interleaved", virtual_pp=2), T(global_batch_size=6, micro_batch_size=1), 4)
    # 2 x pp micro-batches or more: fleet's interleaved 1F1B takes any count (8 over pp3)
    lay = resolve_layout(ParallelConfig(pp=3, pp_schedule="interleaved", virtual_pp=2), T(global_batch_size=8, micro_batch_size=1), 3)
    assert (lay.grad_accum, lay.virtual_pp) == (8, 2)


def test_several_problems_in_one_message():
    with pytest.raises(ConfigError) as e:
        resolve_layout(ParallelConfig(dp=3, sharding_stage=5), T(global_batch_size=8), 2)
    assert len(e.value.problems) >= 3


def test_model_must_fit_tp_and_pp():
    m = ModelConfig(name="x", hidden_size=96, num_layers=6, num_heads=6, num_kv_heads=3, ffn_hidden_size=102, vocab_size=1002)
    lay = resolve_layout(ParallelConfig(tp=4, pp=4), T(global_batch_size=8), 16)
    with pytest.raises(ConfigError) as e:
        check_model_fits(lay, m)
    msg = str(e.value)
    for needle in ("model.num_heads=6 is not divisible by parallel.tp=4", "model.num_kv_heads=3", "model.ffn_hidden_size=102",
                   "model.vocab_size (padded)=1002"):
        assert needle in msg
    assert "num_layers" not in msg  # 6 blocks over 4 stages: an uneven split (tests/parallel/test_pp_split.py)
    ok = resolve_layout(ParallelConfig(tp=2, pp=2), T(global_batch_size=8), 4)
    check_model_fits(ok, ModelConfig(name="y", hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=128, vocab_size=256))


def test_context_parallel_degrees_and_exchange_are_checked():
    lay = resolve_layout(ParallelConfig(dp=2, cp=2, cp_comm="a2a"), T(global_batch_size=8, micro_batch_size=2), 4)
    assert (lay.world, lay.cp, lay.cp_comm, lay.data_parallel, lay.grad_accum) == (4, 2, "a2a", 2, 2)  # cp reads no extra data
    with pytest.raises(ConfigError, match=r"parallel.dp=2 x .* x parallel.cp=2 = 4 processes, but the job has 2"):
        resolve_layout(ParallelConfig(dp=2, cp=2), T(global_batch_size=8), 2)
    with pytest.raises(ConfigError) as e:
        resolve_layout(ParallelConfig(cp=0, cp_comm="p2p"), T(global_batch_size=8), 1)
    assert "parallel.cp=0: must be >= 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve_layout(ParallelConfig(cp=2, cp_comm="p2p", sharding=2, sharding_stage=2), T(global_batch_size=8), 4)
    msg = str(e.value)
    assert "parallel.cp_comm='p2p'" in msg and "sharding_stage" not in msg  # ZeRO-2/3 x cp works
    for stage in (2, 3):
        lay = resolve_layout(ParallelConfig(cp=2, sharding=2, sharding_stage=stage), T(global_batch_size=8), 4)
        assert (lay.cp, lay.sharding, lay.sharding_stage) == (2, 2, stage)
    with pytest.raises(ConfigError) as e:
        resolve_layout(ParallelConfig(dp=2, cp=2, ep=2), T(global_batch_size=8), 4)
    assert "parallel.cp=2 with parallel.ep=2: expert parallelism under context parallelism is not implemented" in str(e.value)
    lay = resolve_layout(ParallelConfig(cp=2, order=["dp", "cp", "pp", "sharding", "tp"]), T(global_batch_size=8), 2)
    assert lay.order == ("dp", "cp", "pp", "sharding", "tp")
