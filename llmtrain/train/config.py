"""Training and optimizer configuration: the `train` and `optim` config groups.

    python llmtrain/pretrain.py train.max_steps=100 train.global_batch_size=32 optim.lr=6e-4
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from llmtrain.fp8.emulate import FP8Emulate
from llmtrain.train.anomaly import AnomalyConfig


@dataclass
class TrainConfig:
    max_steps: int = 20
    """Optimizer steps to run (the run ends after step max_steps)."""

    global_batch_size: Optional[int] = 8
    """Samples per optimizer step over all data-parallel ranks, G = micro_batch_size x grad_accum x (dp x sharding)."""

    micro_batch_size: Optional[int] = None
    """Samples per forward/backward on one rank (the pipeline's micro-batch). None: derived from the others."""

    grad_accum: Optional[int] = None
    """Micro-batches accumulated per step on each rank (the pipeline's accumulate_steps). None: derived."""

    batch_rampup: Optional[List[int]] = None
    """[START, INCREMENT, SAMPLES] (Megatron's --rampup-batch-size): the global batch starts at START and grows by
    INCREMENT in equal steps of consumed samples until global_batch_size at SAMPLES; micro_batch_size stays, the
    accumulation follows. START and INCREMENT must be multiples of micro x data-parallel; 1F1B pipelines ramp,
    interleaved ones are refused. The LR schedule follows consumed samples (position = consumed samples /
    global_batch_size, as Megatron's). None: off."""

    log_interval: int = 1
    """Write a metrics record every this many steps (and at the last step): a metrics.jsonl line, a log line on rank 0
    (step/total, loss, lr, grad norm, tokens/s, TFLOP/s, MFU, GPU memory, fp16 loss scale, data wait, anomalies),
    VisualDL scalars and the progress bar's position."""

    eval_interval: int = 0
    """Evaluate on the validation split every this many steps; 0 disables."""

    eval_batches: int = 4
    """Validation micro-batches per evaluation."""

    amp: str = "none"
    """Mixed precision: `none` (fp32), `bf16` or `fp16` (AMP O2: low-precision weights, fp32 master weights; fp16 adds a GradScaler).
    On CPU Paddle's AMP is a no-op: the O2 code path runs in fp32 and a warning says so."""

    main_grad: Optional[bool] = None
    """fp32 gradient accumulation buffers beside the parameters (PaddleNLP's amp_master_grad;
    llmtrain/train/main_grad.py). None: on exactly when a parallel option needs it (the fused-buffer ones:
    parallel.sharding_split_param, sharding_tensor_fusion, sharding_comm_overlap, dp_comm_overlap,
    pp_sharding_comm_overlap). In fp32 the same numbers; under bf16/fp16 micro-batch gradients are summed in fp32."""

    fp8: str = "none"
    """FP8 compute of the transformer's linears and routed experts (llmtrain/fp8, docs/fp8.md): `none`, `blockwise`
    (DeepSeek-V3's recipe: 1x128 activation tiles, 128x128 weight blocks, power-of-two scales, e4m3) or `tensorwise`
    (one current-amax scale per tensor, e4m3 forward, e5m2 gradients). Embeddings, LM head, router and norms stay
    as they are; master weights, optimizer states and checkpoints are unchanged (switchable at resume). On CPU the
    recipe is emulated (Paddle's casts to FP8, dequantised, fp32 GEMM); on a GPU `blockwise` runs Paddle's FP8
    kernels and `tensorwise` is refused (no Paddle 3.3.1 kernel with a backward)."""

    fp8_weight_cache: bool = True
    """With train.fp8, quantise each linear's weight once per optimizer step and reuse it in every micro-batch
    (Transformer Engine's is_first_microbatch; llmtrain/fp8/cache.py): the same numbers, the copies held from the
    step's first forward to its end. false: quantised again in every micro-batch."""

    fp8_emulate: FP8Emulate = field(default_factory=FP8Emulate)
    """With train.fp8 on CPU, quantise as the ranks of a tp / sequence-parallel / cp layout would (`tp`,
    `sequence_parallel`, `cp`; llmtrain/fp8/emulate.py): one process as the FP8 reference of that layout. Default:
    none (the process quantises what it holds)."""

    recompute: str = "none"
    """Activation recompute (llmtrain/models/recompute.py): `none`, `full` (whole blocks), `full_attn` (the attention
    sub-block), `core_attn` (softmax(q k^T) v only) or `selective` (only `recompute_modules`); `true` is `full` and
    `false` is `none`."""

    recompute_modules: List[str] = field(default_factory=list)
    """Parts recomputed in addition to the mode's (Megatron-Core's names): core_attn, mlp, moe, moe_act,
    shared_experts, norm."""

    recompute_layers: str = "all"
    """Which blocks recompute: `all`, `every:N` (every N-th block of each pipeline chunk, from its first) or `first:K`
    (the first K blocks of each pipeline chunk)."""

    offload_activations: bool = False
    """Keep each fully recomputed block's input (`recompute=full`) in pinned host memory between its forward and its
    backward, brought back one block ahead (llmtrain/paddle_compat/offload.py; GPU-only copies, rehearsed on CPU)."""

    offload_optimizer: bool = False
    """Keep the optimizer state (Adam moments, fp32 master weights) in host memory between steps, moved to the device
    for the update and back after it, as PaddleFormers' `offload_optim` (llmtrain/paddle_compat/offload.py)."""

    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device for MFU. None: 989 on H100/H200 (bf16), a measured matmul peak on CPU, else unknown (mfu null)."""

    hang_timeout_s: float = 1800.0
    """Watchdog: end the rank (status 4, Python stacks of every thread in its log) when no step completes for this
    many seconds (checkpoint saves excluded: they have checkpoint.timeout_minutes). 0 disables the watchdog."""

    peer_timeout_s: float = 30.0
    """Watchdog: end this rank (status 3, naming the peer) when another rank's heartbeat file under
    <run.dir>/heartbeat has not changed for this many seconds (a dead process on this host is seen at once)."""

    progress_bar: bool = True
    """Show a tqdm progress bar with loss, tokens/s and MFU on rank 0 when its stderr is a terminal (never in the
    launcher's workerlog files). The per-interval log lines are written either way."""

    visualdl: bool = True
    """Log metrics to VisualDL under <run.dir>/visualdl on rank 0."""

    loss_curve: bool = True
    """At the end of the run, draw metrics.jsonl as <run.dir>/loss_curve.png on rank 0 (matplotlib: about a second
    of CPU per plot, plus its import; `python -m llmtrain.train.plot <run.dir>/metrics.jsonl` draws it later)."""

    metrics_port: Optional[int] = None
    """Serve Prometheus metrics at http://<node>:<metrics_port + local rank>/metrics from every rank; None: off."""

    metrics_job: Optional[str] = None
    """The `job` label of the Prometheus metrics; None: the basename of run.dir."""

    metrics_linger_s: float = 0.0
    """After the run, keep serving the Prometheus metrics this many seconds so the final values get scraped."""

    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)
    """Divergence guard: non-finite and spike detection, re-run check, skip/rewind/stop (llmtrain/train/anomaly.py,
    docs/divergence.md)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer: `adamw` (decoupled weight decay, none on norms and biases)."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""

    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""

    warmup_steps: int = 2
    """Linear warmup from 0 to lr over this many steps."""

    decay_steps: Optional[int] = None
    """Steps (counted from 0, warmup included) over which lr decays to min_lr; None: train.max_steps."""

    schedule: str = "cosine"
    """After warmup: `cosine`, `linear` or `constant` decay over the whole horizon, or `wsd` (warmup-stable-decay:
    lr held until the decay start, then `decay_shape` to min_lr at the end of the horizon)."""

    decay_fraction: Optional[float] = None
    """WSD: the last fraction of the horizon (decay_steps, else train.max_steps) spent decaying, in (0, 1];
    the decay starts at step horizon - round(fraction x horizon). None with no decay_start_step: 0.2."""

    decay_start_step: Optional[int] = None
    """WSD: the step at which the decay starts (overrides decay_fraction). Set it at resume to cool down a
    stable-phase checkpoint from that step on (`optim.on_resume=config` if it moves the resume step's LR)."""

    decay_shape: str = "1-sqrt"
    """WSD decay shape over progress p in [0, 1]: `linear` (1 - p), `cosine` (0.5 (1 + cos pi p)) or `1-sqrt` (1 - sqrt p)."""

    on_resume: Optional[str] = None
    """At a resume whose LR-schedule fields (train.max_steps, lr, min_lr, warmup_steps, decay_steps, schedule,
    decay_*) differ from the checkpoint's: `config` uses this config's schedule from the resume step on,
    `checkpoint` keeps the checkpoint's (its horizon too); None refuses a change that moves the resume
    step's LR by more than 1e-3 relative (see `llmtrain/train/contract.py` and docs/changing-runs.md)."""

    weight_decay: float = 0.1
    """Decoupled weight decay for matrices and embeddings (not norms and biases)."""

    beta1: float = 0.9
    """AdamW beta1."""

    beta2: float = 0.95
    """AdamW beta2."""

    eps: float = 1e-8
    """AdamW epsilon."""

    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (over all ranks); 0 disables clipping (the norm is still logged)."""
