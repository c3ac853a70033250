"""Compute time of a training step from its kernels: device time per kernel, host time per eager op, and how
the two overlap.

    python -m llmtrain.plan model=tinyllama-1.1b plan.devices=1 plan.device=h200 +parallel=single train.micro_batch_size=1
    t = step_compute(profile, StepSpec(MicroBatchSpec(model_cfg, b=1, s=2048), micro_batches=8, grads=g, owned=g))

Device time of a kernel (llmtrain/plan/kernels.py) comes from the profile's tables (profile.py): a GEMM's FLOPs
at the rate measured for that shape, flash attention's FLOPs at the rate measured for its (batch·heads, seq)
(the math attention core likewise when the profile measured it, `attention_math`),
a memory-bound op's bytes at the time measured for its class and size; a view costs no device time.

Host time and the overlap, modelled explicitly:
- On a GPU (`async_launch`) eager execution dispatches ops one by one from one host thread (`fwd_op_s` per
  forward op with autograd recording, `bwd_op_s` per backward node, `view_op_s` per view) and the GPU runs
  the queued kernels in order. The stream is simulated kernel by kernel:
      host_i = host_{i-1} + h_i;   device_i = max(device_{i-1}, host_i) + d_i
  and the step ends at max(host_n, device_n). When the kernels are long (large micro-batches) the host runs
  ahead and the step is the sum of device times; when they are short (micro-batch 1 of a small model) the
  GPU waits for the host and the step is close to the sum of host times: what makes micro-batch 1 slow.
  The step synchronises once, at its end (the logged loss), so the micro-batches and the optimizer form one
  stream: the AdamW update is queued behind the last backward like any dispatch (`Stream.run_optimizer`: per
  updated tensor `optimizer.per_tensor_s` of host and its elements' share of `per_elem_s` on the device), so
  its host dispatch hides behind a device-bound backward and adds where the step is host-bound (measured on
  the H200: the twin's step has no synchronisation before its end; a profiled device-bound step shows the
  launch queue full, "Command Buffer Full", while the host dispatches the backward and the optimizer). Repeated work (the blocks of a micro-batch, the micro-batches of a step) is simulated twice and each
  later repeat advances both clocks as the second did (the host-device lag has settled by then).
  A kernel the autograd engine launches without a node of its own (`Kernel.host == "launch"`: summing a
  tensor's gradients, adding into a parameter's gradient buffer) costs the bare launch, `launch_op_s`. An op
  class that launches several device kernels per call (the profile's `host.launches`, measured per class:
  PyTorch's top-k, one_hot, the logsumexp, ...) adds `host.extra_launch_s` per launch beyond the first.
- On a CPU (`async_launch` false) every op runs in the thread that dispatches it: step = Σ (h_i + d_i). The
  CPU tables are timed per Paddle call, so they already hold one dispatch (`tables_include_host`): there h_i
  is only the autograd extra per op (`fwd_op_s`, `bwd_op_s` measured as the extra over a bare call).

The training loop's own host work, outside any kernel, is two measured constants of the profile's `host` block
(0 when absent): `micro_batch_s` per micro-batch and `step_s` per step (host-only time; on a GPU it overlaps the
queued kernels like any dispatch, on a CPU it adds).

On a host whose cores several ranks of the job share (a multi-process CPU run), every kernel is slower than the
tables measured it in one process: a profile's `shared_host` table (measured by `--calibrate`: a GEMM and
adds in cache and streaming, in 1 and in 2 processes at once) gives the factors, applied when `local_ranks` > 1
to GEMMs (by the elements of their operands), memory-bound kernels (the adds', by size: a working set that fits
the shared last-level cache alone but not beside another process slows most), attention kernels and host-only
work (the GEMMs' median) and AdamW (the largest add's).

The AdamW update is `optimizer.per_tensor_s`·tensors + `optimizer.per_elem_s`·elements (fitted to measured
steps of the optimizer alone): on a GPU split into host and device parts in the stream (above; a profile may add
`per_tensor_device_s` of device per tensor and `per_step_s` of host per step, fitted as that stream:
fit.fit_optimizer_stream), on a CPU run after the backward (`Stream.add_serial`); gradient accumulation and the
clip are memory-bound kernels in the stream.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from llmtrain.plan.kernel_ops import mem
from llmtrain.plan.fp8 import is_fp8_gemm
from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels, optimizer_kernels
from llmtrain.plan.maxplus import Summary
from llmtrain.plan.profile import slowdown_at


def kernel_seconds(prof, k) -> float:
    """Device seconds of one kernel on `prof`."""
    if k.kind == "gemm":
        m, n, kk, batch = k.shape
        seconds = prof.gemm_seconds(m, n, kk, batch, k.layout)
        fp8 = getattr(prof, "fp8", None)
        if fp8 is not None and is_fp8_gemm(k.op):  # train.fp8: the measured FP8 / bf16 ratio, plus quantisation
            return fp8.gemm_seconds(seconds, k.op, m, n, kk, batch)
        return seconds
    if k.kind in ("attn_fwd", "attn_bwd"):
        bh, s, d, causal = k.shape[:4]
        if k.op == "math":
            return prof.math_attention_seconds(bh, s, d, k.flops, k.kind == "attn_bwd")
        return prof.attention_seconds(bh, s, d, causal, k.flops, k.kind == "attn_bwd")
    if k.kind == "mem":
        if k.shape:  # between two classes' tables (Kernel.shape)
            other, w = k.shape
            return (1 - w) * prof.mem_seconds(k.op, k.numel) + w * prof.mem_seconds(other, k.numel)
        return prof.mem_seconds(k.op, k.numel)
    if k.kind == "comm":  # priced where it was made (llmtrain/plan/moe.py `exchange_seconds`)
        return float(k.shape[0])
    return 0.0


class Stream:
    """One host thread dispatching kernels to one device (see the module docstring)."""

    def __init__(self, prof, slowdown: dict | None = None, fast: bool = True, slow_key=None):
        self.prof = prof
        self.slowdown = slowdown or {}  # {"gemm" | "attention" | "mem": factor}: other ranks computing on this host
        self._memo = prof.__dict__.setdefault("_kernel_memo", {})  # a kernel's device time, per profile
        self.fast = fast  # each kernel list as one cached max-plus map (maxplus.py); False: kernel by kernel
        # the lists' maps, per profile: {(id(list), backward, prefix, slowdown key): (list, Summary)}
        self._maps = prof.__dict__.setdefault("_summary_memo", {})
        self._slow_key = slow_key if slow_key is not None else repr(sorted(self.slowdown.items()))
        self.host = self.device = 0.0
        self.host_total = self.device_total = 0.0
        self.by_kind: dict[str, float] = {}
        self.kernels = 0

    def run(self, kernels, backward: bool, forward_prefix: int = 0):
        """Dispatch `kernels` in order; the first `forward_prefix` of a backward list are a forward run again
        (recompute) and cost the forward's host time."""
        if self.fast:
            self.apply(self.summary(kernels, backward, forward_prefix))
            return
        for h, d, key, counted in self._priced(kernels, backward, forward_prefix):
            if key is None:  # a host read of a device value: the host waits for the queue to drain
                self.host = max(self.host, self.device) + h
                self.device = max(self.device, self.host)
                self.host_total += h
                continue
            self.kernels += counted
            self.host_total += h
            self.device_total += d
            self.by_kind[key] = self.by_kind.get(key, 0.0) + d
            if self.prof.async_launch:
                self.host += h
                self.device = max(self.device, self.host) + d
            else:
                self.host += h + d
                self.device = self.host

    def summary(self, kernels, backward: bool, forward_prefix: int = 0) -> Summary:
        """`kernels` dispatched in order as one max-plus map (llmtrain/plan/maxplus.py), cached per list."""
        key = (id(kernels), backward, forward_prefix, self._slow_key)
        hit = self._maps.get(key)
        if hit is not None and hit[0] is kernels:
            return hit[1]
        out = Summary()
        for h, d, kind, counted in self._priced(kernels, backward, forward_prefix):
            out.kernel(h, d, kind, counted, self.prof.async_launch)
        self._maps[key] = (kernels, out)  # the list kept alive: its id is not reused while cached
        return out

    def apply(self, s: Summary, times: int = 1):
        """Advance the clocks and totals by the run `s`, `times` times in a row (exactly: its max-plus power)."""
        if times != 1:
            s = s.power(times)
        self.host, self.device = s.apply(self.host, self.device)
        self.host_total += s.host
        self.device_total += s.device
        self.kernels += s.kernels
        for k, v in s.by_kind.items():
            self.by_kind[k] = self.by_kind.get(k, 0.0) + v

    def _priced(self, kernels, backward: bool, forward_prefix: int):
        """(host s, device s, kind key or None for a host read, counted) of each kernel of the list."""
        p, host = self.prof, self.prof.host
        h_op = host["bwd_op_s"] if backward else host["fwd_op_s"]
        memo = self._memo
        extra, launches = host.get("extra_launch_s", 0.0), host.get("launches", {})
        for i, k in enumerate(kernels):
            h = host["view_op_s"] if k.kind == "view" else host["fwd_op_s"] if i < forward_prefix else h_op
            if k.kind == "part":  # a bare op inside a composite row, where the profile measured one
                h = host.get("part_fwd_s" if i < forward_prefix or not backward else "part_bwd_s", h)
            if extra and k.kind == "mem" and k.op in launches:  # an op of several device launches (measured)
                h += extra * (launches[k.op] - 1)
            if k.host == "launch":  # launched by the autograd engine itself (kernels.Kernel.host)
                h = host.get("launch_op_s", h)
            if k.kind == "sync":
                yield h, 0.0, None, False
                continue
            d = memo.get(k)
            if d is None:
                d = memo[k] = kernel_seconds(p, k) if k.kind not in ("view", "part") else 0.0
            key = "gemm" if k.kind == "gemm" else "attention" if k.kind.startswith("attn") else k.kind
            if self.slowdown and key in self.slowdown:
                if k.kind == "gemm":  # by the elements of its operands and result
                    m, n, kk, bt = k.shape
                    d *= slowdown_at(self.slowdown[key], bt * (m * kk + kk * n + m * n))
                else:
                    d *= slowdown_at(self.slowdown[key], k.numel)
            yield h, d, key, k.kind != "view"

    def run_segments(self, segments, backward: bool, body=None):
        """[(kernels, n[, forward_prefix])]: each list n times in a row; from the third repeat on, every repeat
        advances the clocks and totals as the second did (the host-device lag has settled by then)."""
        for ks, n, *prefix in segments:
            for i in range(min(n, 2)):
                before = (self.host, self.device, self.host_total, self.device_total, self.kernels, dict(self.by_kind))
                if body is not None:
                    body()
                else:
                    self.run(ks, backward, prefix[0] if prefix else 0)
            if n > 2:
                h0, d0, ht0, dt0, k0, bk0 = before
                r = n - 2
                self.host += r * (self.host - h0)
                self.device += r * (self.device - d0)
                self.host_total += r * (self.host_total - ht0)
                self.device_total += r * (self.device_total - dt0)
                self.kernels += r * (self.kernels - k0)
                for key, v in list(self.by_kind.items()):
                    self.by_kind[key] = v + r * (v - bk0.get(key, 0.0))

    def add_host(self, seconds: float):
        """Host-only work (the training loop's own Python between kernels): the host clock advances; on a CPU,
        where ops run in the dispatching thread, the device clock with it."""
        seconds *= self.slowdown.get("host", 1.0)
        self.host += seconds
        self.host_total += seconds
        if not self.prof.async_launch:
            self.device = self.host

    def add_device(self, seconds: float, key: str):
        """Device work queued now (kernels whose dispatch is priced elsewhere): the device clock advances; on a CPU,
        where ops run in the dispatching thread, the host clock with it."""
        self.device = max(self.device, self.host) + seconds
        self.device_total += seconds
        self.by_kind[key] = self.by_kind.get(key, 0.0) + seconds
        if not self.prof.async_launch:
            self.host = self.device

    def add_serial(self, seconds: float, key: str):
        """Work after a synchronisation (the optimizer step): both clocks meet, then advance."""
        t = max(self.host, self.device) + seconds
        self.host = self.device = t
        self.by_kind[key] = self.by_kind.get(key, 0.0) + seconds

    def run_optimizer(self, owned: list[tuple[int, int]]):
        """The AdamW update on an async-launch device, in the stream: per updated tensor the host dispatches
        (`optimizer.per_tensor_s`) and the device runs its share of the update (`per_elem_s`·elements); the
        device starts on a tensor once the host has dispatched it, while the queue still holds the backward."""
        o = self.prof.optimizer
        h, e, d0, c = o["per_tensor_s"], o["per_elem_s"], o.get("per_tensor_device_s", 0.0), o.get("per_step_s", 0.0)
        if c:  # the step's own dispatch before the first tensor (the clip's norm and scale launches)
            self.host += c
            self.host_total += c
            self.device = max(self.device, self.host)
        for n, _ in owned:
            self.host += h
            self.host_total += h
            d = d0 + e * n
            self.device = max(self.device, self.host) + d
            self.device_total += d
            self.by_kind["optimizer"] = self.by_kind.get("optimizer", 0.0) + d

    @property
    def elapsed(self) -> float:
        return max(self.host, self.device)


