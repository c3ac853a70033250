"""Model configuration: the `model` config group (`conf/model/*.yaml`).

    python llmtrain/pretrain.py model=llama-tiny model.num_layers=4

One dataclass describes the whole decoder family; GPT-2 style and Llama style
are presets of the switches below (see `conf/model/gpt-tiny.yaml`,
`conf/model/llama-tiny.yaml`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

FUSE_SWITCHES = ("fuse_rms_norm", "fuse_rope", "fuse_swiglu", "fuse_qkv", "fuse_ffn")
_FUSE_NEEDS = {"fuse_rms_norm": ("norm", "rmsnorm"), "fuse_rope": ("position", "rope"),
               "fuse_swiglu": ("activation", "swiglu"), "fuse_ffn": ("activation", "swiglu")}


def fusion_problems(model, on_gpu: bool) -> list[str]:
    """Each `model.fuse_*` must be auto/true/false; `true` must fit the architecture and, off GPU, have a CPU kernel."""
    from llmtrain.paddle_compat.kernels import CPU_KERNELS

    problems = []
    for switch in FUSE_SWITCHES:
        value = str(getattr(model, switch)).lower()
        if value not in ("auto", "true", "false"):
            problems.append(f"model.{switch}={getattr(model, switch)!r}: expected auto, true or false")
        elif value == "true":
            need = _FUSE_NEEDS.get(switch)
            if need is not None and getattr(model, need[0]) != need[1]:
                problems.append(f"model.{switch}=true needs model.{need[0]}={need[1]} "
                                f"(this model has {need[0]}={getattr(model, need[0])})")
            elif not on_gpu and not CPU_KERNELS[switch]:
                problems.append(f"model.{switch}=true: GPU-only (Paddle 3.3.1's CPU build has no working kernel, "
                                f"see llmtrain/paddle_compat/kernels.py); use auto or false on CPU")
    return problems


ROPE_SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")


@dataclass
class RopeScaling:
    """`model.rope_scaling`: how the rotary frequencies are scaled for contexts past the pretraining length, with
    the parameter sets Hugging Face's `rope_scaling` / `rope_parameters` publish (`llmtrain/models/rope.py`
    computes them; `Rotary.inv_freq()` uses them)."""

    type: str = "none"
    """`none`; `linear` (positions divided by factor: inv_freq / factor); `dynamic` (NTK-aware base that grows with
    the forward's length past original_max_position_embeddings); `yarn` (per-frequency blend of interpolated and
    original frequencies between beta_slow and beta_fast rotations, and an attention factor on cos/sin);
    `llama3` (Llama-3.1: long wavelengths / factor, short ones kept, a smooth blend between)."""

    factor: float = 1.0
    """Context extension factor s (all scaled types)."""

    original_max_position_embeddings: int = 0
    """The pretraining context length L the scaling is relative to (dynamic, yarn, llama3); 0:
    model.max_position_embeddings."""

    beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept (extrapolated)."""

    beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is fully interpolated (divided by factor)."""

    mscale: float = 0.0
    """YaRN (DeepSeek form): with mscale_all_dim, attention factor = m(factor, mscale) / m(factor, mscale_all_dim),
    m(s, a) = 0.1 a ln(s) + 1; 0: unset (factor = m(factor, 1))."""

    mscale_all_dim: float = 0.0
    """YaRN (DeepSeek form): see mscale; 0: unset."""

    attention_factor: Optional[float] = None
    """YaRN: the factor on cos and sin (so on every q.k score, squared), given explicitly; None: from mscale."""

    truncate: bool = True
    """YaRN: round the correction range to whole dimensions (floor/ceil), as published; false: keep it fractional."""

    low_freq_factor: float = 1.0
    """Llama-3: wavelengths above L / low_freq_factor are divided by factor."""

    high_freq_factor: float = 4.0
    """Llama-3: wavelengths below L / high_freq_factor are kept; in between a smooth blend."""


@dataclass
class ModelConfig:
    name: str = MISSING
    """Human-readable preset name (`gpt-tiny`, `llama-7b`, ...); used in run names."""

    family: str = "decoder"
    """Model family: `decoder` (causal LM, GPT/Llama style; objective: next token) or `encoder`
    (bidirectional, ERNIE/BERT style; objective: masked LM). The objective follows the family."""

    hidden_size: int = MISSING
    """Width of the residual stream, h."""

    num_layers: int = MISSING
    """Number of transformer blocks, L."""

    num_heads: int = MISSING
    """Attention (query) heads. hidden_size must be divisible by it unless head_dim is set."""

    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means num_heads (plain MHA)."""

    head_dim: Optional[int] = None
    """Width of one attention head (q, k and v). None: hidden_size / num_heads. Qwen3 sets 128 at any hidden
    size; q/k/v project to num_heads x head_dim (num_kv_heads x head_dim) and o back to hidden_size."""

    ffn_hidden_size: int = MISSING
    """Inner width of the feed-forward block (per gate/up projection for SwiGLU)."""

    vocab_size: Optional[int] = None
    """Rows of the embedding table. None: taken from the tokenizer (already padded to a multiple of 128)."""

    max_position_embeddings: int = 2048
    """Longest sequence the model supports (size of the learned position table; RoPE cache length)."""

    position: str = "learned"
    """Position encoding: `learned` (GPT-2 absolute table) or `rope` (rotary, Llama)."""

    rope_theta: float = 10000.0
    """RoPE base frequency (position=rope only)."""

    # --- attention variants (Qwen2/Qwen3 sliding windows, Qwen3 QK-norm, scaled RoPE) ---
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """Scaled RoPE for contexts past the pretraining length (`model.rope_scaling.type=yarn
    model.rope_scaling.factor=4 ...`); type none: plain RoPE."""

    qk_norm: bool = False
    """RMSNorm (eps norm_eps, one weight [head_dim] per projection shared by its heads) on every query and key head
    after the q/k projections and before RoPE (Qwen3)."""

    sliding_window: int = 0
    """Sliding-window attention: query t attends to keys t-W+1..t (W keys, itself included: Hugging Face's
    `sliding_window`); 0: full causal attention in every block. Decoder only."""

    sliding_window_layers: Optional[list] = None
    """Indices of the blocks that use the window; None: every block (when sliding_window > 0). Qwen2/Qwen3's
    use_sliding_window with max_window_layers=m is blocks m..L-1; their `layer_types` map one to one."""

    norm: str = "layernorm"
    """Normalisation: `layernorm` (GPT-2, with bias) or `rmsnorm` (Llama, no bias)."""

    norm_eps: float = 1e-5
    """Epsilon of every norm layer."""

    activation: str = "gelu_tanh"
    """Feed-forward activation: `gelu_tanh` (GPT-2's tanh approximation), `gelu` (exact erf), or `swiglu` (Llama: gate, up, down)."""

    bias: bool = True
    """Whether linear layers carry a bias (GPT-2 yes, Llama no)."""

    qkv_bias: Optional[bool] = None
    """Bias on the q, k and v projections, whatever `bias` says of the other linears (Qwen and Qwen2: true with
    bias=false, their only biases). None: as `bias`."""

    norm_position: str = "pre"
    """Where each block normalises: `pre` (x + f(norm(x)), GPT-2/Llama) or `post` (norm(x + f(x)), BERT/ERNIE)."""

    type_vocab_size: int = 0
    """Token-type (segment) embedding rows (encoder only; ERNIE 3.0: 4). 0: none."""

    task_type_vocab_size: int = 0
    """ERNIE 3.0 task-type embedding rows (`use_task_id`); 0: none."""

    task_id: int = 0
    """Task id fed to the task-type embedding when task_type_vocab_size > 0."""

    pad_token_id: int = 0
    """Encoder only: the word embedding is zero at this id (Paddle's `padding_idx`, as PaddleNLP's ERNIE).
    Attention masks only what an explicit `attention_mask` says (PaddleNLP also masks pad ids by default)."""

    tie_embeddings: bool = True
    """Share the input embedding table with the output projection."""

    init_std: float = 0.02
    """Standard deviation of the normal initialisation; output projections of each block use init_std / sqrt(2 L) (GPT-2)."""

    attention: str = "auto"
    """Attention kernel: `auto` (flash attention on GPU for fp16/bf16 activations, else the math path), `flash`, or `math`."""

    fuse_rms_norm: str = "auto"
    """Fused RMSNorm kernel (`paddle.incubate.nn.functional.fused_rms_norm`) for norm=rmsnorm: `auto` (on for GPU,
    off elsewhere), `true`, `false`. GPU-only: Paddle 3.3.1's CPU build crashes in it (see llmtrain/paddle_compat/kernels.py)."""

    fuse_rope: str = "auto"
    """Fused rotary embedding of q and k in one kernel (`fused_rotary_position_embedding`, rotate-half form) for
    position=rope: `auto` (on for GPU), `true`, `false`. GPU-only: no CPU kernel in Paddle 3.3.1."""

    fuse_swiglu: str = "auto"
    """One `paddle.incubate.nn.functional.swiglu` kernel for silu(gate) * up (activation=swiglu): `auto` (on for GPU),
    `true`, `false`. Has a CPU kernel; tested equal to the unfused path on CPU."""

    fuse_qkv: str = "auto"
    """q, k and v projections as one matmul (their weights concatenated at forward and again in backward, the
    concatenation never kept between them: `llmtrain/models/fused_linear.py`; under tp one all-reduce of the input
    gradient instead of three, under sequence parallelism one all-gather and one gathered copy kept instead of
    three): `auto` (on for GPU), `true`, `false`. Parameters and checkpoints keep the canonical q_proj/k_proj/v_proj
    names."""

    fuse_ffn: str = "auto"
    """gate and up projections (activation=swiglu) as one matmul, like fuse_qkv: `auto` (on for GPU), `true`,
    `false`. The routed experts always run gate and up as two batched GEMMs (no [E, h, 2f] copy)."""

    init_from: Optional[str] = None
    """PaddleNLP checkpoint directory (config.json + weights) to start from instead of random init."""

    hf_family: Optional[str] = None
    """The Hugging Face model type a `--format hf` / `paddleformers` export writes (`ernie4_5` for ERNIE 4.5, dense
    or MoE as the experts say; `llama`, `qwen2`, `qwen3`, `qwen3_moe`, `deepseek_v2`, `deepseek_v3`); null: the one
    the switches imply (`llmtrain.interop.hf_config.hf_family_for`). Set by the presets and imports of a family
    whose switches another one shares (a dense ERNIE 4.5 computes what a Llama does); computes nothing."""

    def fused(self, switch: str, gpu: Optional[bool] = None) -> bool:
        """Whether `switch` (`fuse_rms_norm`, `fuse_rope`, `fuse_swiglu`, `fuse_qkv`, `fuse_ffn`) is on here:
        `auto` means on for GPU and off on CPU; the path must also apply to this architecture. `gpu`: decide for
        a run on a GPU (True) or a CPU (False) instead of this process's device (the planner's case)."""
        value = str(getattr(self, switch)).lower()
        applies = {"fuse_rms_norm": self.norm == "rmsnorm", "fuse_rope": self.position == "rope",
                   "fuse_swiglu": self.activation == "swiglu", "fuse_ffn": self.activation == "swiglu",
                   "fuse_qkv": True}[switch]
        if value == "auto":
            if gpu is None:
                from llmtrain.paddle_compat.kernels import on_gpu

                gpu = on_gpu()
            return applies and gpu
        return applies and value == "true"

    moe_num_experts: int = 0
    """Routed experts per MoE layer (Mixture-of-Experts feed-forward, `llmtrain/models/moe.py`); 0: dense model."""

    moe_top_k: int = 2
    """Experts each token is sent to (Mixtral 2, Qwen1.5-MoE 4, DeepSeek-V2-Lite 6)."""

    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of one routed expert (fine-grained experts are narrower than the dense FFN); None: ffn_hidden_size."""

    moe_num_shared_experts: int = 0
    """Shared experts every token passes through, run as one FFN of width moe_num_shared_experts x moe_ffn_hidden_size."""

    moe_first_dense_layers: int = 0
    """The first k blocks keep a dense FFN of width ffn_hidden_size (DeepSeek's first_k_dense_replace)."""

    moe_router: str = "softmax"
    """Router scores: `softmax` over experts (Mixtral, Qwen) or per-expert `sigmoid` (DeepSeek-V3)."""

    moe_router_dtype: str = "fp32"
    """Precision of the routing under AMP (Megatron's `moe_router_dtype`): `fp32` runs the router GEMM (fp32
    weight, kept fp32 by O2's decorate, as the expert bias), the scores, top-k, the bias and the balancing losses,
    and the combine's weighted sum of the k expert outputs in fp32, whatever `train.amp` (PaddleFormers' ERNIE 4.5
    and Megatron-based configs do the same); `amp` is Megatron's unset value and llmtrain's old behaviour: the router
    GEMM and the combine in the activation dtype (bf16/fp16 under `train.amp`), the rest in fp32. Without AMP both
    are fp32."""

    moe_norm_topk: bool = True
    """Renormalise the top-k scores of a token to sum to 1 (Mixtral yes; Qwen1.5-MoE, DeepSeek-V2 no)."""

    moe_routed_scale: float = 1.0
    """Factor on the routed experts' weighted sum (DeepSeek's routed_scaling_factor)."""

    moe_aux_loss_coef: float = 0.01
    """Coefficient of the Switch/GShard load-balancing loss E * sum_i f_i P_i (per MoE layer, averaged over layers)."""

    moe_aux_loss_scope: str = "layer"
    """`layer`: the aux loss of each MoE layer, averaged over layers. `model`: one aux loss over all layers' choices
    and probabilities pooled (HF/PaddleNLP Mixtral's `load_balancing_loss_func`; set when a Mixtral is imported)."""

    moe_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss mean_t logsumexp(logits_t)^2 (ST-MoE), averaged over MoE layers."""

    moe_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after every step each expert's selection bias moves by this
    rate toward balance, b_i += rate * sign(mean load - load_i). 0: the bias is not moved (it stays zero, or what a
    checkpoint holds: DeepSeek-V3's `e_score_correction_bias` chooses experts whatever the rate)."""

    moe_capacity_factor: float = 0.0
    """0: dropless (every routed token is computed). > 0: each expert takes at most
    ceil(factor * tokens * top_k / experts) tokens of a micro-batch; the overflow is dropped and counted."""

    # ---- multi-head latent attention (DeepSeek-V2/V3, `llmtrain/models/mla.py`) and group-limited routing

    mla_kv_lora_rank: int = 0
    """Multi-head latent attention when > 0 (DeepSeek-V2/V3's `kv_lora_rank`, 512 in both): keys and values come
    from one compressed vector c_kv [kv_lora_rank] per position (RMSNorm, then kv_b_proj up to every head's
    no-RoPE key part and value); 0: the standard attention of `num_heads`/`num_kv_heads`/`head_dim`."""

    mla_q_lora_rank: Optional[int] = None
    """Queries through a compressed vector c_q [q_lora_rank] (RMSNorm, then q_b_proj; DeepSeek-V3 1536). None: one
    q_proj from the hidden state (DeepSeek-V2-Lite). MLA only."""

    mla_qk_nope_head_dim: int = 128
    """Per-head width of the query/key part without rotary embedding (DeepSeek's `qk_nope_head_dim`). MLA only."""

    mla_qk_rope_head_dim: int = 64
    """Width of the rotary part of queries and keys (`qk_rope_head_dim`); the rotary key is one vector per position
    shared by every head (decoupled RoPE). Queries and keys are nope + rope wide. MLA only."""

    mla_v_head_dim: int = 128
    """Per-head width of the values and of the attention output fed to o_proj (`v_head_dim`). MLA only."""

    moe_n_group: int = 1
    """Group-limited routing (DeepSeek's `n_group`): the routed experts form this many equal groups and a token
    chooses its top-k only among the `moe_topk_group` best groups. 1: no grouping."""

    moe_topk_group: int = 1
    """Groups a token may choose experts from (DeepSeek's `topk_group`; V3: 4 of 8)."""

    moe_group_score: str = "top2"
    """How a group is ranked: `top2` (the sum of its two best selection scores, bias included: DeepSeek-V3's
    `noaux_tc`) or `max` (its best score: DeepSeek-V2's `group_limited_greedy`)."""

    # ---- ERNIE 4.5's MoE placement (`moe_layer_start_index` = moe_first_dense_layers, `moe_layer_end_index`,
    # `moe_layer_interval`)

    moe_layer_interval: int = 1
    """Every n-th block is an MoE block: block i (0-based) has experts when (i + 1) % n == 0 (ERNIE 4.5's
    `moe_layer_interval`), besides i >= moe_first_dense_layers and i <= moe_last_layer. 1: every block."""

    moe_last_layer: Optional[int] = None
    """The last block that may have experts (ERNIE 4.5's `moe_layer_end_index`); None: the last block."""

    moe_aux_counts: str = "chosen"
    """What f_i of the aux loss counts: `chosen` (the experts chosen, expert_bias included) or `unbiased` (the top-k
    of the router probabilities without expert_bias: ERNIE 4.5's `moe_use_aux_free` loss). Equal while the bias is
    zero."""

    def is_mla(self) -> bool:
        """Whether the blocks use multi-head latent attention (`mla_kv_lora_rank > 0`)."""
        return self.mla_kv_lora_rank > 0

    def kv_heads(self) -> int:
        """Number of key/value heads actually used."""
        return self.num_kv_heads or self.num_heads

    def has_qkv_bias(self) -> bool:
        """Whether the q, k and v projections carry a bias (`qkv_bias`, else `bias`)."""
        return self.bias if self.qkv_bias is None else bool(self.qkv_bias)

    def layer_window(self, index: int) -> int:
        """The attention window of block `index` (`sliding_window`), 0 for full attention."""
        if self.sliding_window <= 0:
            return 0
        layers = self.sliding_window_layers
        return self.sliding_window if layers is None or index in layers else 0

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # a checkpoint manifest's plain dict
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    def attn_head_dim(self) -> int:
        """Per-head width: `head_dim`, or hidden_size / num_heads when it is None."""
        return self.head_dim or self.hidden_size // self.num_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` has a Mixture-of-Experts feed-forward."""
        if self.moe_num_experts <= 0 or index < self.moe_first_dense_layers:
            return False
        last = self.num_layers - 1 if self.moe_last_layer is None else self.moe_last_layer
        return index <= last and (index + 1) % max(self.moe_layer_interval, 1) == 0

    def expert_ffn_size(self) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size
