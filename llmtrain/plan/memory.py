"""Per-rank memory of a layout, predicted from the config (the model is built lazily: nothing is allocated).

    python -m llmtrain.plan model=llama-7b data.seq_len=4096 plan.devices=64      # uses this module
    ranks = predict_ranks(model_cfg, layout, amp="bf16", device="gpu")         # one dict per rank coordinate
    distinct = predict_stage_ranks(model_cfg, layout, amp="bf16", device="gpu")  # {(pp_rank, sharding_rank): ...}

Two parts:

1. **Counted exactly** (`predict_ranks`): which parameters each rank holds and with what
   shape, and the optimizer state it keeps, following what Paddle 3.3.1 allocates for our
   models. The parity tests compare these numbers with `llmtrain/train/memory.py`'s
   measurement (memory.json) to the element and byte, for every CI layout.
   - parameters: the model's own parameter list (`param_specs`: the model built lazily, llmtrain/plan/params.py,
     names from `canonical_parameters`, split axes from the layers' own tags); tp splits the
     column/row/vocabulary tensors (Megatron's layout, fleet's
     `ColumnParallelLinear`/`RowParallelLinear`/`VocabParallelEmbedding`); pp gives stage s
     the chunks s, s + pp, ... of `layout.pp_layers` blocks each (llmtrain/parallel/pp_split.py),
     the embedding to the first chunk, the final norm and head to the
     last, and a second copy of a tied word table to the last stage (DualPipeV: stage s the chunks s and
     2·pp - 1 - s, so the head sits on stage 0 beside the embedding and a tied table is held once);
   - ZeRO-1 (fleet `DygraphShardingOptimizer._partition_parameters`): the stage's parameters
     sorted by element count, largest first (stable), each given to the sharding rank with
     the fewest elements so far; that rank alone keeps its optimizer state (ZeRO paper,
     Rajbhandari et al. 2020, P_os: 4 + K bytes per parameter -> ... + K/N_d);
   - ZeRO-2 (`GroupShardedOptimizerStage2._segment_params`): the same greedy rule in the
     optimizer's parameter order, unsorted;
   - ZeRO-3 (`GroupShardedStage3`): a parameter with more than `segment_size` elements, and
     not the tied table (kept whole, `exclude_layer`), is flattened, padded by the alignment
     rule `_param2align` (to a multiple of 4096 bytes on CPU, 256 on GPU) and then to a
     multiple of the sharding degree; rank r holds [r, r + 1) x padded / N of it, and its
     optimizer state covers that slice; smaller parameters stay whole with whole state;
   - Mixture-of-Experts: router, expert bias (no gradient, no optimizer state), stacked
     routed experts [E, ...] (E / ep per rank under expert parallelism, whole over tp) and
     shared experts (tp-split like a dense FFN); under ep > 1 the experts stay out of the dense ZeRO
     machinery at every stage (never sliced by ZeRO-3): with sharding and edp = dp x sharding / ep > 1
     each expert tensor's optimizer state is kept by one rank of its expert-data-parallel group
     (`expert_state_owners`, the rule of llmtrain/parallel/expert_states.py), its gradient freed on the others
     once reduced (held until then: `grad_transient_bytes`); otherwise every rank keeps its experts' states;
   - AdamW state per parameter of n elements: two fp32 moments (2n) and two fp32 [1] beta
     powers; under AMP O2 (bf16/fp16 parameters, Paddle's `multi_precision`) an fp32 master
     copy (n) as well. Paddle's O2 `decorate` keeps `nn.LayerNorm` parameters fp32.

2. **Estimated** elsewhere (`llmtrain/plan/estimate.py`): activations (Korthikanti et al. 2022, Table 2,
   written out for our blocks), in-flight micro-batches, logits/loss buffers and a stated margin. Gradient
   bytes here are exact without ZeRO-2/3 and an estimate under them (Paddle's own buffers; ZeRO-2: the
   backward's peak, `zero2_grad_bytes`).
"""
from __future__ import annotations

from llmtrain.plan.params import ParamSpec  # noqa: F401 (re-exported: the planner's parameter record)

import heapq
from dataclasses import dataclass
from math import prod

from llmtrain.parallel.overlap import FUSED
from llmtrain.parallel.pp_split import stage_blocks

TIED = "embed.word.weight"
DEVICE_ALIGN_BYTES = {"cpu": 4096, "gpu": 256}  # Paddle's group_sharded_stage3 `alignment`
ADAM_SLOTS = 2  # moment1, moment2 (fp32, the parameter's shape)
ADAM_POWS = 2  # beta1_pow, beta2_pow (fp32 [1])