@dataclass
class StepSpec:
    """One training step on one rank: its micro-batches and the tensors its optimizer touches."""

    micro: MicroBatchSpec
    """One micro-batch (all of a step's are alike)."""
    micro_batches: int = 1
    """Micro-batches per step (gradient accumulation)."""
    grads: list = field(default_factory=list)
    """[(elements, bytes per element)] of the gradients this rank accumulates."""
    owned: list = field(default_factory=list)
    """[(elements, bytes per element)] of the tensors this rank's optimizer updates."""
    local_ranks: float = 1
    """Processes of the job computing at once on this rank's host (a profile's `shared_host` slowdown)."""


def step_compute(prof, spec: StepSpec, fast: bool = True) -> dict:
    """Compute seconds of one step on one rank (see StepSpec), with the breakdown. `fast`: every kernel list as one
    cached max-plus map (llmtrain/plan/maxplus.py), the optimizer's per-tensor kernels in closed form; False:
    kernel by kernel (the reference the fast path equals, tests/plan/test_fast_timeline.py)."""
    mbs = spec.micro
    unset = {k: v for k, v in (("e", prof.dtype_bytes), ("math_core", prof.math_attn is not None),
                               ("ce_core", "vocab_parallel_ce" in prof.mem_curves)) if getattr(mbs, k) is None}
    if unset:  # what the profile measured decides
        mbs = dataclasses.replace(mbs, **unset)
    micro_batches, grads, owned = spec.micro_batches, spec.grads, spec.owned
    mb = cached_micro_batch(mbs) if fast else micro_batch_kernels(mbs)
    slow = prof.shared_host_slowdown(spec.local_ranks)
    st = Stream(prof, slow, fast=fast, slow_key=spec.local_ranks)
    per_micro, per_step = prof.host.get("micro_batch_s", 0.0), prof.host.get("step_s", 0.0)
    fp8 = getattr(prof, "fp8", None)
    if fp8 is not None and fp8.weight_cache:  # train.fp8_weight_cache: each weight's FP8 copies once per step, in
        st.add_device(fp8.weight_seconds(mb.forward, mb.backward), "fp8_weights")  # the stream at its start
    # identical micro-batches: [loop + forward + backward] x m, repeated as run_segments repeats any segment
    st.run_segments([(None, micro_batches)], backward=False, body=lambda: (st.add_host(per_micro),
                                                                          st.run_segments(mb.forward_segments, False),
                                                                          st.run_segments(mb.backward_segments, True)))
    micro = st.elapsed / micro_batches
    st.add_host(per_step)
    clip = not prof.optimizer.get("includes_clip", False)
    if st.fast:  # the same kernels as one cached map (`optimizer_summary`)
        st.apply(optimizer_summary(st, grads, owned, micro_batches, clip))
    else:
        st.run(optimizer_kernels(grads, owned, micro_batches, clip=clip, accumulate_first=prof.async_launch),
               backward=True)
        if prof.async_launch:  # queued behind the backward like any dispatch: nothing synchronises before it
            st.run_optimizer(owned)
    if not prof.async_launch:
        st.add_serial(prof.optimizer_seconds(sum(n for n, _ in owned), len(owned)) * slow.get("optimizer", 1.0),
                      "optimizer")
    return {"compute_s": st.elapsed, "micro_batch_s": micro, "host_s": st.host_total, "device_s": st.device_total,
            "kernels_per_step": st.kernels, "by_kind_s": st.by_kind}


