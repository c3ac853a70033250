"""Loading a checkpoint into this rank's layout: each full tensor cut to the part this rank holds.

    python -m pytest -q tests/checkpoint/test_resume.py -k any_layout
    restorer = LayoutRestorer(layout, topo, state)
    restorer.tensors(path, manifest)     # parameters and optimizer state, sliced for this layout
    restorer.rng(path, manifest)         # this rank's RNG states (when the writing job had as many ranks)

Checkpoints hold pieces of full tensors (`shards.py`), whatever layout wrote them; `ShardIndex` reassembles
a full tensor and this module cuts it: a tp/ep piece (`parallel/slicing.py`), a ZeRO-3 flat slice into the
parameter's flat storage, a stage-1 V2 flat slice of the optimizer state (of
its tp piece under tp), or the whole tensor for replicated ones.
"""
from __future__ import annotations

import os
import pickle
import random

import numpy as np
import paddle

from llmtrain.checkpoint.shards import ShardIndex, is_split_like_param
from llmtrain.contracts import tags
from llmtrain.models.init import load_full_state
from llmtrain.paddle_compat.optim import fresh_optimizer_entries, optimizer_state_dict
from llmtrain.paddle_compat.sharding_fused import fused_spans, set_fused_state
from llmtrain.paddle_compat.sharding_v2 import sharding_v2, v2_slices
from llmtrain.paddle_compat.zero import stage3_slices, stage3_storage
from llmtrain.parallel.expert_states import ExpertStates
from llmtrain.parallel.slicing import TensorSlices, local_slice


