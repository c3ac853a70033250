"""DualPipeV's cost-balanced split: blocks per chunk with each stage's PAIR of chunks balanced.

    python -m pytest tests/parallel/test_pp_split.py -q -k pair
    split = v_balanced_split(costs, pp=4)   # costs: [embedding, block 0, ..., block L-1, head with its loss]

Under DualPipeV (`parallel.pp_schedule=dualpipev`) the 2·pp chunks lie on the stages as a V: stage s runs chunk s
and chunk 2·pp - 1 - s (`llmtrain.parallel.pp_split.chunk_stage`), so stage 0 holds the embedding (chunk 0) and the
head (the last chunk), the last stage the two middle chunks back to back. A stage's work per micro-batch is the
sum of its two chunks, and that sum is what must be even; balancing the chunks one by one along the chain
(`pp_split.balanced_split`) puts the embedding and the head, both on stage 0, into two chunks that are each made
light, so stage 0 ends up with fewer blocks than the other stages need to match it, or more, depending on what the
chain's rounding leaves it.

The split here minimises the costliest stage (its two chunks summed), then the sum of squared chunk costs (the V
runs each chunk's passes on their own, and fleet's overlap pairs one chunk's forward with another's backward: even
chunks where the costliest stage allows), then the sum of squared stage costs; every chunk holds at least one block.
Where it lowers the costliest stage, a stage's two chunks may be far apart in size (DeepSeek-V3 at pp4 on h800:
stage 0 holds 1 block down the V and 14 on the way up, its costliest stage 716.7 ms against the chain split's
735.5 ms). Exact: a dynamic programme from the outside of the
V inwards over (first block of chunk s, end of chunk 2·pp - 1 - s), the state after stages 0..s-1; stage s takes
a left and a right piece, the middle stage the contiguous rest (cut where its two chunks are most even). Only
states whose inner blocks the remaining stages can still hold under the limit are kept (the limit: the costliest
stage of the better of the count split and the chain-balanced split, then the optimum found by the first pass).
"""
from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from typing import Sequence

from llmtrain.parallel.pp_split import REL_TOL, balanced_split, count_split


def v_balanced_split(costs: Sequence[float], pp: int) -> tuple[int, ...]:
    """Blocks per chunk (2·pp chunks in model order) balancing each DualPipeV stage's pair of chunks (see the
    module); remembered, as the planner asks again for every layout it ranks."""
    return _v_balanced_split(tuple(costs), pp)


def stage_costs(costs: Sequence[float], split: Sequence[int], pp: int) -> list[float]:
    """Each DualPipeV stage's cost under `split`: its two chunks' blocks, plus the embedding and the head on stage 0
    (costs as for `v_balanced_split`)."""
    chunk = chunk_costs(costs, split)
    return [chunk[s] + chunk[2 * pp - 1 - s] for s in range(pp)]


def chunk_costs(costs: Sequence[float], split: Sequence[int]) -> list[float]:
    """Each chunk's cost under `split` (the embedding in chunk 0, the head in the last)."""
    at, out = 1, []
    for i, n in enumerate(split):
        out.append(sum(costs[at:at + n]) + (costs[0] if i == 0 else 0.0) + (costs[-1] if i == len(split) - 1 else 0.0))
        at += n
    return out


