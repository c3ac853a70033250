"""What each rank really holds: parameters, optimizer state and gradients, measured on the built objects.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py +parallel=tp2   # -> <run.dir>/memory.json

    report = measure_rank(built, topo)                      # this rank's measured entry (a dict)
    write_memory_report(cfg.run.dir, built, topo, layout, model_numel)   # every rank, after the first step

Called once, after the first optimizer step of a run (Paddle creates the optimizer's
accumulators lazily, in the first step). Every rank measures its own objects; the entries
are gathered with `all_gather_object` (a few kB each, no file I/O before or inside the
collective), rank 0 writes `<run.dir>/memory.json` and logs one line:

    {"format": "llmtrain-memory-1", "step": <first step of the run>,
     "layout": {dp, tp, pp, sharding, sharding_stage, virtual_pp, cp, ep, pp_layers},
     "model_numel": <parameters of the whole model, a tied table once>,
     "ranks": [{"rank", "dp_rank", "tp_rank", "pp_rank", "sharding_rank", "cp_rank", "ep_rank",
                "groups": {kind: [global ranks of this rank's group]} for dp, pp, sharding, cp, tp, data, ep, edp,
                "blocks": [transformer block indices whose parameters it holds],
                "params": {canonical name: {"shape", "numel", "bytes"[, "zero3"]}},
                "param_numel", "param_bytes",
                "optimizer_numel", "optimizer_bytes", "optimizer_params": {canonical name: numel},
                "grad_bytes"[, "context"]}, ...],
     "predicted": {"source", "amp", "device", "ranks": [{"dp_rank", "tp_rank", "pp_rank", "sharding_rank",
                    "param_numel", "param_bytes", "optimizer_numel", "optimizer_bytes", "grad_bytes"}, ...]}}

All values under "ranks" are measured. "predicted" is `llmtrain.plan.memory.predicted_report`,
computed from the config alone (same keys, so measured and predicted compare field by field;
parameters and optimizer state are exact, gradients under ZeRO-2/3 an estimate).

What counts (all local to the rank):
- params: the tensor holding each parameter's values on this rank, by canonical name (under
  LoRA the frozen base too: "frozen_numel" counts it, "optimizer_params" shows it has no state). A
  tp-split parameter is its slice ([in, out/tp] for a column linear, [V/tp, h] for the
  word table); under ZeRO-3 a sliced parameter is its flat slice `param.fw_storage`
  [end - start] of the flattened parameter padded to `padded` elements
  ("zero3": {"start", "end", "padded", "full_shape"}); should the full tensor also be
  alive outside a forward, its elements are added (and "zero3"."full_held" is true).
- optimizer: every accumulator (moments, beta powers) and master weight of the Paddle
  optimizer at the bottom of fleet's / Paddle's wrappers; under ZeRO-1/2 that optimizer
  only holds this rank's share, under ZeRO-3 the slices' state plus the unsliced
  parameters' whole state. "optimizer_params" says which parameters the state belongs to.
- fused_state (stage-1 V1 with `sharding_tensor_fusion`): {fused parameter name: {"numel", "params": [canonical
  names laid in it]}} of this rank's fused parameters, whose names key its "optimizer_params"
  (`llmtrain.paddle_compat.sharding_fused`).
- context (cp > 1): what the context-parallel plan gave this rank (`llmtrain.parallel.context.ContextStats`): its
  chunks, their sequence index and position ranges, the positions per row, the attention score elements it
  computed and the key/value bytes it sent in the first step.
- activation_bytes: what one micro-batch's forward left allocated until its backward (activations and logits;
  `StepRunner.activation_bytes`: the last micro-batch of the first step; null under pp), beside the planner's
  "predicted_activation_bytes" for the busiest rank. Under context parallelism about 1/cp of one process's.
- offload (`train.offload_optimizer`): {"optimizer_host_bytes": optimizer state this rank moved to host memory after
  the last step (all of "optimizer_bytes"), "optimizer_places": {place: bytes} where the state is now,
  "round_trips"} (`llmtrain.paddle_compat.offload.OptimizerOffload.report`).
- grads: distinct memory of allocated gradient tensors (parameter grads, ZeRO-3 slice
  grads, and Paddle's ZeRO gradient storages), overlapping views counted once.
"""
from __future__ import annotations

