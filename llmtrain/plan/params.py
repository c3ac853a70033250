"""The planner's parameter list, read off the model itself (built lazily: no memory is allocated).

    python -m pytest tests/plan/test_plan.py -q -k parameter
    specs = model_param_specs(model_cfg, lora=None)     # [ParamSpec] in canonical_parameters order

`llmtrain.models.shape_only` (a LazyGuard that leaves Paddle's naming counters alone) builds the single-device
model of `model.family` (`llmtrain.models.build_model`, plain `Roles`), LoRA adapters attached as the trainer
attaches them; every parameter's canonical name and shape come from it, and where a tensor-parallel plan would
split it from the tags the model's layers carry (read in one place, `split_axis_of`):
- a column linear (`linear` tag kind "column", `llmtrain.contracts.tags`): weight [in, out] on axis 1, bias on 0; a row linear: weight on
  axis 0, bias whole (fleet's Megatron layout: `ColumnParallelLinear` / `RowParallelLinear`); a replicated linear
  ("replicated", MLA's down-projections): whole;
- the vocabulary embedding (`role` tag "vocab_embedding"): rows, axis 0; the untied output linear
  ("output_linear"): axis 1; an output bias over the vocabulary ("output_bias"): axis 0;
- LoRA adapters: A [in, r] on axis 0 under a row linear, B [r, out] on axis 1 under a column linear;
- routed experts (`expert_axis` tag): stacked [E, ...], divided over expert-parallel ranks, whole over tp.
Pipeline position from the canonical prefix (`embed*` first, `layers.N` block N, the rest last); LayerNorm
parameters (kept fp32 under O2) from the owning layer's type; no gradient (`stop_gradient`, the MoE expert
bias) frozen; under LoRA everything but the adapters untrained. A new model family needs no planner change.

Building the model needs paddle (seconds to import on a 2-core host), so the list is also kept on disk:
$LLMTRAIN_CACHE_DIR/param_specs/ (else $XDG_CACHE_HOME or ~/.cache, /llmtrain/param_specs), one JSON file per
(model config, LoRA config, source of every llmtrain module, the installed paddle's version file). A ranking whose
list is there never imports paddle; any edit of llmtrain or another paddle builds it again.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path

from llmtrain.contracts.tags import is_expert, linear_of, role_of

@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple
    split_axis: int | None
    """Axis divided over tp ranks (None: whole on every tp rank)."""
    chunk: object
    """Where it sits in the stage list: "first", a block index, or "last" (final norm, head)."""
    layernorm: bool = False
    """An `nn.LayerNorm` parameter (Paddle's O2 keeps it fp32)."""
    expert: bool = False
    """Stacked routed experts [E, ...]: axis 0 divided over ep ranks, whole over tp."""
    frozen: bool = False
    """No gradient and no optimizer state (the MoE expert bias, moved outside the gradient)."""
    trainable: bool = True
    """False for the frozen base under LoRA: no optimizer state, no gradient."""

    @property
    def numel(self) -> int:
        return prod(self.shape)



ROLE_AXES = {"vocab_embedding": {"weight": 0}, "output_linear": {"weight": 1}}
LINEAR_AXES = {"column": {"weight": 1, "bias": 0}, "row": {"weight": 0}, "replicated": {}}


def split_axis_of(layer, pname: str, param):
    """The tensor-parallel split axis of `layer`'s parameter `pname` (None: whole on every tp rank), from the
    model's own tags. The one place the planner reads them."""
    if is_expert(param):
        return None
    if role_of(param) == "output_bias":
        return 0
    if pname in ("lora_A", "lora_B"):
        kind = (linear_of(layer) or (None,))[0]
        return 0 if (pname, kind) == ("lora_A", "row") else 1 if (pname, kind) == ("lora_B", "column") else None
    role = role_of(layer)
    if role in ROLE_AXES:
        return ROLE_AXES[role].get(pname)
    kind = linear_of(layer)
    if kind is not None:
        return LINEAR_AXES[kind[0]].get(pname)
    return None


def _chunk(name: str):
    if name.startswith("embed"):
        return "first"
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return "last"


_CACHE: dict = {}


def _specs(cfg, lora) -> tuple:
    import paddle.nn as nn

    from llmtrain.models import build_model, shape_only
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.roles import Roles

    with shape_only():
        model = build_model(cfg)
        if lora is not None:
            from llmtrain.models.lora import attach_lora

            attach_lora(model, lora, Roles())
    owner = {id(p): (layer, n) for layer in model.sublayers(include_self=True)
             for n, p in layer.named_parameters(include_sublayers=False)}
    out = []
    for name, p in canonical_parameters(model):
        layer, pname = owner[id(p)]
        adapter = pname in ("lora_A", "lora_B")
        out.append(ParamSpec(name, tuple(int(d) for d in p.shape), split_axis_of(layer, pname, p), _chunk(name),
                             layernorm=isinstance(layer, nn.LayerNorm),
                             expert=is_expert(p),
                             frozen=bool(p.stop_gradient) and not adapter,
                             trainable=lora is None or adapter))
    return tuple(out)


_SOURCE: list = []


def _source_digest() -> str:
    """sha256 of every llmtrain module's path and text and of the installed paddle's version file (found without
    importing paddle): what the built parameter list depends on besides the configs."""
    if not _SOURCE:
        import importlib.util

        h = hashlib.sha256()
        root = Path(__file__).resolve().parents[1]  # llmtrain/
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
        spec = importlib.util.find_spec("paddle")
        version = Path(spec.origin).parent / "version" / "__init__.py" if spec and spec.origin else None
        h.update(version.read_bytes() if version is not None and version.exists() else b"no paddle")
        _SOURCE.append(h.hexdigest())
    return _SOURCE[0]


def _cache_file(key: tuple) -> Path:
    base = os.environ.get("LLMTRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmtrain")
    digest = hashlib.sha256(json.dumps([*key, _source_digest()]).encode()).hexdigest()
    return Path(base) / "param_specs" / f"{digest}.json"


def _from_disk(key: tuple):
    """The list stored for `key` by an earlier process, or None (absent, unreadable or of another layout)."""
    try:
        with open(_cache_file(key)) as f:
            rows = json.load(f)
        return tuple(ParamSpec(**{**r, "shape": tuple(r["shape"])}) for r in rows)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _to_disk(key: tuple, specs: tuple) -> None:
    """Store the list (written to a temporary name, then renamed: readers never see half a file); a read-only
    or full disk only costs the next process the build."""
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps([asdict(s) for s in specs]))
        os.replace(tmp, path)
    except OSError:
        pass


def model_param_specs(cfg, lora=None) -> list:
    """Every parameter of the single-device model (a tied table once), with its tp split axis and stage."""
    lora = lora if lora is not None and lora.rank > 0 else None
    key = (repr(cfg), repr(lora))
    if key not in _CACHE:
        specs = _from_disk(key)
        if specs is None:
            specs = _specs(cfg, lora)
            _to_disk(key, specs)
        _CACHE[key] = specs
    return list(_CACHE[key])
