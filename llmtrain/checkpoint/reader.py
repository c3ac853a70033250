"""One way to read a checkpoint as a model: ours (`step_<N>/`, any layout) or a PaddleNLP directory.

    python -m llmtrain.export --checkpoint outputs/RUN --output exported/      # reads through here
    python -m llmtrain.generate --model outputs/RUN --prompt "..."           # so does generation
    ckpt = read_model("outputs/RUN")          # ModelCheckpoint(config, state, manifest, tokenizer, source)
    manifest = Manifest.read(find_checkpoint("outputs/RUN"))

Our checkpoints: `find_checkpoint` takes a `step_<N>` directory, or a run directory (or
its `checkpoints/`), whose newest complete checkpoint it returns; every file is verified
(manifest, sizes, sha256) before anything is read. `Manifest` is the typed manifest:
the model's architecture, the LoRA adapters and the pointer to their base, the resolved
run configuration and the tokenizer's identity. The tensors, written by any parallel
layout, come back as full tensors under their canonical names (`llmtrain.checkpoint.shards`).
PaddleNLP directories (`config.json` + weights) are read by `llmtrain.interop`.
`llmtrain.resolve` (`model.init_from`), `llmtrain.export` and `llmtrain.generate` all
read through this module.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from llmtrain.errors import CheckpointReadError
from llmtrain.models.config import ModelConfig
from llmtrain.utils.log import log0


@dataclass(frozen=True)
class Manifest:
    """The manifest.json of one of our checkpoints, typed."""

    path: str
    """The `step_<N>` directory."""
    step: Optional[int]
    model: ModelConfig
    """The architecture the tensors belong to."""
    lora: Optional[Any]
    """`llmtrain.models.lora.LoraConfig` of a LoRA checkpoint (its tensors are the adapters only), or None."""
    lora_base: Optional[dict]
    """Where a LoRA checkpoint's frozen base comes from: {"init_from": path or None, "seed": int}."""
    config: Optional[dict]
    """The run's resolved configuration (as saved), or None."""
    tokenizer: dict
    """The tokenizer's identity ({"sha256": ...}; empty when none was recorded)."""
    raw: dict
    """The whole manifest as read."""

    @classmethod
    def read(cls, ckpt_dir: str) -> "Manifest":
        with open(os.path.join(ckpt_dir, "manifest.json")) as f:
            raw = json.load(f)
        lora, base = None, None
        entry = raw.get("lora")
        if entry:
            from llmtrain.models.lora import LoraConfig

            lora = LoraConfig(rank=entry["rank"], alpha=entry["alpha"], dropout=entry["dropout"],
                              target_modules=list(entry["target_modules"]), merge=entry["merge"])
            base = entry["base"]
        return cls(path=ckpt_dir, step=raw.get("step"), model=model_config_of(raw, ckpt_dir), lora=lora,
                   lora_base=base, config=raw.get("config"), tokenizer=raw.get("tokenizer") or {}, raw=raw)


    def describe(self) -> str:
        """What the checkpoint is, for the commands that read it (`describe_manifest`)."""
        return describe_manifest(self.raw)


def describe_manifest(raw: dict) -> str:
    """`step 200 of run gpt-tiny-dp2 (model gpt-tiny, layout dp2, 409600 tokens)`: what export, generate and a
    resume name when they read a checkpoint (the run name is the writing run's `run.name`)."""
    from llmtrain.parallel.config import layout_tag

    name = "?"
    try:
        from omegaconf import OmegaConf

        name = OmegaConf.create(raw.get("config") or "").get("run", {}).get("name") or "?"
    except Exception:  # an old or foreign manifest: the step and model still say what it is
        pass
    model = (raw.get("model") or {}).get("name") or "?"
    layout = layout_tag(raw["layout"]) if isinstance(raw.get("layout"), dict) else "?"
    return f"step {raw.get('step')} of run {name} (model {model}, layout {layout}, {raw.get('tokens_total', '?')} tokens)"


@dataclass
class ModelCheckpoint:
    """A model read from a checkpoint."""

    config: ModelConfig
    state: Mapping[str, Any]
    """{canonical name: full tensor} (numpy fp32, or lazy where asked)."""
    manifest: Optional[Manifest]
    """Ours: the typed manifest; None for a PaddleNLP directory."""
    tokenizer: Optional[str]
    """The tokenizer directory that belongs to the model, or None when unknown."""
    source: str
    """`llmtrain` or `paddlenlp`."""


def is_paddlenlp_dir(path: str) -> bool:
    """A PaddleNLP model directory (config.json, and neither our manifest nor a run's checkpoints/)."""
    return (os.path.exists(os.path.join(path, "config.json")) and not os.path.exists(os.path.join(path, "manifest.json"))
            and not os.path.isdir(os.path.join(path, "checkpoints")))


def find_checkpoint(path: str) -> str:
    """A `step_<N>` directory: `path` itself, or the newest complete one under `path` or `path/checkpoints`."""
    from llmtrain.checkpoint.listing import list_checkpoints
    from llmtrain.checkpoint.verify import verify_files

    if os.path.isfile(os.path.join(path, "manifest.json")):
        problems = verify_files(path)
        if problems:
            raise CheckpointReadError(f"checkpoint {path} is incomplete or corrupt:\n  " + "\n  ".join(problems))
        return path
    root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    skipped = []
    for _, candidate in list_checkpoints(root):
        problems = verify_files(candidate)
        if not problems:
            for p in skipped:
                log0(f"export: skipped {p}")
            return candidate
        skipped.append("; ".join(problems))
    raise CheckpointReadError(f"{path}: no complete checkpoint (step_<N>/ with a valid manifest.json) found"
                              + ("; skipped:\n  " + "\n  ".join(skipped) if skipped else ""))


