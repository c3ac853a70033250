"""What DualPipeV (`parallel.pp_schedule=dualpipev`) needs of the layout, checked without paddle.

    python -m pytest tests/parallel/test_dualpipe.py -q
    problems = dualpipe_problems(cfg.parallel)

Models and data are not restricted: Mixture-of-Experts runs (llmtrain/parallel/moe_pipeline.py), and so do packed
documents (`data.document_mask`, `data.reset_position_ids`: the stages carry position and document ids beside the
hidden states, llmtrain/paddle_compat/dualpipe.py `CarriedCommHelper`).

The schedule and its layers are in llmtrain/parallel/dualpipe.py; the planner reads these rules from here (through
`llmtrain.parallel.layout.layout_problems`) so that a ranking never imports paddle.
"""
from __future__ import annotations

from llmtrain.parallel.overlap import enabled

PIPELINE_KNOBS = ("pp_overlap_p2p_comm", "dp_comm_overlap", "pp_sharding_comm_overlap", "sharding_split_param")
"""Communication options refused under DualPipeV: the first three are hooks of fleet's 1F1B `PipelineParallel`
(its p2p overlap and the gradient buckets it issues from its last backward), which `DualPipeVParallel` does not
run; stage-1 V2 (`sharding_split_param`) is not tested with it."""


def dualpipe_problems(p) -> list[str]:
    """Problems of `parallel.pp_schedule=dualpipev` with the degrees of `p` (a ParallelConfig): pp >= 2, no extra
    virtual stages, and the axes it has been tested with: pp with dp, stage-1 sharding and ep (each against one
    process: tests/parallel/test_parity.py pp2dpv, pp4dpv, dp2pp2dpv, sharding2pp2dpv); tp and cp refused. The
    micro-batch count (>= 2 x pp) is checked with the batch (`llmtrain.parallel.layout`)."""
    problems = []
    if p.pp < 2:
        problems.append(f"parallel.pp_schedule=dualpipev with parallel.pp={p.pp}: DualPipeV is a pipeline schedule; "
                        "set parallel.pp >= 2")
    if p.virtual_pp not in (1, 2):
        problems.append(f"parallel.pp_schedule=dualpipev with parallel.virtual_pp={p.virtual_pp}: DualPipeV holds "
                        "exactly 2 chunks per stage (its V) and fleet asserts 'dualpipev is not compatible with "
                        "virtual pipeline'; leave virtual_pp at 1 (or 2), or use pp_schedule=interleaved for more "
                        "virtual stages")
    extra = {k: v for k, v in {"tp": p.tp, "cp": getattr(p, "cp", 1)}.items() if v > 1}
    if extra:
        given = ", ".join(f"parallel.{k}={v}" for k, v in extra.items())
        problems.append(f"parallel.pp_schedule=dualpipev with {given}: not built (every linear under DualPipeV is "
                        "fleet's single-device SplitBWLinear, which splits no weight over tp ranks; cp is not tested "
                        "with it). DualPipeV runs with pp, dp, stage-1 sharding and ep; use pp_schedule=1f1b (or "
                        "interleaved, pp > 2) with tp or cp")
    knobs = [k for k in enabled(p) if k in PIPELINE_KNOBS]
    if knobs:
        problems.append(f"parallel.pp_schedule=dualpipev with {', '.join(f'parallel.{k}=true' for k in knobs)}: "
                        "pp_overlap_p2p_comm, dp_comm_overlap and pp_sharding_comm_overlap are hooks of fleet's 1F1B "
                        "schedule that DualPipeV does not run, and stage-1 V2 is not tested with it; switch them off "
                        "or use pp_schedule=1f1b")
    return problems
