"""What each rank writes into a checkpoint, and how any layout reads it back.

    tensors, meta = collect_shard(built, topo, layout)      # save side
    index = ShardIndex(ckpt_dir); index.full("model/layers.0.attn.q_proj.weight")   # load side

Format (ours, layout-free): every tensor is stored under a canonical key —
`model/<param>` or `optim/<param>/<accumulator>` (`moment1`, `moment2`,
`beta1_pow_acc`, `beta2_pow_acc`, `master`) — as the slice this rank holds,
with its global shape, the split axis and the offset of the slice along it.
A tensor replicated over data-parallel, sharding or tensor-parallel ranks is
written once (by one data rank, chosen to balance the bytes, so the ranks share
the copying and writing); a tp-split tensor by each tp rank of one data rank;
sharded (ZeRO-1) optimizer state by the rank that owns it; ZeRO-3's parameters and stage-1 V2's optimizer
state (`sharding_split_param`) as flat slices of the flattened, padded tensor (under tp, V2's of the flattened,
padded tp piece, whose place in the full tensor the metadata's `flat.piece` gives); V1's fused optimizer state
(`sharding_tensor_fusion`) cut into each parameter's whole tensor, as without fusion. Loading assembles
the full tensor from its pieces and cuts this rank's slice for the new layout,
so a checkpoint resumes under any dp/tp/pp/sharding mix.
"""
from __future__ import annotations

import glob
import json
import os
import threading
from typing import Optional

import numpy as np
import paddle

from llmtrain.contracts import tags
from llmtrain.paddle_compat.optim import OptimizerState
from llmtrain.parallel.expert_states import ExpertStates
from llmtrain.parallel.slicing import full_shape

SCALAR_ACCUMULATORS = ("beta1_pow_acc", "beta2_pow_acc")
"""Per-parameter [1] tensors: never split, whatever the parameter's layout."""


def is_split_like_param(key: str) -> bool:
    """Does the tensor under `key` have the parameter's shape (and so its tp split)?"""
    return not key.rsplit("/", 1)[-1] in SCALAR_ACCUMULATORS


class HostBuffers:
    """Host arrays reused from one save to the next (`checkpoint.async_save`): a save's copy lands in memory
    that is already mapped, in one pass.

    `.numpy()` of a CPU tensor allocates a new array and fills it at ~0.5 GB/s here (128 MB: 0.23-0.31 s);
    viewing the tensor through DLPack (no copy; a view's offset included) and copying into an array
    allocated before runs at ~6 GB/s (0.018-0.023 s). The buffers of a
    save are handed to the background writer, so they may be reused only after that write is complete
    (`Checkpointer.save` waits for it before copying); host memory keeps one copy of the shard between saves.
    Buffers are taken by shape, in the order of the copies, which is the same at every save.

    First touching fresh memory is slow on some hosts (~90 MB/s on this CPU machine), so `reserve` allocates
    and touches a save's buffers on a thread once their shapes are known (after the first optimizer step;
    numpy releases the GIL while it fills) and the first save finds them ready."""

    def __init__(self):
        self._free: dict[tuple, list] = {}
        self._used: dict[tuple, list] = {}
        self._reserving: Optional[threading.Thread] = None

    def reserve(self, shapes: list) -> None:
        """Allocate and touch one buffer per shape, in the background (once)."""
        def touch():
            for shape in shapes:
                buf = np.empty(shape, dtype=np.float32)
                buf.fill(0)
                self._free.setdefault(tuple(shape), []).append(buf)

        if self._reserving is None:
            self._reserving = threading.Thread(target=touch, name="llmtrain-checkpoint-buffers", daemon=True)
            self._reserving.start()

    def start(self) -> None:
        """A new save: every buffer may be taken again (the background reservation, if any, is complete)."""
        if self._reserving is not None:
            self._reserving.join()
        for shape, used in self._used.items():
            self._free.setdefault(shape, []).extend(used)
        self._used = {}

    @staticmethod
    def shapes(built, topo, layout) -> list:
        """The shapes of the buffers a save of this rank takes, in order (nothing copied)."""
        probe = _ShapeProbe()
        collect_shard(built, topo, layout, probe)
        return probe.seen

    def copy(self, t) -> np.ndarray:
        shape = tuple(int(x) for x in t.shape)
        free = self._free.get(shape)
        buf = free.pop() if free else np.empty(shape, dtype=np.float32)
        self._used.setdefault(shape, []).append(buf)
        np.copyto(buf, np.from_dlpack(t.detach()))  # detach: no copy, the same storage (and offset)
        return buf


