"""A run of kernels on the planner's host/device stream as one max-plus map: what lets a ranking time thousands of
layouts in seconds.

    python -m pytest tests/plan/test_fast_timeline.py -q
    s = Summary.of(kernels_as_pairs, async_launch=True)    # [(host s, device s, kind, counts)] -> one map
    host, device = s.apply(host, device)                   # the clocks after the whole run
    s.power(128)                                           # the same run 128 times in a row, exactly

`llmtrain/plan/timeline.py` advances two clocks per kernel (host dispatch h, device time d):

    GPU (async launch):  H' = H + h;            D' = max(D, H') + d
    a host read (sync):  H' = max(H, D) + h;    D' = H'
    CPU (ops run where they are dispatched):  H' = D' = H + h + d

Each is linear in the max-plus algebra (max for +, + for x): (H', D') = (max(H + a, D + b), max(H + c, D + e)).
A run of kernels composes into one such 2 x 2 map, its four entries computed once in a pass over the run; applying
it to any clocks is then four additions. The run's totals (host and device seconds, kernels, device seconds by
kind) add up. A run repeated n times in a row is the map's n-th power (repeated squaring: log2 n products), equal
to simulating all n x len(run) kernels one by one up to floating-point rounding (the additions grouped
differently). The timeline caches the map of every kernel list it has seen (a micro-batch's blocks, its
optimizer's per-tensor kernels), so a ranking prices each distinct list once however many layouts share it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NEG = float("-inf")
"""The max-plus zero: no path from that clock."""


@dataclass
class Summary:
    """One run of kernels as a max-plus map of the (host, device) clocks, with its totals."""

    a: float = 0.0
    """H' from H (with identity: 0)."""
    b: float = NEG
    """H' from D."""
    c: float = NEG
    """D' from H."""
    e: float = 0.0
    """D' from D."""
    host: float = 0.0
    """Host seconds the run dispatches (sum of h)."""
    device: float = 0.0
    """Device seconds the run executes (sum of d)."""
    kernels: int = 0
    """Kernels launched (views are not counted)."""
    by_kind: dict = field(default_factory=dict)
    """Device seconds by kind ("gemm", "attention", "mem", "comm", ...)."""

    def kernel(self, h: float, d: float, key: str | None, counted: bool, async_launch: bool) -> None:
        """Append one kernel of host time h and device time d (`key` None: a host read, `sync`)."""
        a, b, c, e = self.a, self.b, self.c, self.e
        if key is None:  # H' = max(H, D) + h, D' = H'
            self.a = self.c = max(a, c) + h
            self.b = self.e = max(b, e) + h
            self.host += h
            return
        if async_launch:  # H' = H + h; D' = max(D, H') + d
            self.a, self.b = a + h, b + h
            self.c, self.e = max(c, a + h) + d, max(e, b + h) + d
        else:  # H' = D' = H + h + d
            self.a, self.b = a + h + d, b + h + d
            self.c, self.e = self.a, self.b
        self.kernels += counted
        self.host += h
        self.device += d
        self.by_kind[key] = self.by_kind.get(key, 0.0) + d

    def then(self, o: "Summary") -> "Summary":
        """This run followed by `o`."""
        return Summary(max(self.a + o.a, self.c + o.b), max(self.b + o.a, self.e + o.b),
                       max(self.a + o.c, self.c + o.e), max(self.b + o.c, self.e + o.e),
                       self.host + o.host, self.device + o.device, self.kernels + o.kernels,
                       {k: self.by_kind.get(k, 0.0) + o.by_kind.get(k, 0.0) for k in {*self.by_kind, *o.by_kind}})

    def power(self, n: int) -> "Summary":
        """This run n times in a row (n >= 0), by repeated squaring."""
        out, base = Summary(), self
        while n > 0:
            if n & 1:
                out = out.then(base)
            n >>= 1
            if n:
                base = base.then(base)
        return out

    def apply(self, host: float, device: float) -> tuple[float, float]:
        """The clocks after the run, from (host, device) before it."""
        return max(host + self.a, device + self.b), max(host + self.c, device + self.e)