import json
import os

from llmtrain.paddle_compat.optim import is_allocated, optimizer_state_tensors
from llmtrain.paddle_compat.sharding_fused import fused_spans
from llmtrain.paddle_compat.zero import stage3_storage, zero_grad_buffers
from llmtrain.utils.log import log0

FORMAT = "llmtrain-memory-1"


def _numel(t) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n


def _alive(t) -> bool:
    return is_allocated(t)


def _span(t):
    """(first byte address, end address) of a tensor's elements."""
    start = int(t.data_ptr())
    return start, start + _numel(t) * t.element_size()


def _union_bytes(spans) -> int:
    """Bytes covered by a set of [start, end) address ranges (views of one buffer counted once)."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _optimizer_state(optimizer, var_to_name: dict) -> tuple[int, int, dict]:
    """(elements, bytes, {canonical name: elements}) of the optimizer state this rank holds."""
    numel = nbytes = 0
    per_param: dict = {}
    seen = set()

    def add(var_name, t):
        nonlocal numel, nbytes
        if not _alive(t) or id(t) in seen:
            return
        seen.add(id(t))
        n = _numel(t)
        numel += n
        nbytes += n * t.element_size()
        key = var_to_name.get(var_name, var_name)
        per_param[key] = per_param.get(key, 0) + n

    for var_name, t in optimizer_state_tensors(optimizer):
        add(var_name, t)
    return numel, nbytes, per_param


def _grad_spans(built, sliced: dict) -> list:
    spans = []
    for _, param in built.named_params:
        holder = stage3_storage(param) if param.name in sliced else param
        for g in (getattr(holder, "grad", None), getattr(holder, "main_grad", None)):
            if _alive(g):
                spans.append(_span(g))
    for buf in zero_grad_buffers(built.model):
        if _alive(buf):
            spans.append(_span(buf))
    return spans


def measure_rank(built, topo) -> dict:
    """This rank's measured entry of memory.json (see the module docstring)."""
    from llmtrain.paddle_compat.zero import stage3_slices

    sliced = stage3_slices(built.model)
    params, var_to_name = {}, {}
    for name, param in list(built.named_params) + list(getattr(built, "frozen_params", [])):
        var_to_name[param.name] = name
        if param.name in sliced:
            start, end, padded = sliced[param.name]
            store = stage3_storage(param)
            var_to_name[store.name] = name
            numel = _numel(store)
            nbytes = numel * store.element_size()
            full_held = _alive(param)
            if full_held:
                numel += _numel(param)
                nbytes += _numel(param) * param.element_size()
            params[name] = {"shape": [int(d) for d in store.shape], "numel": numel, "bytes": nbytes,
                            "zero3": {"start": int(start), "end": int(end), "padded": int(padded),
                                      "full_shape": [int(d) for d in param.shape], "full_held": full_held}}
        else:
            numel = _numel(param) if _alive(param) else 0
            params[name] = {"shape": [int(d) for d in param.shape], "numel": numel,
                            "bytes": numel * param.element_size()}
    opt_numel, opt_bytes, opt_params = _optimizer_state(built.optimizer, var_to_name)
    fused = {f: {"numel": numel, "params": [var_to_name[p] for p, _, _ in members]}
             for f, (numel, members) in fused_spans(built.optimizer).items()}
    grad_spans = _grad_spans(built, sliced)
    grad_bytes = _union_bytes(grad_spans)
    return {
        "rank": topo.rank, "dp_rank": topo.dp_rank, "tp_rank": topo.tp_rank, "pp_rank": topo.pp_rank,
        "sharding_rank": topo.sharding_rank, "cp_rank": topo.cp_rank, "ep_rank": topo.ep_rank,
        "groups": topo.members(),
        "blocks": sorted({int(n.split(".")[1]) for n in params if n.startswith("layers.")}),
        "params": params,
        "param_numel": sum(p["numel"] for p in params.values()),
        "param_bytes": sum(p["bytes"] for p in params.values()),
        "frozen_numel": sum(params[n]["numel"] for n, _ in getattr(built, "frozen_params", [])),
        "optimizer_numel": opt_numel, "optimizer_bytes": opt_bytes, "optimizer_params": opt_params,
        "grad_bytes": grad_bytes,
        **({"fused_state": fused} if fused else {}),
        **({"context": built.report()} if getattr(built, "report", None) is not None else {}),
        **({"offload": built.offload.report()} if getattr(built, "offload", None) is not None else {}),
    }