class _ShapeProbe:
    """Stands where HostBuffers does in collect_shard and records the shapes instead of copying."""

    def __init__(self):
        self.seen: list = []

    def copy(self, t) -> np.ndarray:
        self.seen.append(tuple(int(x) for x in t.shape))
        return np.empty(self.seen[-1], dtype=np.float32)  # untouched: costs no memory


def _np32(t, clone: bool = True, pool: Optional[HostBuffers] = None) -> np.ndarray:
    """An fp32 numpy array that owns its memory (a copy: training may go on while it is written).

    A ZeRO-2 parameter is a view into one flat buffer: `.numpy()` of the view
    copies the whole buffer (18 s for 40 gpt2-small parameters) and keeps it
    alive through the returned array. Cloning first copies only the view's
    elements (0.13 s) and leaves an array that owns its memory. `clone=False` for
    tensors that are not views: `.numpy()` alone already copies (half the time).
    With `pool`, an fp32 tensor on the CPU is copied once into a reused host buffer
    (its DLPack view covers only a view's own elements, so no clone is needed)."""
    if t.dtype != paddle.float32:
        t = t.astype("float32")
    elif pool is not None and t.place.is_cpu_place():
        return pool.copy(t)
    elif clone:
        t = t.clone()
    return np.ascontiguousarray(t.numpy())


def _owns_replica(param, topo, tp_degree: int) -> bool:
    """True if this rank is the one that writes `param` (or its tp slice)."""
    if getattr(param, "is_firstly_shared", True) is False:
        return False  # the tied table's copy on a later pipeline stage
    if getattr(topo, "cp_rank", 0) != 0:
        return False  # replicated over context-parallel ranks: cp rank 0 writes it
    if tags.split_axis(param) is None and topo.tp_rank != 0:
        return False  # replicated over tp ranks: tp rank 0 writes it
    return True


def _piece_meta(name: str, param, arr_shape, topo, tp_degree: int, split: bool = True, ep_degree: int = 1) -> dict:
    expert = ep_degree > 1 and tags.is_expert(param)
    if expert:  # a block of routed experts: rows ep_rank * E/ep ... of the expert axis
        axis = tags.expert_axis(param) if split else None
        gshape = full_shape(param, tp_degree, ep_degree) if axis is not None else list(arr_shape)
        offset = topo.ep_rank * int(arr_shape[axis]) if axis is not None else 0
        return {"name": name, "global_shape": [int(x) for x in gshape], "axis": axis, "offset": offset}
    axis = tags.split_axis(param) if split else None
    gshape = full_shape(param, tp_degree) if axis is not None else list(arr_shape)
    offset = topo.tp_rank * int(arr_shape[axis]) if axis is not None else 0
    return {"name": name, "global_shape": [int(x) for x in gshape], "axis": axis, "offset": offset}


def optimizer_state(optimizer) -> OptimizerState:
    """The optimizer's local state, read by (parameter variable name, accumulator)."""
    return OptimizerState(optimizer.state_dict())


def _flat_meta(name: str, param, start: int, padded: int, piece: Optional[dict] = None) -> dict:
    """A flat slice: elements [start, start + len) of the flattened parameter padded to `padded`. With `piece`
    (`_tp_piece`), of this rank's tp piece of the parameter instead, placed in the full tensor as `piece` says."""
    shape = [int(x) for x in param.shape]
    flat = {"numel": int(np.prod(shape)), "padded": int(padded)}
    if piece is not None:
        flat["piece"] = piece
        shape = piece.pop("global_shape")
    return {"name": name, "global_shape": shape, "axis": 0, "offset": int(start), "flat": flat}


def _tp_piece(name: str, param, topo, tp_degree: int) -> Optional[dict]:
    """Where this rank's tp piece of a split parameter lies in the full tensor ({"shape", "axis", "offset"}, and the
    full "global_shape"), or None for a parameter whole on every tp rank."""
    if tp_degree == 1 or tags.split_axis(param) is None:
        return None
    m = _piece_meta(name, param, [int(x) for x in param.shape], topo, tp_degree)
    return {"shape": [int(x) for x in param.shape], "axis": m["axis"], "offset": m["offset"],
            "global_shape": m["global_shape"]}


def _expert_piece(name: str, param, topo, layout) -> dict:
    """Where this rank's block of routed experts lies in the full tensor (`_tp_piece`'s form): rows
    ep_rank x E / ep ... of the expert axis (experts are whole over tp)."""
    m = _piece_meta(name, param, [int(x) for x in param.shape], topo, layout.tp, ep_degree=layout.ep)
    return {"shape": [int(x) for x in param.shape], "axis": m["axis"], "offset": m["offset"],
            "global_shape": m["global_shape"]}