class LayoutRestorer:
    """Restores this rank's parameters, optimizer state and RNG states from a checkpoint of any layout."""

    def __init__(self, layout, topo, state):
        self.layout, self.topo, self.state = layout, topo, state

    def tensors(self, path: str, manifest: dict) -> None:
        """The trained parameters and the optimizer state of `path`, cut for this layout."""
        index = ShardIndex(path)
        try:
            self._parameters(index, path)
            self._optimizer(index, manifest)
        finally:
            index.close()

    def _cut(self, full: np.ndarray, param, key: str, sliced: dict) -> np.ndarray:
        """This rank's part of a full tensor: a ZeRO-3 flat slice, a tp/ep piece, or the whole."""
        if not is_split_like_param(key):
            return full
        if param.name in sliced:
            start, end, padded = sliced[param.name]
            return np.pad(full.ravel(), (0, padded - full.size))[start:end]
        return local_slice(full, param, self.topo.tp_rank, self.layout.tp, self.topo.ep_rank, self.layout.ep)

    def _parameters(self, index: ShardIndex, path: str) -> None:
        """The trained parameters, cut for this layout (ZeRO-3 ones into their flat storage)."""
        t = self.state.tensors
        sliced = stage3_slices(t.model)  # ZeRO-3 parameters held as flat slices on this rank
        state = {}
        for name, _ in t.named_params:
            full = index.full(f"model/{name}")
            if full is not None:
                state[name] = full
        whole = [(n, p) for n, p in t.named_params if p.name not in sliced]
        load_full_state(whole, state, TensorSlices(self.topo.tp_rank, self.layout.tp, self.topo.ep_rank, self.layout.ep),
                        source=path)
        for name, param in t.named_params:
            if param.name in sliced:
                if name not in state or list(state[name].shape) != [int(x) for x in param.shape]:
                    raise ValueError(f"{path}: {name} missing or mis-shaped for the ZeRO-3 parameter {list(param.shape)}")
                value = self._cut(state[name], param, f"model/{name}", sliced)
                store = stage3_storage(param)
                store.set_value(paddle.to_tensor(value, dtype=store.dtype))

    def _optimizer(self, index: ShardIndex, manifest: dict) -> None:
        """Accumulators and master weights keyed by this run's optimizer variable names, cut for this layout."""
        t = self.state.tensors
        sliced = stage3_slices(t.model)
        v2 = v2_slices(t.optimizer) if sharding_v2(t.optimizer) is not None else None
        experts = ExpertStates(t.named_params, self.layout, self.topo) if self.layout.ep > 1 else None
        accumulators, masters = {}, {}
        fused = fused_spans(t.optimizer)  # V1 tensor fusion: state on this rank's fused parameters
        if fused:
            self._fused_state(index, fused, accumulators, masters)
        for name, param in ([] if fused else t.named_params):
            if experts is not None and tags.is_expert(param) and not experts.keeps_state(param):
                continue  # another rank of its expert-data-parallel group keeps this expert tensor's state
            if v2 is not None:  # stage-1 V2: this rank's flat slice of the state, or none
                if param.name in v2:
                    self._v2_state(index, name, param, v2, accumulators, masters)
                continue
            var_name = stage3_storage(param).name if param.name in sliced else param.name
            for key in index.keys(f"optim/{name}/"):
                acc = key.rsplit("/", 1)[1]
                tensor = paddle.to_tensor(np.ascontiguousarray(self._cut(index.full(key), param, key, sliced)))
                if acc == "master":
                    masters[var_name] = tensor
                else:
                    accumulators.setdefault(var_name, {})[acc] = tensor
        state = optimizer_state_dict(accumulators, masters, manifest["scheduler"])
        # a checkpoint from before the first update (step 0) holds no optimizer state: fresh values (divergence guard)
        state.update(fresh_optimizer_entries(t.optimizer, state))
        if fused:
            set_fused_state(t.optimizer, state)
        else:
            t.optimizer.set_state_dict(state)

    def _v2_state(self, index: ShardIndex, name: str, param, v2: dict, accumulators: dict, masters: dict) -> None:
        """Stage-1 V2: the full accumulators and master weight of `param`, cut to this rank's tp piece (tp > 1) or
        block of routed experts (ep > 1), then to this rank's flat slice of it."""
        for key in index.keys(f"optim/{name}/"):
            acc = key.rsplit("/", 1)[1]
            full = index.full(key)
            if is_split_like_param(key):
                full = local_slice(full, param, self.topo.tp_rank, self.layout.tp, self.topo.ep_rank, self.layout.ep)
            tensor = paddle.to_tensor(np.ascontiguousarray(self._cut(full, param, key, v2)))
            if acc == "master":
                masters[param.name] = tensor
            else:
                accumulators.setdefault(param.name, {})[acc] = tensor

    def _fused_state(self, index: ShardIndex, fused: dict, accumulators: dict, masters: dict) -> None:
        """V1 tensor fusion: each fused parameter's accumulators and master weight assembled from its parameters'
        full tensors, each cut to this rank's tp piece and laid at its offset (the alignment padding zero); the
        [1] beta powers from its first parameter (every parameter's are equal)."""
        names = {param.name: (name, param) for name, param in self.state.tensors.named_params}
        for fname, (numel, members) in fused.items():
            for pname, off, n in members:
                name, param = names[pname]
                for key in index.keys(f"optim/{name}/"):
                    acc = key.rsplit("/", 1)[1]
                    full = index.full(key)
                    target = masters if acc == "master" else accumulators.setdefault(fname, {})
                    slot = fname if acc == "master" else acc
                    if not is_split_like_param(key):
                        target.setdefault(slot, paddle.to_tensor(np.ascontiguousarray(full)))
                        continue
                    if slot not in target:
                        target[slot] = np.zeros(numel, dtype=np.float32)
                    target[slot][off: off + n] = local_slice(full, param, self.topo.tp_rank, self.layout.tp).ravel()
        for per in [masters, *accumulators.values()]:
            for k, v in per.items():
                if isinstance(v, np.ndarray):
                    per[k] = paddle.to_tensor(v)

    def rng(self, path: str, manifest: dict) -> None:
        """This rank's RNG states, when the checkpoint was written by as many ranks (else they start fresh)."""
        rng_path = os.path.join(path, f"rank_{self.topo.rank:05d}.rng")
        if manifest["world"] == self.topo.world and os.path.exists(rng_path):
            with open(rng_path, "rb") as f:
                rng = pickle.load(f)
            paddle.set_rng_state(rng["paddle"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