def predicted_activation_bytes(cfg, layout, amp: str, on_cpu: bool):
    """The planner's bytes held for the backward of one micro-batch on its busiest rank after its forward
    (activations without a fully recomputed block's re-run inside the backward, plus the logits on the last stage: `llmtrain.plan.estimate.memory_estimate` with one micro-batch in flight), or None
    under pp (several micro-batches in flight, which the measurement does not cover)."""
    import dataclasses

    from llmtrain.plan.estimate import memory_estimate

    if layout.pp > 1:
        return None
    one = dataclasses.replace(layout, grad_accum=1)
    from llmtrain.models.recompute import recompute_of

    rc = recompute_of(cfg.train, cfg.model.num_layers, layout.pp_layers)
    est = memory_estimate(cfg.model, one, cfg.data.seq_len, rc, amp, "cpu" if on_cpu else "gpu",
                          4 if amp == "none" else 2, not on_cpu, 0.0, fp8=cfg.train.fp8 != "none",
                          fp8_cached_copies=_fp8_cached_copies(cfg.train, on_cpu))
    return int(est["activations"] - est.get("recompute_transient", 0) + est["other"])  # held after the forward


def write_memory_report(run_dir: str, built, topo, layout, model_numel: int, step: int,
                        predicted: dict | None = None, activations: tuple = (None, None)) -> dict:
    """Gather every rank's entry; rank 0 writes <run_dir>/memory.json (with `predicted`, the planner's figures)
    and logs one line. `activations`: (this rank's measured bytes held for the first micro-batch's backward, the
    planner's figure for them). Returns the report."""
    mine = measure_rank(built, topo)
    mine["activation_bytes"] = activations[0]
    if topo.world > 1:
        import paddle.distributed as dist

        entries: list = []
        dist.all_gather_object(entries, mine)  # small pickles over the global group; no I/O before this
    else:
        entries = [mine]
    entries = sorted(entries, key=lambda e: e["rank"])
    report = {
        "format": FORMAT,
        "step": step,
        "layout": {**{k: getattr(layout, k) for k in ("dp", "tp", "pp", "sharding", "sharding_stage", "virtual_pp", "cp",
                                                      "ep")}, "pp_layers": list(layout.pp_layers)},
        "model_numel": int(model_numel),
        "ranks": entries,
        "predicted": predicted,
        "predicted_activation_bytes": activations[1],
    }
    if topo.rank == 0:
        path = os.path.join(run_dir, "memory.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
        log0(
            f"held per rank after step {step} (parameters, then MB of parameters/optimizer state/gradients): "
            + " | ".join(f"rank {e['rank']}: {e['param_numel'] / 1e6:.3f}M, {e['param_bytes'] / 1e6:.2f}/"
                         f"{e['optimizer_bytes'] / 1e6:.2f}/{e['grad_bytes'] / 1e6:.2f}" for e in entries)
            + f"; model {model_numel / 1e6:.3f}M parameters; details in {path}"
        )
    return report


def _fp8_cached_copies(train, on_cpu: bool) -> int:
    """FP8 copies of each weight `train.fp8_weight_cache` keeps for the step: the CPU emulation caches W, the GPU
    path W and Wᵀ under blockwise (llmtrain/fp8/cache.py); 0 without FP8 or the cache."""
    if train.fp8 == "none" or not getattr(train, "fp8_weight_cache", False):
        return 0
    return 1 if on_cpu or train.fp8 == "tensorwise" else 2