def _collect_sliced(name, param, span, opt_state, masters, tensors, meta, pool=None) -> None:
    """ZeRO-3: this rank's flat slice of the value and of each optimizer accumulator."""
    from llmtrain.paddle_compat.zero import stage3_storage

    start, _end, padded = span
    store = stage3_storage(param)
    tensors[f"model/{name}"] = _np32(store, pool=pool)
    meta[f"model/{name}"] = _flat_meta(name, param, start, padded)
    _collect_flat_state(name, param, store.name, span, opt_state, masters, tensors, meta, pool)


def _collect_v2_state(name, param, span, opt_state, masters, tensors, meta, pool=None, piece=None) -> None:
    """Stage-1 sharding V2: this rank's flat slice of each optimizer accumulator and of the master weight (the
    parameter's value is whole on every sharding rank and written as any replicated one); under tp a flat slice of
    this rank's tp piece (`piece`, from `_tp_piece`)."""
    _collect_flat_state(name, param, param.name, span, opt_state, masters, tensors, meta, pool, piece)


def _collect_flat_state(name, param, state_name, span, opt_state, masters, tensors, meta, pool, piece=None) -> None:
    """This rank's flat slice [start, start + its length) of each optimizer accumulator and of the master weight
    kept under `state_name` (split-like accumulators; the others, such as Adam's beta powers, whole); `piece`: the
    slices are of a tp piece of the parameter (`_tp_piece`)."""
    start, _end, padded = span
    flat = lambda: _flat_meta(name, param, start, padded, dict(piece) if piece else None)  # noqa: E731
    for acc, var in opt_state.accumulators(state_name):
        key = f"optim/{name}/{acc}"
        tensors[key] = _np32(var, pool=pool)
        meta[key] = (flat() if is_split_like_param(key)
                     else {"name": name, "global_shape": [int(x) for x in var.shape], "axis": None, "offset": 0})
    if state_name in masters:
        tensors[f"optim/{name}/master"] = _np32(masters[state_name], pool=pool)
        meta[f"optim/{name}/master"] = flat()


def _collect_fused_state(name, param, where, opt_state, masters, tensors, meta, topo, layout, flat_of) -> None:
    """V1 with tensor fusion: `param`'s part (`where` = (fused name, offset, numel)) of each accumulator and of the
    master weight of its fused parameter, written under the parameter's canonical keys as a non-fused run writes
    them; `flat_of(tensor)` is the fused tensor as one host array (copied once per save)."""
    fused, off, numel = where
    shape = [int(x) for x in param.shape]
    states = list(opt_state.accumulators(fused)) + ([("master", masters[fused])] if fused in masters else [])
    for acc, var in states:
        key = f"optim/{name}/{acc}"
        split = is_split_like_param(key)
        arr = flat_of(var)[off: off + numel].reshape(shape).copy() if split else _np32(var)
        tensors[key] = arr
        meta[key] = _piece_meta(name, param, arr.shape, topo, layout.tp, split=split)


def _balanced_owners(named_params, n: int) -> dict:
    """{name: writer in [0, n)}: largest tensors first, each to the least-loaded writer (the same on every rank)."""
    load, owner = [0] * n, {}
    sizes = [(-int(np.prod([int(x) for x in p.shape])), name) for name, p in named_params]
    for neg, name in sorted(sizes):
        w = min(range(n), key=lambda k: (load[k], k))
        owner[name] = w
        load[w] -= neg
    return owner