_MICRO: dict = {}


def cached_micro_batch(spec: MicroBatchSpec):
    """`micro_batch_kernels(spec)`, built once per distinct spec (the same lists, so their maps are cached too)."""
    key = (id(spec.cfg), *(repr(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name != "cfg"))
    hit = _MICRO.get(key)
    if hit is None or hit[0] is not spec.cfg:
        hit = _MICRO[key] = (spec.cfg, micro_batch_kernels(spec))  # the model kept alive with its id
    return hit[1]


_TOKENS: dict = {}
_TOKEN_OF: dict = {}


def _content_token(items: list) -> int:
    """A small int naming the content of `items` (equal contents, equal ints): computed once per list object (the
    planner passes the same cached lists, `estimate.rank_tensors`, thousands of times; a tuple of a thousand
    tensors is hashed anew on every lookup). The list is kept alive with its id and must not change."""
    hit = _TOKENS.get(id(items))
    if hit is not None and hit[0] is items:
        return hit[1]
    token = _TOKEN_OF.setdefault(tuple(items), len(_TOKEN_OF))
    _TOKENS[id(items)] = (items, token)
    return token


def optimizer_summary(st: Stream, grads: list, owned: list, micro_batches: int, clip: bool) -> Summary:
    """The step's kernels after the micro-batches as one map: `optimizer_kernels` (each gradient's accumulation
    adds, a run of identical kernels in closed form; the clip's kernels) then, on an async-launch device, the
    AdamW update per owned tensor as `Stream.run_optimizer` dispatches it. Cached per (gradients, owned tensors,
    micro-batches)."""
    prof = st.prof
    gpu = prof.async_launch
    key = ("optimizer", _content_token(grads), _content_token(owned), micro_batches, clip, st._slow_key)
    hit = st._maps.get(key)
    if hit is not None:
        return hit[1]
    grads_key = ("accumulate-map", _content_token(grads), micro_batches, st._slow_key)
    hit = st._maps.get(grads_key)  # the adds depend on the gradients only: one map per gradient list
    if hit is None:
        reps = max(0, micro_batches - (0 if gpu else 1))
        out = Summary()
        a, b, c, e = out.a, out.b, out.c, out.e
        host = device = 0.0
        kernels = 0
        adds = st._maps.setdefault(("accumulate", st._slow_key), {})  # elements -> (host s, device s) of one add
        if reps:
            for n, _ in grads:  # k = reps identical adds: (H, D) -> (H + k h, max(D + k d, H + max(h + k d, k h + d)))
                hd = adds.get(n)
                if hd is None:
                    hd = adds[n] = next(st._priced([mem("add", n, "launch" if gpu else "")], True, 0))[:2]
                h, d = hd
                if gpu:
                    A, C, E = reps * h, max(h + reps * d, reps * h + d), reps * d
                    a, b, c, e = a + A, b + A, max(a + C, c + E), max(b + C, e + E)
                else:
                    x = reps * (h + d)
                    a, b = a + x, b + x
                    c, e = a, b
                host += reps * h
                device += reps * d
                kernels += reps
        out = Summary(a, b, c, e, host, device, kernels, {"mem": device} if device else {})
        hit = st._maps[grads_key] = (grads_key, out)
    out = hit[1]
    if clip:  # the clip's kernels depend on the owned tensors only: one map per owned list
        clip_key = ("clip", _content_token(owned), st._slow_key)
        hit = st._maps.get(clip_key)
        if hit is None:
            hit = st._maps[clip_key] = (clip_key, st.summary(optimizer_kernels([], owned, micro_batches, clip=True),
                                                             True))
        out = out.then(hit[1])
    if gpu:  # Stream.run_optimizer: per tensor h of host, per_elem_s x elements of device
        adam_key = ("adam", _content_token(owned), st._slow_key)
        hit = st._maps.get(adam_key)  # one map per owned list
        if hit is None:
            o = prof.optimizer
            d0, c = o.get("per_tensor_device_s", 0.0), o.get("per_step_s", 0.0)
            adam = Summary()
            if c:  # Stream.run_optimizer's per-step dispatch: host only
                adam.kernel(c, 0.0, "optimizer", False, True)
            for n, _ in owned:
                adam.kernel(o["per_tensor_s"], d0 + o["per_elem_s"] * n, "optimizer", False, True)
            hit = st._maps[adam_key] = (adam_key, adam)
        out = out.then(hit[1])
    st._maps[key] = (key, out)
    return out