def lower_bound(costs: Sequence[float], pp: int) -> float:
    """A bound no DualPipeV split's costliest stage goes under: the mean stage, stage 0's embedding and head with
    at least one block of each end, and for each block cost x the stage that must hold ceil(N_x / pp) of the N_x
    blocks costing x or more."""
    blocks = sorted(costs[1:-1], reverse=True)
    bound = max(sum(costs) / pp, costs[0] + costs[-1] + costs[1] + costs[-2])
    for i, x in enumerate(blocks):  # blocks[:i + 1] cost x or more
        if i + 1 == len(blocks) or blocks[i + 1] < x:
            bound = max(bound, -(-(i + 1) // pp) * x)
    return bound


@lru_cache(maxsize=8192)
def _v_balanced_split(costs: tuple, pp: int) -> tuple[int, ...]:
    embed, head = costs[0], costs[-1]
    n = len(costs) - 2
    chunks = 2 * pp
    if pp < 1 or n < chunks:
        raise ValueError(f"{n} blocks cannot fill {chunks} chunks (DualPipeV at pp={pp}) of at least one block each")
    if min(costs) < 0:
        raise ValueError(f"negative cost {min(costs)} in {list(costs)}: costs are seconds, >= 0")
    prefix = [0.0]
    for c in costs[1:-1]:
        prefix.append(prefix[-1] + c)
    keep = 1 - REL_TOL

    def middle(a: int, c: int) -> int:
        """Where the middle stage's blocks a..c-1 are cut into its two chunks: the most even cut (the first on ties;
        with pp = 1 the embedding and the head counted in its chunks)."""
        best, at = float("inf"), a + 1
        e, h = (embed, head) if pp == 1 else (0.0, 0.0)
        for m in range(a + 1, c):
            gap = abs(prefix[m] - prefix[a] + e - (prefix[c] - prefix[m] + h))
            if gap < best * keep:
                best, at = gap, m
        return at

    blocks = costs[1:-1]

    def same_futures(layer: dict) -> list:
        """The states of `layer` worth extending, in order: of those whose remaining blocks cost the same one by one
        (blocks[a:c] equal: the same inner splits, scores and ties from there on), the best scored (the first on
        ties). With runs of equal blocks (dense, MoE) most states of a level fall together."""
        kept: dict = {}
        for a, c in sorted(layer):
            key = blocks[a:c]
            other = kept.get(key)
            if other is not None:
                o0, o1 = layer[other][0]
                n0, n1 = layer[(a, c)][0]
                if not (n0 < o0 * keep or (n0 <= o0 * (1 + REL_TOL) and n1 < o1 * keep)):
                    continue
            kept[key] = (a, c)
        return sorted(kept.values())

    def solve(minimax: bool, limit: float):
        """(score, boundaries [b_0 .. b_2pp]) of the best split whose stages each cost at most `limit`, or None.
        minimax: score (costliest stage, 0.0); else (sum of squared chunk costs, sum of squared stage costs); a
        candidate replaces a state's score only when lower by REL_TOL (first score, then second), so the earlier of
        two tied candidates stays."""
        hi = 1 + REL_TOL
        layer = {(0, n): ((0.0, 0.0), None)}
        levels = []
        for s in range(pp - 1):
            left_extra, right_extra = (embed, head) if s == 0 else (0.0, 0.0)
            rest = pp - 1 - s  # stages inside the V after this one: 2 x rest blocks at least
            reach = rest * limit
            nxt: dict = {}
            get = nxt.get
            for (a, c) in same_futures(layer):
                s0, s1 = layer[(a, c)][0]
                pa, pc = prefix[a], prefix[c]
                for a2 in range(a + 1, c - 2 * rest):
                    left = prefix[a2] - pa + left_extra
                    if left + right_extra > limit:
                        break
                    # c2 <= top: the inner stages can hold blocks a2..c2-1 under the limit
                    top = min(c - 1, bisect_right(prefix, prefix[a2] + reach) - 1)
                    for c2 in range(top, a2 + 2 * rest - 1, -1):
                        right = pc - prefix[c2] + right_extra
                        cost = left + right
                        if cost > limit:
                            break
                        if minimax:
                            n0, n1 = (s0 if s0 > cost else cost), 0.0
                        else:
                            n0, n1 = s0 + left * left + right * right, s1 + cost * cost
                        old = get((a2, c2))
                        if old is not None:
                            o0, o1 = old[0]
                            if not (n0 < o0 * keep or (n0 <= o0 * hi and n1 < o1 * keep)):
                                continue
                        nxt[(a2, c2)] = ((n0, n1), (a, c))
            levels.append(nxt)
            layer = nxt
        best, at = None, None
        ends = embed + head if pp == 1 else 0.0
        for (a, c) in same_futures(layer):
            if c - a < 2:
                continue
            cost = prefix[c] - prefix[a] + ends
            if cost > limit:
                continue
            m = middle(a, c)
            s0, s1 = layer[(a, c)][0]
            if minimax:
                n0, n1 = (s0 if s0 > cost else cost), 0.0
            else:
                lc = prefix[m] - prefix[a] + (embed if pp == 1 else 0.0)
                rc = prefix[c] - prefix[m] + (head if pp == 1 else 0.0)
                n0, n1 = s0 + lc * lc + rc * rc, s1 + cost * cost
            if best is None or n0 < best[0] * keep or (n0 <= best[0] * hi and n1 < best[1] * keep):
                best, at = (n0, n1), (a, c, m)
        if best is None:
            return None
        a, c, m = at
        left, right = [a], [c]
        for nxt in reversed(levels):
            a, c = nxt[(a, c)][1]
            left.append(a)
            right.append(c)
        return best, [*reversed(left), m, *right]

    def worst_stage(split) -> float:
        return max(stage_costs(costs, split, pp))

    start = min(worst_stage(count_split(n, chunks)), worst_stage(balanced_split(costs, chunks)))
    if start <= lower_bound(costs, pp) * (1 + REL_TOL):
        worst = start  # a split reaching the bound: the optimum, without the first programme
    else:
        worst = solve(True, start * (1 + 1e-6))[0][0]
    _, bounds = solve(False, worst * (1 + REL_TOL))
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))