def collect_shard(built, topo, layout, pool: Optional[HostBuffers] = None) -> tuple[dict, dict]:
    """({tensor key: numpy slice}, {tensor key: piece metadata}) this rank writes (copied into `pool` if given)."""
    from llmtrain.paddle_compat.sharding_fused import fused_spans
    from llmtrain.paddle_compat.sharding_v2 import sharding_v2, v2_slices
    from llmtrain.paddle_compat.zero import stage3_slices

    tensors, meta = {}, {}
    views = layout.sharding_stage == 2  # ZeRO-2 parameters and states may be views into flat buffers
    first_data_rank = topo.dp_rank == 0
    # replicated tensors are spread over the data ranks, balanced by size, so each rank copies and
    # writes ~1/n of them: a save's copy and write take ~1/n of the time on the slowest rank
    data_ranks = layout.data_parallel
    my_data_rank = topo.data_rank
    param_writer = _balanced_owners(built.named_params, data_ranks)  # model tensors: any data rank
    state_writer = _balanced_owners(built.named_params, layout.dp)   # optimizer state: any dp replica
    opt_state = optimizer_state(built.optimizer)
    masters = opt_state.masters
    sliced = stage3_slices(built.model)
    v2 = v2_slices(built.optimizer) if sharding_v2(built.optimizer) is not None else None  # V2: flat state slices
    fused_at = {p: (f, off, n) for f, (_, members) in fused_spans(built.optimizer).items() for p, off, n in members}
    flat = {}  # V1 tensor fusion: each fused tensor's host copy, made once
    flat_of = lambda var: flat.setdefault(var.name, _np32(var).ravel())  # noqa: E731
    ep = layout.ep
    experts = ExpertStates(built.named_params, layout, topo) if ep > 1 else None
    for name, param in built.named_params:
        if param.name in sliced:
            if first_data_rank:
                _collect_sliced(name, param, sliced[param.name], opt_state, masters, tensors, meta, pool)
            continue
        if ep > 1 and tags.is_expert(param):
            values = topo.data_rank < ep and topo.tp_rank == 0  # the first ep group holds every expert once (whole over tp)
            states = experts.writes_state(param, topo)  # its owner in each edp group, or the first ep group's rank
            if v2 is not None:  # stage-1 V2: this rank's flat slice of its block's state (the experts' own buckets)
                _collect_experts(name, param, topo, layout, (None, masters), tensors, meta, views, pool, values)
                if states and param.name in v2:
                    _collect_v2_state(name, param, v2[param.name], opt_state, masters, tensors, meta, pool,
                                      _expert_piece(name, param, topo, layout))
                continue
            _collect_experts(name, param, topo, layout, (opt_state if states else None, masters), tensors, meta, views,
                             pool, values)
            continue
        if not _owns_replica(param, topo, layout.tp):
            continue
        if param_writer[name] == my_data_rank:  # parameters: identical on every dp and sharding rank (not ZeRO-3)
            key = f"model/{name}"
            arr = _np32(param, clone=views, pool=pool)
            tensors[key] = arr
            meta[key] = _piece_meta(name, param, arr.shape, topo, layout.tp)
        if state_writer[name] != topo.dp_rank:
            continue  # optimizer state is identical across dp replicas; sharding owners write their part
        if sliced and topo.sharding_rank != 0:
            continue  # ZeRO-3 keeps an unsliced parameter's state whole on every sharding rank
        if v2 is not None:
            if param.name in v2:  # this sharding rank's part of the parameter's state (none: another rank's)
                _collect_v2_state(name, param, v2[param.name], opt_state, masters, tensors, meta, pool,
                                  _tp_piece(name, param, topo, layout.tp))
            continue
        if fused_at:
            if param.name in fused_at:  # V1 tensor fusion: this rank's parameters' parts of its fused state
                _collect_fused_state(name, param, fused_at[param.name], opt_state, masters, tensors, meta, topo,
                                     layout, flat_of)
            continue
        for acc, var in opt_state.accumulators(param.name):
            key = f"optim/{name}/{acc}"
            arr = _np32(var, clone=views, pool=pool)
            tensors[key] = arr
            meta[key] = _piece_meta(name, param, arr.shape, topo, layout.tp, split=is_split_like_param(key))
        if param.name in masters:
            key = f"optim/{name}/master"
            arr = _np32(masters[param.name], clone=views, pool=pool)
            tensors[key] = arr
            meta[key] = _piece_meta(name, param, arr.shape, topo, layout.tp)
    return tensors, meta


def _collect_experts(name, param, topo, layout, state, tensors, meta, views, pool, values: bool) -> None:
    """Expert parallelism: this rank's block of experts as pieces of the full tensor: its values when `values`, its
    optimizer state when `state` = (the optimizer state, master weights) holds one (None: another rank writes it)."""
    if values:
        tensors[f"model/{name}"] = arr = _np32(param, clone=views, pool=pool)
        meta[f"model/{name}"] = _piece_meta(name, param, arr.shape, topo, layout.tp, ep_degree=layout.ep)
    opt_state, masters = state
    if opt_state is None:
        return
    for acc, var in opt_state.accumulators(param.name):
        key = f"optim/{name}/{acc}"
        if not is_split_like_param(key) and topo.ep_rank != 0:
            continue  # [1] beta powers: the same on every rank, written once
        tensors[key] = arr = _np32(var, clone=views, pool=pool)
        meta[key] = _piece_meta(name, param, arr.shape, topo, layout.tp, split=is_split_like_param(key), ep_degree=layout.ep)
    if param.name in masters:
        key = f"optim/{name}/master"
        tensors[key] = arr = _np32(masters[param.name], clone=views, pool=pool)
        meta[key] = _piece_meta(name, param, arr.shape, topo, layout.tp, ep_degree=layout.ep)


