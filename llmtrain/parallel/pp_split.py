"""Uneven pipeline stages: how many transformer blocks each pipeline chunk holds, given or balanced by cost.

    python -m paddle.distributed.launch --nproc_per_node 2 llmtrain/pretrain.py model=llama-tiny model.num_layers=5 +parallel=custom parallel.pp=2 parallel.pp_layers=[3,2]
    split = balanced_split(costs, chunks=4)     # costs: [embedding, block 0, ..., block L-1, head with its loss]
    blocks = stage_blocks(layout.pp_layers, layout.pp, stage)   # the block indices pipeline stage `stage` holds

A split is a tuple of block counts, one per chunk in model order (`Layout.pp_layers`, length pp x virtual_pp).
Chunk i runs on stage i % pp, as fleet's interleaved `PipelineLayer` assigns chunks, or under DualPipeV (2 chunks
per stage, `v_shape=True`) on stage i for i < pp and 2·pp - 1 - i after (the V: stage 0 holds the first and the
last chunk, stage pp - 1 the two middle ones, `chunk_stage`); the embedding joins chunk 0,
the final norm, the head and the loss the last chunk. Checkpoints do not depend on it (tensors are stored whole
under their canonical names), so a run may resume under another split or under no pipeline at all.
"""
from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache
from typing import Optional, Sequence

REL_TOL = 1e-9
"""Two chunk costs within this relative distance are equal (the balanced split's tie rule)."""


def split_problems(pp: int, virtual_pp: int, pp_layers: Optional[Sequence[int]]) -> list[str]:
    """Problems of an explicit `parallel.pp_layers` against the degrees alone (the model's layer count is checked by
    `split_fit_problems`)."""
    if not pp_layers:
        return []
    given = f"parallel.pp_layers={list(pp_layers)}"
    if pp <= 1:
        return [f"{given} with parallel.pp={pp}: a split of the blocks needs pipeline stages; set parallel.pp > 1 "
                "or drop parallel.pp_layers"]
    chunks = pp * virtual_pp
    problems = []
    if len(pp_layers) != chunks:
        problems.append(f"{given} has {len(pp_layers)} entries, but parallel.pp={pp} x parallel.virtual_pp="
                        f"{virtual_pp} = {chunks} pipeline chunks: give one block count per chunk, in model order "
                        "(chunk i runs on stage i % pp)")
    empty = [i for i, n in enumerate(pp_layers) if n < 1]
    if empty:
        problems.append(f"{given}: chunk(s) {empty} hold fewer than 1 block; every pipeline chunk needs at least one "
                        "transformer block")
    return problems


def split_fit_problems(pp: int, virtual_pp: int, pp_layers: Optional[Sequence[int]], num_layers: int) -> list[str]:
    """Problems of the model's `num_layers` blocks under pp x virtual_pp chunks and the explicit split, if any."""
    chunks = pp * virtual_pp
    if pp <= 1 or num_layers <= 0:
        return []
    if num_layers < chunks:
        return [f"model.num_layers={num_layers} is fewer than parallel.pp={pp} x parallel.virtual_pp={virtual_pp} = "
                f"{chunks} pipeline chunks, and every chunk needs at least one block: use pp x virtual_pp <= "
                f"{num_layers}"]
    if pp_layers and len(pp_layers) == chunks and sum(pp_layers) != num_layers:
        return [f"parallel.pp_layers={list(pp_layers)} holds {sum(pp_layers)} blocks, but model.num_layers="
                f"{num_layers}: the chunks must hold every block once (e.g. parallel.pp_layers="
                f"{list(count_split(num_layers, chunks))}, or drop it for the cost-balanced default)"]
    return []


def count_split(num_layers: int, chunks: int) -> tuple[int, ...]:
    """`num_layers` blocks over `chunks` chunks by count alone, the extra blocks on the first chunks ([3, 2] for 5
    over 2)."""
    base, extra = divmod(num_layers, chunks)
    return tuple(base + (i < extra) for i in range(chunks))


def balanced_split(costs: Sequence[float], chunks: int) -> tuple[int, ...]:
    """`_balanced_split` of the costs as a tuple (remembered: the planner asks again for every layout it ranks)."""
    return _balanced_split(tuple(costs), chunks)


