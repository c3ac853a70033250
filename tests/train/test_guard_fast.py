"""The divergence guard's logic in one process, in seconds: judge, act, rewind, fp16 overflows (tests/train/fake_job.py).

    python -m pytest -q tests/train/test_guard_fast.py

A tiny GPT under the real StepRunner, AnomalyGuard, Checkpointer and Meter (`GuardRig`); the other ranks of a job
are scripted (`ScriptedComm`): rank 1 is played by feeding it what a rank-0 instance broadcast. Each test names
the fault of its guard that it exists to catch (each was checked by planting that fault):
- the verdict comes from the job-wide reduced numbers (a bad loss on rank 1 rejects the step on rank 0);
- skip: the 6th anomalous step in a row stops the run (max_consecutive_skips=5);
- rewind with rewind_back_steps=1 and skip_batches=2 equals a run that never saw the two skipped batches
  (a `before_next_step` that does nothing, or a `Meter.rewind` that keeps the later token count, fails it);
- rank 1 rewinds to rank 0's choice although its own listing shows a newer healthy checkpoint (fails if each
  rank picks its own target);
- a rewind target that fails verification falls back to the next older healthy one (fails with no fallback);
- fp16 (Paddle's GradScaler forced on over fp32 math): an overflow is skipped, the scale halves, the run equals one
  that never applied that step's update; a step the guard rejects leaves the scaler ready for the next one;
  persistent overflows stop the run with the documented message.
The same guard under real multi-process layouts: tests/parallel/guard_checks.py (pp2) and
tests/gpu_paths/test_amp_fp16.py (dp2, fp16).
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from fake_job import GuardRig, ScriptedComm, forced_loss_scaler
from llmtrain.checkpoint.listing import amend_manifest
from llmtrain.train.anomaly import AnomalousStep, AnomalyConfig, Diverged, Verdict
from llmtrain.train.anomaly_detect import Detector
from llmtrain.train.anomaly_policy import Policy

TOL = 1e-5


def _detector(others, loss=2.0, scaler=None, **cfg):
    import paddle

    from llmtrain.parallel.strategy import Topology

    comm = ScriptedComm(rank=0, world=2, others=lambda mine: np.asarray(others, dtype=mine.dtype))
    return Detector(AnomalyConfig(**cfg), Topology(rank=0, world=2), comm,
                    lambda: paddle.to_tensor(loss, dtype="float32"), scaler), comm


def test_judge_agrees_on_the_reduced_numbers():
    """[loss, count, rank 0's norm, bad ranks, bad rank-id sum, overflow ranks]: rank 1's NaN loss rejects the step
    on rank 0 too and names rank 1; a finite job is judged on the mean loss of both ranks."""
    import paddle

    norm = paddle.to_tensor(1.5, dtype="float32")
    det, comm = _detector([4.0, 1, 0, 0, 0, 0])
    v = det.judge(norm, step=1)
    assert (v.loss, v.grad_norm, v.kinds, v.overflow) == (3.0, 1.5, [], False)
    assert list(comm.reduced[0]) == [2.0, 1.0, 1.5, 0.0, 0.0, 0.0]
    det, _ = _detector([float("nan"), 1, 0, 1, 2, 0])
    with pytest.raises(AnomalousStep) as e:
        det.judge(norm, step=2)
    assert e.value.verdict.kinds == ["nonfinite_loss"] and e.value.verdict.bad_ranks == [1]
    assert not det.history  # a rejected step never enters the history


def test_judge_spikes_after_warmup_and_an_overflow_is_not_an_anomaly():
    import paddle

    det, _ = _detector([2.0, 1, 0, 0, 0, 0], loss=2.0, grad_norm_warmup_steps=1)
    for step in (1, 2):
        det.judge(paddle.to_tensor(1.0), step)
    det.local_loss = lambda: paddle.to_tensor(9.0)
    with pytest.raises(AnomalousStep) as e:  # mean loss (9 + 2) / 2 = 5.5 > 2 x 2 and +3.5 nats
        det.judge(paddle.to_tensor(11.0), 3)
    assert e.value.verdict.kinds == ["loss_spike", "grad_norm_spike"]
    # a peer's fp16 scaler found inf gradients: the inf norm is the scaler's, not an anomaly, not in the history
    det.comm.others = lambda mine: np.asarray([2.0, 1, 0, 0, 0, 1], dtype=mine.dtype)
    det.local_loss = lambda: paddle.to_tensor(2.0)
    v = det.judge(paddle.to_tensor(float("inf")), 4)
    assert v.overflow and v.kinds == [] and [h[0] for h in det.history] == [1, 2]


def test_policy_skip_stops_at_the_sixth_in_a_row_and_rewind_at_its_limit():
    p = Policy(AnomalyConfig(policy="skip"))
    v = Verdict(step=7, kinds=["loss_spike"], loss=9.0, median_loss=3.0)
    assert [p.act(v) for _ in range(6)] == ["skip"] * 5 + ["stop"]
    assert p.counts["skipped_steps"] == 5 and "6 anomalous steps in a row" in p.reason
    p.accepted()
    assert p.act(v) == "skip"  # a healthy step ends the run of skips
    r = Policy(AnomalyConfig(max_rewinds=2))
    assert r.act(v, has_healthy_checkpoint=False) == "stop" and r.reason == "no healthy checkpoint to rewind to"
    for _ in range(2):
        assert r.act(v) == "rewind"
        r.rewound()
    assert r.act(v) == "stop" and "train.anomaly.max_rewinds=2" in r.reason


def test_policy_overflow_persists_in_a_row_or_below_the_floor():
    p = Policy(AnomalyConfig(max_consecutive_overflows=3, min_loss_scale=1.0))
    v = Verdict(step=3, overflow=True, loss_scale=8.0)
    assert [p.overflowed(v) for _ in range(3)] == [False, False, True]
    p.accepted()
    assert not p.overflowed(v) and p.overflowed(Verdict(step=9, overflow=True, loss_scale=0.5))
    assert p.counts["loss_scale_overflows"] == 5


def _rig(tmp_path, tiny_gpt, **kw):
    return GuardRig(tmp_path, tiny_gpt, **kw)


def test_rewind_back_steps_and_skip_batches_equal_a_run_without_those_batches(tiny_gpt, tmp_path):
    """Checkpoints at steps 0, 2, 3, 4; step 5 spikes. rewind_back_steps=1: back to step 3 (not 4); skip_batches=2:
    the samples of steps 4 and 5 (24..39) are skipped. The rewound run then equals a clean run whose data jumps
    from sample 24 to 40: losses, weights and the exact token count."""
    rig = _rig(tmp_path / "a", tiny_gpt, anomaly={"rewind_back_steps": 1, "skip_batches": 2})
    rig.fault = lambda start: "spike" if start == 32 else None
    rig.save()
    for step in range(1, 6):
        out, action = rig.step()
        if step in (2, 3, 4):
            rig.save()
    assert action == "rewind" and rig.step_no == 3 and rig.guard.counts["rewinds"] == 1  # rewound to step 3
    assert rig.meter.tokens_total == 3 * 8 * 16  # the model's tokens are the checkpoint's again
    for _ in range(3):
        rig.step()
    ref = _rig(tmp_path / "b", tiny_gpt)
    ref.windows.merge([(24, 40)])  # a run that never sees samples 24..39
    for _ in range(6):
        ref.step()
    assert rig.data.seen[-3:] == ref.data.seen[-3:] == [40, 48, 56]
    got, want = [r for r in rig.records if r], [r for r in ref.records if r]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= TOL and g["tokens_total"] == w["tokens_total"], (g, w)
    for name, w in ref.weights().items():
        np.testing.assert_allclose(rig.weights()[name], w, atol=TOL, err_msg=name)
    with open(rig.checkpoint(3) + "/manifest.json") as f:  # a restart from the rewind target skips the window too
        assert '"skip_windows": [\n  [\n   24,\n   40' in f.read()


def test_rank_1_rewinds_to_rank_0s_choice(tiny_gpt, tmp_path):
    """Rank 0 lists steps 2 and 4 and chooses 4; an asynchronous save of step 5 completes before rank 1 lists the
    directory. Rank 1, fed rank 0's broadcast, loads step 4 like rank 0 (its own listing would say step 5)."""
    writer = _rig(tmp_path, tiny_gpt)
    for step in range(1, 5):
        writer.step()
        if step in (2, 4):
            writer.save()
    v = Verdict(step=6, kinds=["loss_spike"], loss=9.0, median_loss=3.0)
    rank0 = _rig(tmp_path, tiny_gpt, comm=ScriptedComm(rank=0, world=2))
    rank0.guard.rewinder.track(6, (40, 48))
    assert rank0.guard.policy(v, rank0.ckpt) == "rewind"
    shutil.copytree(writer.checkpoint(4), writer.checkpoint(5))
    amend_manifest(writer.checkpoint(5), {"step": 5})
    rank1 = _rig(tmp_path, tiny_gpt, comm=ScriptedComm(rank=1, world=2, broadcasts=rank0.comm.sent))
    rank1.guard.rewinder.track(6, (40, 48))
    assert rank1.guard.policy(v, rank1.ckpt) == "rewind"
    assert rank1.guard.rewind(v, rank1.ckpt, rank1.data, rank1.meter) == 4
    assert rank1.data.consumed_samples == 32


def test_a_corrupt_rewind_target_falls_back_to_the_next_older_healthy_one(tiny_gpt, tmp_path):
    rig = _rig(tmp_path, tiny_gpt)
    rig.fault = lambda start: "spike" if start == 32 else None
    for step in range(1, 6):
        if step == 5:
            shard = rig.checkpoint(4) + "/rank_00000.safetensors"
            data = bytearray(open(shard, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(shard, "wb").write(bytes(data))
        rig.step()
        if step in (2, 4):
            rig.save()
    assert rig.guard.counts["rewinds"] == 1 and rig.step_no == 2 and rig.data.consumed_samples == 16


def test_fp16_overflow_is_skipped_the_scale_halves_and_the_run_equals_one_without_that_update(tiny_gpt, tmp_path):
    """Paddle's real GradScaler (forced on over fp32 math): inf gradients at step 3. Its update is skipped, the scale
    goes 32768 -> 16384, nothing is rejected, and every step equals a run that consumed step 3's batch and advanced
    the LR without running it (the next steps' gradients unscaled by the new scale: same norms)."""
    fp16 = _rig(tmp_path / "a", tiny_gpt, scaler=forced_loss_scaler())
    fp16.fault = lambda start: "inf" if start == 16 else None
    ref = _rig(tmp_path / "b", tiny_gpt)
    for step in range(1, 6):
        before = fp16.weights()
        fp16.step()
        if step == 3:
            ref.data.next_step()
            ref.sched.step()
            ref.step_no += 1
            ref.records.append(None)
            assert all(np.array_equal(before[n], w) for n, w in fp16.weights().items())  # the update was skipped
        else:
            ref.step()
    recs = fp16.records
    assert recs[2]["loss_scale_overflow"] is True and recs[2]["loss_scale"] == 16384.0 and "anomaly" not in recs[2]
    assert [r["loss_scale"] for r in recs] == [32768.0] * 2 + [16384.0] * 3
    assert recs[-1]["loss_scale_overflows_total"] == 1 and recs[-1]["anomalies_total"] == 0
    for g, w in zip(recs, ref.records):
        if w is not None:
            assert abs(g["loss"] - w["loss"]) <= TOL and abs(g["grad_norm"] - w["grad_norm"]) <= TOL, (g, w)
    for name, w in ref.weights().items():
        np.testing.assert_allclose(fp16.weights()[name], w, atol=TOL, err_msg=name)


def test_fp16_a_rejected_step_leaves_the_scaler_ready_and_persistent_overflows_stop(tiny_gpt, tmp_path):
    """A loss spike under fp16 is rejected inside scaler.step (policy=skip): the next step unscales its own
    gradients (its norm equals the fp32 run's), the scale stays. Then inf gradients from step 5 on: the third
    overflow in a row (max_consecutive_overflows=3) is an anomaly, and policy=stop ends the run."""
    settings = {"policy": "skip", "max_consecutive_overflows": 3}
    fp16 = _rig(tmp_path / "a", tiny_gpt, scaler=forced_loss_scaler(), anomaly=settings)
    ref = _rig(tmp_path / "b", tiny_gpt, anomaly=settings)
    for rig in (fp16, ref):
        rig.fault = lambda start: "spike" if start == 16 else None
        for _ in range(4):
            rig.step()
    assert [r.get("anomaly") for r in fp16.records] == [None, None, ["loss_spike"], None]
    assert fp16.records[3]["loss_scale"] == 32768.0
    for g, w in zip(fp16.records, ref.records):
        assert abs(g["loss"] - w["loss"]) <= TOL and abs(g["grad_norm"] - w["grad_norm"]) <= TOL, (g, w)
    fp16.fault = lambda start: "inf" if start >= 32 else None
    fp16.guard.cfg.policy = "stop"
    fp16.step()
    fp16.step()
    with pytest.raises(Diverged) as e:
        fp16.step()
    msg = str(e.value)
    assert msg.startswith("training stopped at step 7: persistent fp16 loss-scale overflow (loss scale now 4096)")
    assert "train.anomaly.policy=stop" in msg and "checkpoint.resume=auto" in msg
    assert fp16.records[-1]["anomaly"] == ["loss_scale_overflow"] and fp16.records[-1]["loss_scale_overflows_total"] == 3


def test_paddles_own_scaler_update_still_raises_under_numpy_2():
    """Why `paddle_compat.amp.LossScaler` exists: Paddle 3.3.1's `_update` formats `float()` of the [1] scale when it
    lowers it, a TypeError with numpy >= 2 (if this starts passing, the workaround can go)."""
    import paddle

    scaler = forced_loss_scaler()
    scaler._cache_found_inf = True
    with pytest.raises(TypeError):
        paddle.amp.GradScaler._update(scaler)
    scaler._decr_count = 0  # (Paddle's counted the overflow before it raised)
    scaler._update()
    assert float(scaler._scale.numpy()[0]) == 16384.0


def test_a_transient_fault_is_re_run_and_leaves_no_trace(tiny_gpt, tmp_path):
    """inf gradients on the first run of step 3 only (a flipped bit): rejected, re-run from the same state, finite,
    counted as a transient fault; every record and weight equals the clean run's."""
    rig, clean = _rig(tmp_path / "a", tiny_gpt), _rig(tmp_path / "b", tiny_gpt)
    fired = []

    def once(start):
        if start == 16 and not fired:
            fired.append(start)
            return "inf"
        return None

    rig.fault = once
    for _ in range(4):
        rig.step()
        clean.step()
    assert fired and [r["transient_faults_total"] for r in rig.records] == [0, 0, 1, 1]
    assert not any("anomaly" in r for r in rig.records) and rig.guard.counts["anomalies"] == 0
    for g, w in zip(rig.records, clean.records):
        assert abs(g["loss"] - w["loss"]) <= TOL and abs(g["grad_norm"] - w["grad_norm"]) <= TOL
    for name, w in clean.weights().items():
        np.testing.assert_allclose(rig.weights()[name], w, atol=TOL, err_msg=name)


def test_skip_keeps_the_state_and_a_non_finite_state_is_never_saved(tiny_gpt, tmp_path):
    """policy=skip: the checkpoint after the skipped step 3 holds exactly step 2's tensors and says anomalous; step 4
    trains again. A NaN written into a weight (corrupted memory) makes every later save refused."""
    from safetensors.numpy import load_file

    rig = _rig(tmp_path, tiny_gpt, anomaly={"policy": "skip"})
    rig.fault = lambda start: "spike" if start == 16 else None
    for _ in range(4):
        rig.step()
        rig.save()
    shards = {s: load_file(rig.checkpoint(s) + "/rank_00000.safetensors") for s in (2, 3, 4)}
    assert any(k.startswith("optim/") for k in shards[2]) and set(shards[2]) == set(shards[3])
    assert all(np.array_equal(shards[2][k], shards[3][k]) for k in shards[2])
    assert any(not np.array_equal(shards[3][k], shards[4][k]) for k in shards[3])
    with open(rig.checkpoint(3) + "/manifest.json") as f:
        assert '"status": "anomalous"' in f.read()
    name, param = rig.named[0]
    bad = param.numpy().copy()
    bad.reshape(-1)[0] = float("nan")
    param.set_value(bad)
    rig.step()
    assert rig.save() is None and not (tmp_path / "checkpoints" / "step_5").exists()