def param_specs(cfg, lora=None) -> list[ParamSpec]:
    """Every parameter of the single-device model, in `canonical_parameters` order (a tied table once), read off
    the model built lazily with its own split tags (llmtrain/plan/params.py).

    `lora` (a `LoraConfig` with rank > 0): the adapters of the matching column/row linears follow their
    linear (A [in, r], split on axis 0 under a row-parallel base; B [r, out], split on axis 1 under a
    column-parallel one) and everything else is frozen."""
    from llmtrain.plan.params import model_param_specs

    return model_param_specs(cfg, lora)


def stage_params(specs: list[ParamSpec], layout, pp_rank: int, tied: bool) -> list[ParamSpec]:
    """The parameters pipeline stage `pp_rank` of `layout` holds: its chunks' blocks (`layout.pp_layers`), the
    embedding on the first stage, the final norm and head on the last (all of them when pp = 1)."""
    if layout.pp == 1:
        return list(specs)
    if not layout.pp_layers:
        raise ValueError(f"layout.pp_layers is empty under parallel.pp={layout.pp}: fill the split first "
                         "(llmtrain.plan.stage_cost.with_pipeline_split)")
    v_shape = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"  # the V: head and loss on stage 0, one table
    mine = set(stage_blocks(layout.pp_layers, layout.pp, pp_rank, v_shape))
    head_stage = 0 if v_shape else layout.pp - 1
    out = []
    for s in specs:
        if s.chunk == "first":
            keep = pp_rank == 0 or (tied and s.name == TIED and pp_rank == head_stage)
        elif s.chunk == "last":
            keep = pp_rank == head_stage
        else:
            keep = s.chunk in mine
        if keep:
            out.append(s)
    return out