@lru_cache(maxsize=8192)
def _balanced_split(costs: tuple, chunks: int) -> tuple[int, ...]:
    """Blocks per chunk minimising the costliest chunk, then the sum of squared chunk costs (a tie between equal
    bottlenecks goes to the evener split); every chunk holds at least one block.

    `costs`: [embedding, block 0, ..., block L-1, head with its loss] (`llmtrain.plan.stage_cost.layer_costs`); the
    embedding is counted in chunk 0, the head in the last chunk. Exact: two dynamic programmes over (chunks, blocks),
    each chunk's start searched only where the chunk costs at most the limit (the first programme's limit: the
    bottleneck of the split by count, which the optimum cannot exceed; a chunk above it never wins a state on the
    optimal path), about O(L^2) instead of O(chunks x L^2)."""
    embed, blocks, head = costs[0], list(costs[1:-1]), costs[-1]
    n = len(blocks)
    if chunks < 1 or n < chunks:
        raise ValueError(f"{n} blocks cannot fill {chunks} chunks of at least one block each")
    if min(costs) < 0:
        raise ValueError(f"negative cost {min(costs)} in {list(costs)}: costs are seconds, >= 0")
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    last = chunks - 1

    def chunk_cost(k: int, a: int, j: int) -> float:  # chunk k holds blocks a .. j-1
        return prefix[j] - prefix[a] + (embed if k == 0 else 0.0) + (head if k == chunks - 1 else 0.0)

    def solve(minimax: bool, limit: float) -> list:
        """args[k][j]: the start of chunk k in the best split of blocks 0..j-1 into chunks 0..k (-1: none) whose
        chunks each cost at most `limit`; the score of a chunk sequence is its costliest chunk (`minimax`) or the
        sum of its squared chunk costs; [scores of chunks 0..last ending at n] returned last. A chunk holds at most
        `most` blocks under the limit (its cost is at least its blocks' prefix difference), so chunk k ends
        between n - (last - k) x most (the chunks after it must hold the rest) and (k + 1) x most; its start is
        searched from the first block that keeps it under the limit (monotone in j), in increasing order, a start
        winning only when it scores below the best so far by REL_TOL."""
        inf = float("inf")
        keep = 1 - REL_TOL
        most, a = 0, 0
        for j in range(1, n + 1):
            while prefix[j] - prefix[a] > limit:
                a += 1
            most = max(most, j - a)
        vals, args = [inf] * (n + 1), [[-1] * (n + 1)]
        for j in range(1, n - chunks + 2):
            c = chunk_cost(0, 0, j)
            if c <= limit:
                vals[j] = c if minimax else c * c
                args[0][j] = 0
        for k in range(1, chunks):
            h_k = head if k == last else 0.0  # chunk_cost's terms for k > 0 (x + 0.0 is x)
            row, arg = [inf] * (n + 1), [-1] * (n + 1)
            lo = k
            for j in range(n if k == last else max(k + 1, n - (last - k) * most),
                           min(n - chunks + k + 1, (k + 1) * most) + 1):
                pj = prefix[j]
                while lo < j and pj - prefix[lo] + h_k > limit:
                    lo += 1
                top = thr = inf
                at = -1
                for a in range(lo, j):
                    prev = vals[a]
                    if prev == inf:
                        continue
                    c = pj - prefix[a] + h_k
                    sc = (prev if prev > c else c) if minimax else prev + c * c
                    if sc < thr:
                        top, at, thr = sc, a, sc * keep
                row[j], arg[j] = top, at
            vals = row
            args.append(arg)
        return args + [vals]

    by_count, at = 0.0, 0  # the bottleneck of the split by count: the optimum is at most that
    for k, size in enumerate(count_split(n, chunks)):
        by_count, at = max(by_count, chunk_cost(k, at, at + size)), at + size
    worst = solve(True, by_count * (1 + 1e-6))[-1][n]
    best = solve(False, worst * (1 + REL_TOL))
    ends, j = [], n
    for k in range(chunks - 1, -1, -1):
        ends.append(j)
        j = best[k][j]
    ends.reverse()
    return tuple(b - a for a, b in zip([0, *ends[:-1]], ends))


def chunk_starts(pp_layers: Sequence[int]) -> list[int]:
    """The first block index of every chunk."""
    starts, at = [], 0
    for n in pp_layers:
        starts.append(at)
        at += n
    return starts


def chunk_stage(i: int, pp: int, chunks: int, v_shape: bool = False) -> int:
    """The pipeline stage that runs chunk `i` of `chunks`: i % pp (interleaved), or under DualPipeV (`v_shape`,
    chunks = 2·pp) i down the V and 2·pp - 1 - i back up it."""
    if v_shape:
        return i if i < pp else chunks - 1 - i
    return i % pp


def stage_chunks(pp: int, chunks: int, stage: int, v_shape: bool = False) -> list[int]:
    """The chunk indices stage `stage` runs, in model order."""
    return [i for i in range(chunks) if chunk_stage(i, pp, chunks, v_shape) == stage]


def stage_blocks(pp_layers: Sequence[int], pp: int, stage: int, v_shape: bool = False) -> list[int]:
    """The blocks pipeline stage `stage` holds: those of its chunks (`stage_chunks`; all blocks when pp = 1)."""
    if pp <= 1:
        return list(range(sum(pp_layers)))
    starts = chunk_starts(pp_layers)
    return [b for i in stage_chunks(pp, len(pp_layers), stage, v_shape) for b in range(starts[i], starts[i] + pp_layers[i])]


def describe_split(pp_layers: Sequence[int], pp: int, v_shape: bool = False) -> str:
    """`stage 0: embedding + blocks 0-2 | stage 1: blocks 3-4 + head` (the run log's line; chunks of one stage
    joined by `,`; `v_shape`: DualPipeV's placement)."""
    starts, last = chunk_starts(pp_layers), len(pp_layers) - 1
    parts = []
    for stage in range(pp):
        chunks = []
        for i in stage_chunks(pp, len(pp_layers), stage, v_shape):
            a, b = starts[i], starts[i] + pp_layers[i] - 1
            text = f"block {a}" if a == b else f"blocks {a}-{b}"
            chunks.append(("embedding + " if i == 0 else "") + text + (" + head" if i == last else ""))
        parts.append(f"stage {stage}: " + ", ".join(chunks))
    return " | ".join(parts)


def split_tag(pp_layers: Sequence[int]) -> str:
    """The split in a run name: `L3-2`, runs of equal counts as `<count>x<times>` (`L9-8x3-7x4` for
    [9, 8, 8, 8, 7, 7, 7, 7])."""
    groups: list[list[int]] = []
    for n in pp_layers:
        if groups and groups[-1][0] == n:
            groups[-1][1] += 1
        else:
            groups.append([n, 1])
    return "L" + "-".join(f"{n}x{k}" if k > 1 else f"{n}" for n, k in groups)
