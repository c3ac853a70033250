"""GPU-only branch `async-save-device-copy`: on a GPU an asynchronous save copies each tensor with `.numpy()`.

    python -m pytest tests/gpu_paths/test_async_save_device_copy.py -q

With `checkpoint.async_save=true` the training thread copies this rank's tensors to host arrays and a background
thread writes them while training goes on. On CPU the copy goes into reused host buffers (`HostBuffers`); on a GPU
`Checkpointer` keeps none (llmtrain/checkpoint/manager.py), so every tensor goes through `.numpy()`, the
device-to-host copy. On CPU `paddle.get_device` answers "gpu:0" while the Checkpointer is built, then the save is
rehearsed with the background write held until the model's parameters and the optimizer's state have been
overwritten in place (the next optimizer step): the checkpoint must hold the values of the step that was saved,
every tensor, and equal a synchronous save of that step. On a GPU the same test runs on the device.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import paddle

from gpu_rehearsal import ON_GPU, reaches
from llmtrain.checkpoint.manager import Checkpointer
from llmtrain.checkpoint.reader import Manifest, model_state
from llmtrain.checkpoint.shards import ShardIndex
from llmtrain.parallel.layout import Layout
from train.fake_job import GuardRig  # tests/train (no package: a namespace import)


def _all_tensors(path: str) -> dict:
    index = ShardIndex(path)
    try:
        return {key: np.asarray(index.full(key), dtype=np.float32) for key in index.keys("")}
    finally:
        index.close()


def test_async_save_on_a_gpu_copies_every_tensor_before_training_goes_on(tiny_gpt, tmp_path, monkeypatch):
    rig = GuardRig(tmp_path / "run", tiny_gpt)
    rig.step()  # AdamW moments and master state exist
    cfg = dataclasses.replace(rig.cfg, checkpoint=dataclasses.replace(rig.cfg.checkpoint, async_save=True))
    with reaches("async-save-device-copy"), monkeypatch.context() as gpu:
        if not ON_GPU:
            gpu.setattr(paddle, "get_device", lambda *a: "gpu:0")
        ckpt = Checkpointer(cfg, Layout(), rig.topo, rig.ckpt.state, comm=rig.comm)
    assert ckpt.files.buffers is None and ckpt.writer is not None
    release = threading.Event()
    write = ckpt.writer._write
    ckpt.writer._write = lambda snap: (release.wait(60), write(snap))[1]  # the write starts after training moved on
    saved = {name: p.numpy().copy() for name, p in rig.named}
    moments = [(t, t.numpy().copy()) for acc in rig.opt._accumulators.values() for t in acc.values()]
    assert moments
    path = ckpt.save(1, 0)
    with paddle.no_grad():  # the next step overwrites parameters and optimizer state in place
        for _, p in rig.named:
            p.set_value(paddle.full_like(p, 7.0))
        for t, _ in moments:
            t.set_value(paddle.full_like(t, 7.0))
    release.set()
    ckpt.wait()
    ckpt.close()
    got = model_state(Manifest.read(path))
    assert sorted(got) == sorted(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    written = _all_tensors(path)
    assert not any((v == 7.0).all() for v in written.values()), [k for k, v in written.items() if (v == 7.0).all()]
    # the same step saved synchronously (the state put back) writes the same tensors
    with paddle.no_grad():
        for name, p in rig.named:
            p.set_value(paddle.to_tensor(saved[name]))
        for t, value in moments:
            t.set_value(paddle.to_tensor(value))
    sync_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(tmp_path / "sync")),
                                   checkpoint=dataclasses.replace(cfg.checkpoint, async_save=False))
    sync = Checkpointer(sync_cfg, Layout(), rig.topo, rig.ckpt.state, comm=rig.comm)
    sync_written = _all_tensors(sync.save(1, 0))
    sync.close()
    assert sorted(sync_written) == sorted(written)
    for key, value in written.items():
        np.testing.assert_array_equal(sync_written[key], value, err_msg=key)