def model_config_of(manifest: dict, ckpt_dir: str) -> ModelConfig:
    """The ModelConfig recorded in a checkpoint manifest (a raw dict)."""
    recorded = manifest.get("model")
    if not isinstance(recorded, dict):
        raise CheckpointReadError(f"{ckpt_dir}/manifest.json has no 'model' section")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(recorded) - known)
    if unknown:
        raise CheckpointReadError(f"{ckpt_dir}/manifest.json: model fields this version does not know: "
                                  f"{', '.join(unknown)}")
    return ModelConfig(**recorded)


def model_state(manifest: Manifest, lazy: bool = False) -> Mapping[str, Any]:
    """{canonical name: full tensor} of the checkpoint's model tensors: numpy fp32, or lazy (read on access)."""
    from llmtrain.checkpoint.shards import ShardIndex

    index = ShardIndex(manifest.path)
    if lazy:
        return index.model_state()
    try:
        state = {key[len("model/"):]: np.asarray(index.full(key), dtype=np.float32) for key in index.keys("model/")}
    finally:
        index.close()
    if not state:
        raise CheckpointReadError(f"{manifest.path}: no model tensors (keys 'model/...') in its rank_*.json files")
    return state


def base_state(manifest: Manifest) -> dict[str, np.ndarray]:
    """The frozen base of a LoRA checkpoint, from its pointer: `model.init_from` (a PaddleNLP directory or one
    of our checkpoints) or, without one, the (seed, canonical name) initialisation."""
    base, cfg = manifest.lora_base, manifest.model
    src = base.get("init_from")
    if src is None:
        from llmtrain.models import build_model, shape_only
        from llmtrain.models.init import initial_value
        from llmtrain.models.stages import canonical_parameters

        with shape_only():
            model = build_model(cfg)
        return {n: initial_value(n, p, cfg, int(base["seed"])) for n, p in canonical_parameters(model)}
    if not os.path.exists(src):
        raise CheckpointReadError(f"{manifest.path} stores LoRA adapters only; its base model.init_from={src} is "
                                  "not here")
    if os.path.exists(os.path.join(src, "manifest.json")):
        from llmtrain.checkpoint.shards import ShardIndex

        return {k: np.asarray(v, dtype=np.float32) for k, v in ShardIndex(src).model_state().items()}
    from llmtrain.interop import read_paddlenlp_checkpoint

    _, state, _ = read_paddlenlp_checkpoint(src)
    return {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}


def merged_state(manifest: Manifest, adapters: Mapping[str, Any]) -> dict:
    """A LoRA checkpoint's adapters merged into its base: W + A B alpha / r (a plain model's state)."""
    from llmtrain.interop.lora_format import merge_adapters

    return merge_adapters(base_state(manifest), adapters, manifest.lora.alpha / manifest.lora.rank)


def tokenizer_of(manifest: Manifest, given: Optional[str] = None) -> Optional[str]:
    """The tokenizer that belongs to the model: `given`, else the resolved config's `data.tokenizer`; its sha256
    checked against the one the checkpoint recorded (a mismatch raises CheckpointReadError)."""
    path = given
    if path is None and manifest.config:
        from omegaconf import OmegaConf

        try:
            path = OmegaConf.select(OmegaConf.create(manifest.config), "data.tokenizer", default=None)
        except Exception:  # noqa: BLE001 - an unparsable config only means we cannot find the tokenizer
            path = None
        if path is not None and not os.path.exists(path):
            log0(f"export: the run's tokenizer {path} is not here; pass --tokenizer to include one")
            return None
    if path is None:
        return None
    recorded = manifest.tokenizer.get("sha256")
    if recorded:
        from llmtrain.tokenizer import load_tokenizer

        model_file = load_tokenizer(path).model_file
        actual = hashlib.sha256(open(model_file, "rb").read()).hexdigest()
        if actual != recorded:
            raise CheckpointReadError(f"tokenizer {path} (sha256 {actual[:12]}…) is not the one checkpoint "
                                      f"{manifest.path} was trained with (sha256 {recorded[:12]}…)")
    return path


def read_paddlenlp(path: str, trusted: bool = False, lazy: bool = False) -> ModelCheckpoint:
    """A PaddleNLP model directory (config.json + weights; `llmtrain.interop`) as a `ModelCheckpoint`."""
    from llmtrain.interop import read_paddlenlp_checkpoint

    cfg, state, meta = read_paddlenlp_checkpoint(path, trusted=trusted, lazy=lazy)
    tok = meta.get("tokenizer_model") if isinstance(meta, dict) else None
    return ModelCheckpoint(cfg, state, None, tok, "paddlenlp")


def read_model(path: str, trusted: bool = False, merge_lora: bool = True, lazy: bool = False) -> ModelCheckpoint:
    """The model in `path`: a PaddleNLP directory, or our checkpoint (a step directory or a run's newest complete
    one), with a LoRA checkpoint's adapters merged into its base unless `merge_lora` is False (then the state is
    the adapters alone). `trusted`: a PaddleNLP directory's pickled weights may be loaded; `lazy`: tensors are
    read on access (not with a LoRA merge)."""
    if is_paddlenlp_dir(path):
        return read_paddlenlp(path, trusted, lazy)
    manifest = Manifest.read(find_checkpoint(path))
    merge = manifest.lora is not None and merge_lora
    state = model_state(manifest, lazy=lazy and not merge)
    if merge:
        state = merged_state(manifest, state)
    return ModelCheckpoint(manifest.model, state, manifest, tokenizer_of(manifest), "llmtrain")