class ShardIndex:
    """All pieces of a checkpoint directory, assembled into full tensors on demand."""

    def __init__(self, ckpt_dir: str):
        from safetensors import safe_open

        self.dir = ckpt_dir
        self.pieces: dict[str, list] = {}
        self._open = {}
        self._safe_open = safe_open
        for meta_path in sorted(glob.glob(os.path.join(ckpt_dir, "rank_*.json"))):
            tensor_file = meta_path[: -len(".json")] + ".safetensors"
            with open(meta_path) as f:
                for key, piece in json.load(f)["tensors"].items():
                    self.pieces.setdefault(key, []).append((tensor_file, key, piece))

    def has(self, key: str) -> bool:
        return key in self.pieces

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.pieces if k.startswith(prefix)]

    def _read(self, path: str, key: str) -> np.ndarray:
        if path not in self._open:
            self._open[path] = self._safe_open(path, framework="numpy")
        return self._open[path].get_tensor(key)

    def full(self, key: str) -> Optional[np.ndarray]:
        """The whole (unsplit) tensor stored under `key`, or None if absent."""
        pieces = self.pieces.get(key)
        if not pieces:
            return None
        first = pieces[0][2]
        if first["axis"] is None:
            return self._read(pieces[0][0], key)
        if "flat" in first:  # ZeRO-3 / V2 slices of the flattened, padded parameter (or of its tp pieces)
            return self._full_from_flat(key, pieces)
        out = np.empty(first["global_shape"], dtype=np.float32)
        covered = 0
        for path, k, piece in pieces:
            part = self._read(path, k)
            index = [slice(None)] * out.ndim
            index[piece["axis"]] = slice(piece["offset"], piece["offset"] + part.shape[piece["axis"]])
            out[tuple(index)] = part
            covered += part.shape[piece["axis"]]
        if covered != out.shape[first["axis"]]:
            raise ValueError(f"{self.dir}: pieces of {key} cover {covered} of {out.shape[first['axis']]} rows along axis {first['axis']}")
        return out

    def _full_from_flat(self, key: str, pieces: list) -> np.ndarray:
        """The tensor under `key` from flat slices: of the whole parameter, or (V2 under tp, `flat.piece`) of each
        tp piece, every piece reassembled and placed along its split axis."""
        by_piece: dict = {}
        for path, k, piece in pieces:
            where = piece["flat"].get("piece")
            by_piece.setdefault(None if where is None else where["offset"], []).append((path, k, piece))
        first = pieces[0][2]
        out = np.empty(first["global_shape"], dtype=np.float32)
        rows = 0
        for parts in by_piece.values():
            info = parts[0][2]["flat"]
            flat = np.zeros(info["padded"], dtype=np.float32)
            seen = np.zeros(info["padded"], dtype=bool)
            for path, k, piece in parts:
                part = self._read(path, k).ravel()
                span = slice(piece["offset"], piece["offset"] + part.size)
                if seen[span].any():  # two writers of the same elements: pieces of different tensors
                    raise ValueError(f"{self.dir}: flat slices of {key} cover elements {span.start}.. twice")
                flat[span], seen[span] = part, True
            covered = int(seen[: info["numel"]].sum())
            if covered < info["numel"]:
                raise ValueError(f"{self.dir}: flat slices of {key} cover {covered} of {info['numel']} elements")
            where = info.get("piece")
            if where is None:
                return flat[: info["numel"]].reshape(first["global_shape"])
            index = [slice(None)] * out.ndim
            index[where["axis"]] = slice(where["offset"], where["offset"] + where["shape"][where["axis"]])
            out[tuple(index)] = flat[: info["numel"]].reshape(where["shape"])
            rows += where["shape"][where["axis"]]
        axis = first["flat"]["piece"]["axis"]
        if rows != out.shape[axis]:
            raise ValueError(f"{self.dir}: tp pieces of {key} cover {rows} of {out.shape[axis]} rows along axis {axis}")
        return out

    def close(self) -> None:
        self._open.clear()

    def model_state(self) -> dict:
        """{canonical name: lazily assembled full tensor} of every model tensor (for init_from)."""
        return {key[len("model/"):]: LazyFull(self, key) for key in self.keys("model/")}


class LazyFull:
    """A full tensor of a checkpoint, assembled only when numpy asks for it (one at a time)."""

    def __init__(self, index: ShardIndex, key: str):
        self.index, self.key = index, key
        self.shape = tuple(index.pieces[key][0][2]["global_shape"])

    def __array__(self, dtype=None, copy=None):
        arr = self.index.full(self.key)
        return arr if dtype is None else arr.astype(dtype, copy=False)