def local_shape(s: ParamSpec, tp: int, ep: int = 1) -> tuple:
    if s.expert:
        return (s.shape[0] // ep, *s.shape[1:])
    if s.split_axis is None or tp == 1:
        return s.shape
    shape = list(s.shape)
    shape[s.split_axis] //= tp
    return tuple(shape)


def zero3_padded(numel: int, elem_bytes: int, sharding: int, device: str) -> int:
    """Paddle's `_param2align` then rounding up to a multiple of the sharding degree (group_sharded_stage3)."""
    align_bytes = DEVICE_ALIGN_BYTES[device]
    rem = (numel * elem_bytes) % align_bytes
    offset = numel + (0 if rem == 0 else (align_bytes - rem) // elem_bytes)
    return offset if offset % sharding == 0 else offset + sharding - offset % sharding


def greedy_partition(numels: list[int], n: int, sort: bool) -> list[list[int]]:
    """Indices of `numels` each of n ranks owns: each to the rank with the fewest elements so far
    (ties: the lowest rank), largest first when `sort` (ZeRO-1) or in the given order (ZeRO-2)."""
    order = sorted(range(len(numels)), key=lambda i: -numels[i]) if sort else range(len(numels))
    owned = [[] for _ in range(n)]
    heap = [(0, r) for r in range(n)]  # (elements so far, rank): the least first, then the lowest rank
    for i in order:
        size, r = heap[0]
        owned[r].append(i)
        heapq.heapreplace(heap, (size + numels[i], r))
    return owned


V2_ALIGN_BYTES = 256
"""fleet's tensor_fusion_helper `alignment` (gpu/npu/xpu, and the CPU stand-in): each parameter's region in a V2
bucket is padded to a multiple of this / element bytes x sharding degree elements."""


def v2_slice_lengths(numels: list[tuple[int, int]], n: int, bucket_bytes: int) -> list[list[int]]:
    """Stage-1 sharding V2 (`parallel.sharding_split_param`): for each of n ranks, the length of its slice of each
    parameter [(elements, bytes/elem)] (0: none), as DygraphShardingOptimizerV2 lays them out in Paddle 3.3.1:
    parameters in list order into buckets closed once they reach `bucket_bytes` (`assign_group_by_size`), each
    padded to a multiple of 256 / bytes x n elements, rank r owning the r-th contiguous 1/n of every bucket."""
    groups, cur, size = [], [], 0
    for i, (numel, b) in enumerate(numels):
        cur.append(i)
        size += numel * b
        if size >= bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    out = [[0] * len(numels) for _ in range(n)]
    for group in groups:
        index, spans = 0, []
        for i in group:
            numel, b = numels[i]
            unit = V2_ALIGN_BYTES // b * n
            padded = -(-numel // unit) * unit
            spans.append((i, index, padded))
            index += padded
        shard = index // n
        for r in range(n):
            lo, hi = r * shard, (r + 1) * shard
            for i, start, padded in spans:
                out[r][i] = max(0, min(start + padded, hi) - max(start, lo))
    return out


def _buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of `sizes` (bytes) in list order, in buckets closed once they reach `bucket_bytes` (fleet's
    `assign_group_by_size`)."""
    groups, cur, size = [], [], 0
    for i, b in enumerate(sizes):
        cur.append(i)
        size += b
        if size >= bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
    return groups + ([cur] if cur else [])


def v1_fused_sizes(params: list[tuple[ParamSpec, int, int]], tp: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Stage-1 V1 with tensor fusion (`parallel.sharding_tensor_fusion`): [(elements, bytes/elem)] of each fused
    parameter one rank's parameters [(spec, elements, bytes/elem)] (in its partition order) are laid into, as
    Paddle 3.3.1's `fused_parameters` does: split by fp32 or not, tp-distributed or not (clip: all clipped), then
    weight-decayed (2-D and up, `llmtrain.train.optim.decays`) or not, each part into buckets of `bucket_bytes`,
    each parameter padded to a multiple of 256 bytes. The optimizer keeps AdamW state per fused parameter."""
    out = []
    for fp32, dist in ((True, True), (True, False), (False, True), (False, False)):
        part = [(s, n, b) for s, n, b in params
                if (b == 4) == fp32 and (tp > 1 and s.split_axis is not None) == dist]
        for decay in (True, False):
            group = [(n, b) for s, n, b in part if (len(s.shape) >= 2) == decay]
            for bucket in _buckets([n * b for n, b in group], bucket_bytes):
                out.append((sum(-(-group[i][0] * group[i][1] // V2_ALIGN_BYTES) * V2_ALIGN_BYTES // group[i][1]
                                for i in bucket), group[bucket[0]][1]))
    return out


def _param_bytes(s: ParamSpec, amp: str) -> int:
    """Bytes per element of a parameter: fp32, or 2 under AMP O2 except LayerNorm's (kept fp32)."""
    return 4 if amp in ("none", None) or s.layernorm else 2


def _opt_elems(n: int, low_precision: bool, frozen: bool = False) -> int:
    """fp32 elements of AdamW state for n parameter elements (+ master weights under O2); none when frozen."""
    return 0 if frozen else ADAM_SLOTS * n + ADAM_POWS + (n if low_precision else 0)


def _stage_key(cfg, layout, pp_rank: int, amp: str, device: str, specs: list[ParamSpec],
               degrees: tuple | None = None) -> tuple:
    """What a stage's holdings depend on: the sequence of its blocks' kinds, whether it holds the ends, the degrees
    (`degrees`: `_degrees_key(layout)`, given when the caller asks for several stages of one layout)."""
    v_shape = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"  # DualPipeV: the head on stage 0
    blocks = tuple(stage_blocks(layout.pp_layers, layout.pp, pp_rank, v_shape)) if layout.pp > 1 else ()
    # a stage's holdings depend on the sequence of its blocks' kinds (dense or MoE: equal parameter shapes within a
    # kind), not on which blocks they are: splits that give stages the same kinds share one computation
    kinds = tuple(cfg.is_moe_layer(i) for i in blocks)
    return (id(specs), kinds, pp_rank == 0, pp_rank == (0 if v_shape else layout.pp - 1), amp, device,
            *(_degrees_key(layout) if degrees is None else degrees), layout.pp == 1)


def _degrees_key(layout) -> tuple:
    """The layout fields besides the pipeline's that a stage's holdings depend on, as text."""
    return tuple(repr(getattr(layout, k, None)) for k in _LAYOUT_KEYS if k not in ("pp", "pp_layers", "virtual_pp",
                                                                                   "pp_schedule"))


def _stage_ranks(cfg, layout, pp_rank: int, amp: str, device: str, specs: list[ParamSpec]) -> list[dict]:
    """Predicted holdings of the ranks of pipeline stage `pp_rank`: one entry per sharding rank 0..sharding-1 (every
    dp/tp rank alike), or, when the routed experts' states are sharded over the expert-data-parallel group (ep > 1,
    sharding > 1, edp > 1: `Layout.state_sharding(expert=True)`), one per data index dp_rank x sharding +
    sharding_rank (the dp rank then decides which experts' states a rank keeps). Entry i of a list of n serves data
    index d when d % n == i."""
    key = _stage_key(cfg, layout, pp_rank, amp, device, specs)
    hit = _STAGES.get(key)
    if hit is None or hit[0] is not specs:  # else a stage of the same blocks and degrees in another split
        hit = _STAGES[key] = (specs, _stage_ranks_of(cfg, layout, pp_rank, amp, device, specs))  # the list kept alive
    return hit[1]


_STAGES: dict = {}


def held_bytes(r: dict) -> int:
    """Bytes of one holdings entry that stay on the device all step: parameters, gradients (transient expert ones
    included) and optimizer states."""
    return r["param_bytes"] + r["grad_bytes"] + r.get("grad_transient_bytes", 0) + r["optimizer_bytes"]


def stage_worst_holdings(cfg, layout, amp: str = "none", device: str = "cpu") -> list[dict]:
    """`stage_worst_holding` of every pipeline stage of `layout`."""
    degrees = _degrees_key(layout)
    return [stage_worst_holding(cfg, layout, st, amp, device, degrees) for st in range(layout.pp)]


def stage_worst_holding(cfg, layout, pp_rank: int, amp: str = "none", device: str = "cpu",
                        degrees: tuple | None = None) -> dict:
    """`max(stage_holdings(...), key=held_bytes)`: the first entry of the most bytes, the cached entry itself (to be
    read, not changed), remembered per stage kinds and degrees as `stage_holdings`; where the list would hold one
    entry per data index (sharded expert states) the worst one is found without building the others."""
    specs = _spec_list(cfg, None)
    key = _stage_key(cfg, layout, pp_rank, amp, device, specs, degrees)
    hit = _WORST_STAGE.get(key)
    if hit is not None and hit[0] is specs:
        return hit[1]
    listed = _STAGES.get(key)
    if listed is not None and listed[0] is specs:
        worst = max(listed[1], key=held_bytes)
    else:
        parts, experts = _stage_parts(cfg, layout, pp_rank, amp, device, specs)
        if experts is None:
            worst = max(parts, key=held_bytes)
        else:  # entry d: parts[d % len(parts)] plus the experts' share of edp index (d // ep) % len(sums)
            e_numel, e_bytes, sums, n, ep, zero23, e_grad = experts
            base = [r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in parts]
            # held_bytes(entry d) = base + e_bytes + the same gradient bytes for every d + 4 opt: integers,
            # so the first d of the largest sum is max()'s choice
            top, at = None, 0
            for d in range(n):
                h = base[d % len(parts)] + 4 * sums[(d // ep) % len(sums)][1]
                if top is None or h > top:
                    top, at = h, d
            worst = _expert_entry(parts[at % len(parts)], e_numel, e_bytes, sums[(at // ep) % len(sums)], zero23,
                                  e_grad)
    _WORST_STAGE[key] = (specs, worst)  # the spec list kept alive with its id
    return worst


_WORST_STAGE: dict = {}


def stage_holdings(cfg, layout, pp_rank: int, amp: str = "none", device: str = "cpu") -> list[dict]:
    """The holdings `predict_stage_ranks` lists for pipeline stage `pp_rank` (no LoRA), in sharding-rank or data-index
    order: the cached entries themselves, to be read, not changed (the planner's fast path)."""
    return _stage_ranks(cfg, layout, pp_rank, amp, device, _spec_list(cfg, None))


def _spec_list(cfg, lora) -> list[ParamSpec]:
    """`param_specs(cfg, lora)`, one list per distinct model (the stage caches are keyed by its id)."""
    hit = _SPEC_BY_ID.get(id(cfg))
    if hit is not None and hit[0] is cfg and lora is None:
        return hit[1]
    key = (repr(cfg), repr(lora))
    if key not in _SPEC_LISTS:
        _SPEC_LISTS[key] = param_specs(cfg, lora)
    if lora is None:
        _SPEC_BY_ID[id(cfg)] = (cfg, _SPEC_LISTS[key])  # the model kept alive with its id
    return _SPEC_LISTS[key]


_SPEC_BY_ID: dict = {}


def _local_entries(specs: list[ParamSpec], tp: int, ep: int, amp: str) -> tuple[list, dict]:
    """([(spec, elements on a rank of tp/ep, bytes per element)] for every spec, {chunk: [spec indices]}), cached
    per spec list and degrees."""
    key = (id(specs), tp, ep, amp)
    hit = _LOCAL.get(key)
    if hit is None or hit[0] is not specs:
        chunks: dict = {}
        for i, x in enumerate(specs):
            chunks.setdefault(x.chunk, []).append(i)
        hit = _LOCAL[key] = (specs, ([(x, prod(local_shape(x, tp, ep)), _param_bytes(x, amp)) for x in specs],
                                     chunks))
    return hit[1]


_LOCAL: dict = {}


def _stage_indices(specs: list[ParamSpec], chunks: dict, layout, pp_rank: int, tied: bool) -> list[int]:
    """The indices into `specs` of the parameters `stage_params` gives stage `pp_rank`, in `specs` order."""
    if layout.pp == 1:
        return list(range(len(specs)))
    if not layout.pp_layers:
        stage_params(specs, layout, pp_rank, tied)  # its error
    v_shape = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    head_stage = 0 if v_shape else layout.pp - 1
    out = [i for i in chunks.get("first", ()) if pp_rank == 0 or (tied and specs[i].name == TIED and
                                                                    pp_rank == head_stage)]
    if pp_rank == head_stage:
        out += chunks.get("last", ())
    for b in stage_blocks(layout.pp_layers, layout.pp, pp_rank, v_shape):
        out += chunks.get(b, ())
    out.sort()
    return out


def _stage_parts(cfg, layout, pp_rank: int, amp: str, device: str, specs: list[ParamSpec]) -> tuple:
    """(the dense holdings per sharding rank, None without routed experts here, else (their elements, their bytes,
    [(bytes, optimizer elements) of the experts each edp index keeps states of], entries, ep, ZeRO-2/3)): what
    `_stage_ranks_of` lists."""
    tp, sh, stage = layout.tp, layout.sharding, layout.sharding_stage if layout.sharding > 1 else 1
    ep = getattr(layout, "ep", 1)
    data = getattr(layout, "dp", 1) * sh
    local = None

    def stage_local() -> list:  # [(spec, elements on a rank, bytes per element)] of the stage's parameters
        entries, chunks = _local_entries(specs, tp, ep, amp)
        return [entries[i] for i in _stage_indices(specs, chunks, layout, pp_rank, cfg.tie_embeddings)]

    # the dense holdings depend on the stage's block kinds and the ZeRO settings, not on dp, ep (> 1) or the split
    v_shape = getattr(layout, "pp_schedule", "1f1b") == "dualpipev"
    blocks = tuple(stage_blocks(layout.pp_layers, layout.pp, pp_rank, v_shape)) if layout.pp > 1 else ()
    ends = (pp_rank == 0, pp_rank == (0 if v_shape else layout.pp - 1), layout.pp == 1)
    key = (id(specs), tuple(cfg.is_moe_layer(i) for i in blocks), *ends, tp, ep > 1, amp, sh, stage, device,
           cfg.tie_embeddings, *(repr(getattr(layout, k, None)) for k in _DENSE_KEYS))
    hit = _DENSE.get(key)
    if hit is None or hit[0] is not specs:
        local = stage_local()
        # under ep > 1 the routed experts stay out of the dense ZeRO machinery (llmtrain/parallel/expert_states.py)
        dense = [x for x in local if not x[0].expert] if ep > 1 else local
        hit = _DENSE[key] = (specs, _dense_ranks(cfg, layout, dense, stage, device))
    parts = hit[1]
    if ep == 1:
        return parts, None
    edp = data // ep
    v2 = stage == 1 and sh > 1 and getattr(layout, "sharding_split_param", False)
    owners = sh > 1 and edp > 1  # each expert tensor's state on one rank of its edp group
    # the routed experts' part depends on the stage's blocks (their names order the owners' ties), tp, ep, the
    # precision and how their states are split (edp, V2's buckets), not on how dp x sharding makes edp
    ekey = (id(specs), blocks, *ends, tp, ep, amp, cfg.tie_embeddings, edp if v2 or owners else 1, v2,
            getattr(layout, "sharding_comm_buffer_mb", 256) if v2 else None)
    ehit = _EXPERTS.get(ekey)
    if ehit is None or ehit[0] is not specs:
        experts = [x for x in (local if local is not None else stage_local()) if x[0].expert]
        ehit = _EXPERTS[ekey] = (specs, _expert_sums(layout, experts, edp, v2, owners))  # the list kept alive
    if ehit[1] is None:
        return parts, None
    e_numel, e_bytes, sums = ehit[1]
    if v2:  # V2: the experts' own buckets
        return parts, (e_numel, e_bytes, sums, data, ep, False, 4 * e_numel)
    return parts, (e_numel, e_bytes, sums, data if len(sums) > 1 else len(parts), ep, stage in (2, 3) and sh > 1,
                   None)


_EXPERTS: dict = {}


def _expert_sums(layout, experts: list, edp: int, v2: bool, owners: bool) -> tuple | None:
    """(elements, bytes, [(bytes, optimizer elements) of the experts each edp index keeps states of]) of a stage's
    routed experts [(spec, elements on a rank, bytes per element)] (None: none here); `v2`: stage-1 V2's slices
    (`_v2_expert_sums`); `owners`: each tensor's state on one rank of its edp group (`expert_state_owners`), else
    every rank keeps its experts' states."""
    if not experts:
        return None
    e_numel = sum(n for _, n, _ in experts)
    e_bytes = sum(n * b for _, n, b in experts)
    if v2:
        return e_numel, e_bytes, _v2_expert_sums(layout, experts, edp)
    if owners:
        owner = expert_state_owners([(s.name, n) for s, n, _ in experts], edp)
        per = [[] for _ in range(edp)]
        for x in experts:
            per[owner[x[0].name]].append(x)
    else:
        per = [experts]
    # per edp index: (bytes of the experts whose states it keeps, their optimizer elements)
    return e_numel, e_bytes, [(sum(n * b for _, n, b in mine), sum(_opt_elems(n, b == 2) for _, n, b in mine))
                              for mine in per]


def _expert_entry(base: dict, e_numel: int, e_bytes: int, mine: tuple, zero23: bool, e_grad=None) -> dict:
    """A data index's holdings: the dense `base` plus the rank's routed experts (`e_numel` elements, `e_bytes`),
    `mine` = (bytes, optimizer elements) of the experts whose states it keeps; `zero23`: ZeRO-2/3 over sharding;
    `e_grad`: the experts' gradient bytes when every rank keeps them all (V2's fp32 main gradients), else None."""
    kept, opt = mine
    grad = e_grad if e_grad is not None else e_bytes if zero23 else kept
    return {"param_numel": base["param_numel"] + e_numel, "param_bytes": base["param_bytes"] + e_bytes,
            "optimizer_numel": base["optimizer_numel"] + opt,
            "optimizer_bytes": base["optimizer_bytes"] + 4 * opt,
            "grad_bytes": base["grad_bytes"] + grad,
            # the other experts' gradients, held from the backward until they are reduced to their owners
            "grad_transient_bytes": e_bytes - kept if not zero23 and e_grad is None else 0}


def _stage_ranks_of(cfg, layout, pp_rank: int, amp: str, device: str, specs: list[ParamSpec]) -> list[dict]:
    """`_stage_ranks`, computed."""
    parts, experts = _stage_parts(cfg, layout, pp_rank, amp, device, specs)
    if experts is None:
        return parts
    e_numel, e_bytes, sums, n, ep, zero23, e_grad = experts
    return [_expert_entry(parts[d % len(parts)], e_numel, e_bytes, sums[(d // ep) % len(sums)], zero23, e_grad)
            for d in range(n)]


def _v2_expert_sums(layout, experts: list, edp: int) -> list[tuple]:
    """Stage-1 V2 under ep > 1: per edp index, (0, optimizer elements) of its slices of the routed experts, which V2
    lays into buckets of their own over the edp group (`llmtrain.parallel.expert_states.color_experts`): edp index i
    keeps the i-th 1/edp of each expert bucket's padded state; every rank holds its experts' values and fp32 main
    gradients whole (`_expert_entry`'s `e_grad`)."""
    bucket = getattr(layout, "sharding_comm_buffer_mb", 256) * 2**20
    lengths = v2_slice_lengths([(n, b) for _, n, b in experts], edp, bucket)
    return [(0, sum(_opt_elems(k, experts[i][2] == 2) for i, k in enumerate(mine) if k > 0)) for mine in lengths]


_DENSE: dict = {}
_DENSE_KEYS = ("zero3_segment_size", "sharding_split_param", "sharding_tensor_fusion", "sharding_comm_buffer_mb",
               "zero2_buffer_size", *FUSED)
"""The layout fields `_dense_ranks` reads besides the degrees (the fused-buffer knobs: `needs_main_grad`)."""


def expert_state_owners(named: list[tuple[str, int]], degree: int) -> dict:
    """{name: index in its edp group of the rank keeping the expert tensor's optimizer state}: largest first (ties
    by name), each to the least-loaded index (ties: the lowest), as `llmtrain.parallel.expert_states.state_owners`."""
    load, owner = [0] * degree, {}
    for name, n in sorted(named, key=lambda pair: (-pair[1], pair[0])):
        k = load.index(min(load))
        owner[name] = k
        load[k] += n
    return owner


def _dense_ranks(cfg, layout, local: list, stage: int, device: str) -> list[dict]:
    """Holdings of sharding ranks 0..sharding-1 from the parameters the dense ZeRO machinery handles (`local`:
    [(spec, elements here, bytes per element)])."""
    sh = layout.sharding
    if stage == 3:  # every sharding rank holds an equal slice of each sliced parameter
        p_numel = p_bytes = o_numel = g_bytes = 0
        for s, n, b in local:
            if n > layout.zero3_segment_size and not (cfg.tie_embeddings and s.name == TIED):
                n = zero3_padded(n, b, sh, device) // sh  # this rank's flat slice
            p_numel += n
            p_bytes += n * b
            o_numel += _opt_elems(n, b == 2, s.frozen or not s.trainable)
            g_bytes += n * b if s.trainable else 0
        # gradients: an estimate (Paddle's own ZeRO-3 buffers are measured, not predicted): the trained slices' share
        one = {"param_numel": p_numel, "param_bytes": p_bytes, "optimizer_numel": o_numel,
               "optimizer_bytes": 4 * o_numel, "grad_bytes": g_bytes, "grad_transient_bytes": 0}
        return [dict(one) for _ in range(sh)]
    p_numel = sum(n for _, n, _ in local)
    p_bytes = sum(n * b for _, n, b in local)
    trained = [x for x in local if x[0].trainable]  # what the optimizer holds (LoRA: the adapters only)
    # a frozen parameter (the MoE expert bias) has no gradient, except under fleet's sharding optimizer, whose
    # fused gradient buffers cover every parameter of its list (measured: moe-tiny sharding2); not when the
    # pipeline's sharding overlap reduces in its own buckets instead, which take trainable parameters only
    zeros = sh > 1 and not getattr(layout, "pp_sharding_comm_overlap", False)
    g_bytes = sum(n * b for s, n, b in trained if zeros or not s.frozen)
    from llmtrain.parallel.overlap import needs_main_grad

    if needs_main_grad(layout):  # fp32 main gradients in place of the parameters' dtype (llmtrain/train/main_grad.py)
        g_bytes = sum(n * 4 for s, n, b in trained if zeros or not s.frozen)
    if stage == 1 and sh > 1 and getattr(layout, "sharding_split_param", False):  # V2: a slice of each
        trained = [x for x in trained if not x[0].frozen]  # frozen ones (MoE expert bias) are kept out of V2's list
        lengths = v2_slice_lengths([(n, b) for _, n, b in trained], sh, getattr(layout, "sharding_comm_buffer_mb", 256) * 2**20)
        g_main = sum(n * 4 for _, n, _ in trained)  # fp32 main gradients (main-gradient training)
        out = []
        for rank in range(sh):
            o_numel = sum(_opt_elems(k, trained[i][2] == 2, trained[i][0].frozen)
                          for i, k in enumerate(lengths[rank]) if k > 0)
            out.append({"param_numel": p_numel, "param_bytes": p_bytes, "optimizer_numel": o_numel,
                        "optimizer_bytes": 4 * o_numel, "grad_bytes": g_main, "grad_transient_bytes": 0})
        return out
    if stage == 1 and sh > 1 and getattr(layout, "sharding_tensor_fusion", False):  # V1 fused: state per fused param
        bucket = getattr(layout, "sharding_comm_buffer_mb", 256) * 2**20
        out = []
        for owned in greedy_partition([n for _, n, _ in trained], sh, sort=True):
            o_numel = sum(_opt_elems(f, b == 2) for f, b in v1_fused_sizes([trained[i] for i in owned], layout.tp, bucket))
            out.append({"param_numel": p_numel, "param_bytes": p_bytes, "optimizer_numel": o_numel,
                        "optimizer_bytes": 4 * o_numel, "grad_bytes": g_bytes, "grad_transient_bytes": 0})
        return out
    if stage in (1, 2) and sh > 1:
        owners = greedy_partition([n for _, n, _ in trained], sh, sort=stage == 1)
    else:
        owners = [list(range(len(trained)))]
    if stage == 2 and sh > 1:  # an estimate of the backward's peak (`zero2_grad_bytes`)
        grads = zero2_grad_bytes_all([(n, b) for _, n, b in trained], owners,
                                     getattr(layout, "zero2_buffer_size", ZERO2_BUFFER))
    else:
        grads = [g_bytes] * len(owners)
    opt = [_opt_elems(n, b == 2, x.frozen) for x, n, b in trained]  # each tensor's optimizer elements
    out = []
    for rank, owned in enumerate(owners):
        o_numel = sum(map(opt.__getitem__, owned))
        out.append({"param_numel": p_numel, "param_bytes": p_bytes, "optimizer_numel": o_numel,
                    "optimizer_bytes": 4 * o_numel, "grad_bytes": grads[rank], "grad_transient_bytes": 0})
    return out


ZERO2_BUFFER = 2**23
"""`GroupShardedStage2`'s default `buffer_max_size`: elements of one gradient storage (Paddle 3.3.1)."""


def zero2_grad_bytes(trained: list[tuple[int, int]], owners: list[list[int]], rank: int,
                     buffer_size: int = ZERO2_BUFFER) -> int:
    """Gradient bytes sharding rank `rank` holds at the start of a backward under ZeRO-2 (an estimate).

    `trained`: (elements, bytes per element) of the stage's trained parameters in optimizer order; `owners`: the
    indices each sharding rank owns. Paddle's `GroupShardedStage2` (group_sharded_stage2.py) keeps, per dtype
    and per owning rank, one gradient storage of min(largest rank's elements, `buffer_size`) elements
    (`parallel.zero2_buffer_size`, Paddle's `buffer_max_size`, default 2**23), rebuilt by every
    forward, holding that rank's parameters in order while they fit (alignment padding ignored); a parameter
    that does not fit has its own gradient, reduced to its owner as soon as it is produced and freed on the
    other ranks, so only the owned ones persist across the accumulated micro-batches; the first gradient of the
    backward (the largest other one is counted) is in flight beside them. Measured after a step on 2 CPU
    processes, where every tiny parameter fits a storage: 0.76-0.99 of the parameter bytes (gpt-tiny 606,208 of
    609,536, llama-tiny 724,992 of 952,448: the other rank's storage is cleared by then); for Llama-7B under tp2
    about the owned quarter."""
    return zero2_grad_bytes_all(trained, owners, buffer_size)[rank]


def zero2_grad_bytes_all(trained: list[tuple[int, int]], owners: list[list[int]],
                         buffer_size: int = ZERO2_BUFFER) -> list[int]:
    """`zero2_grad_bytes` of every sharding rank, in one pass over the parameters."""
    totals = [0] * len(owners)
    for width in {b for _, b in trained}:
        sizes = [sum(trained[i][0] for i in owned if trained[i][1] == width) for owned in owners]
        cap = min(max(sizes), buffer_size)
        storages, own, largest = 0, [0] * len(owners), [0] * len(owners)
        for r, owned in enumerate(owners):
            fill, has = 0, False
            for i in owned:
                n, b = trained[i]
                if b != width:
                    continue
                has = True
                if fill + n <= cap:
                    fill += n
                else:  # its own gradient: kept by its owner, in flight on the others
                    own[r] += n * b
                    largest[r] = max(largest[r], n * b)
            storages += cap * width if has else 0
        top = sorted(range(len(owners)), key=lambda r: -largest[r])[:2]
        for r in range(len(owners)):
            other = max((largest[q] for q in top if q != r), default=0)
            totals[r] += storages + own[r] + other
    return totals


def predict_stage_ranks(cfg, layout, amp: str = "none", device: str = "cpu", lora=None) -> dict:
    """{(pp_rank, i): predicted holdings}: the distinct ranks, i the sharding rank (dp and tp ranks hold the same
    amounts), or the data index dp_rank x sharding + sharding_rank when the experts' states are sharded over edp
    (`_stage_ranks`). `lora`: LoRA adapters (`param_specs`); under ZeRO-3 the frozen base is sliced by the same
    size rule, stateless. Cached per (model, degrees, split, precision, device)."""
    key = (repr(cfg), repr(lora), amp, device, *(repr(getattr(layout, k, None)) for k in _LAYOUT_KEYS))
    hit = _PREDICTED.get(key)
    if hit is None:
        specs = _spec_list(cfg, lora)  # one list per model: `_stage_ranks`' key
        hit = _PREDICTED[key] = {(pp, r): dict(entry) for pp in range(layout.pp)
                                 for r, entry in enumerate(_stage_ranks(cfg, layout, pp, amp, device, specs))}
    return {k: dict(v) for k, v in hit.items()}


_PREDICTED: dict = {}
_SPEC_LISTS: dict = {}
_LAYOUT_KEYS = ("dp", "tp", "pp", "sharding", "sharding_stage", "virtual_pp", "pp_layers", "pp_schedule",
                "zero3_segment_size", "zero2_buffer_size", "ep", "sharding_split_param", "sharding_comm_buffer_mb",
                "sharding_tensor_fusion", "sharding_comm_overlap", "dp_comm_overlap", "pp_sharding_comm_overlap")
"""The layout fields the holdings depend on (`predict_stage_ranks`' cache key)."""


def predict_ranks(cfg, layout, amp: str = "none", device: str = "cpu", lora=None) -> list[dict]:
    """Predicted `param_numel`, `param_bytes`, `optimizer_numel`, `optimizer_bytes`, `grad_bytes` of every
    (dp, tp, pp, sharding) coordinate, with the coordinates, in that nesting order.

    `layout`: anything with dp, tp, pp, sharding, sharding_stage, virtual_pp, zero3_segment_size (and ep)."""
    distinct = predict_stage_ranks(cfg, layout, amp, device, lora)
    count = {p: sum(1 for q, _ in distinct if q == p) for p in range(layout.pp)}
    return [{"dp_rank": d, "tp_rank": t, "pp_rank": p, "sharding_rank": r,
             **distinct[(p, (d * layout.sharding + r) % count[p])]}
            for d in range(layout.dp) for t in range(layout.tp) for p in range(layout.pp) for r in range(layout.sharding)]


def predicted_report(cfg, layout, amp: str, device: str, lora=None) -> dict:
    """The "predicted" slot of memory.json: the same per-rank keys as the measured entries."""
    return {"source": "llmtrain.plan.memory.predict_ranks", "amp": amp, "device": device,
            "ranks": predict_ranks(cfg, layout, amp, device, lora)}
