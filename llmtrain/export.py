"""Export a training checkpoint as one merged PaddleNLP model directory.

    python -m llmtrain.export --checkpoint outputs/RUN/checkpoints/step_1000 --output exported/ \\
        [--format paddlenlp] [--safetensors] [--tokenizer tokenizers/zh-32k] [--overwrite] [--merge-lora]
    # then: paddlenlp.transformers.AutoModelForCausalLM.from_pretrained("exported/")

--checkpoint takes a `step_<N>` directory, or a run directory (or its `checkpoints/`),
in which case the newest complete checkpoint is used. The checkpoint is verified
(manifest, sizes, sha256) before anything is read; its tensors, written by any
parallel layout, are assembled into full tensors (`llmtrain.checkpoint.shards`) and
written by `llmtrain.interop.write_paddlenlp_checkpoint` as a GPT (learned positions)
or Llama (RoPE) model, atomically. The tokenizer is included when --tokenizer is
given or the checkpoint's resolved config names one (`data.tokenizer`); its sha256
must equal the one the checkpoint recorded, so a model never ships with a tokenizer
it was not trained with. Weights are fp32; `--safetensors` writes `model.safetensors`
instead of the pickled `model_state.pdparams`.

A LoRA checkpoint (adapters only, with a pointer to its base in the manifest) is written
as PaddleNLP adapters (`lora_config.json` + `lora_model_state.pdparams`, or
`peft_model.safetensors`; `paddlenlp.peft.LoRAModel.from_pretrained(base, OUT)`), or with
`--merge-lora` as a plain model whose weights are W + A B alpha/r (`llmtrain.interop.lora_format`).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from typing import Optional

import numpy as np

from llmtrain.models.config import ModelConfig
from llmtrain.utils.log import log0


class ExportError(RuntimeError):
    """The checkpoint cannot be exported; the message names the directory and the reason."""


def resolve_checkpoint(path: str) -> str:
    """A `step_<N>` directory: `path` itself, or the newest complete one under `path` or `path/checkpoints`."""
    from llmtrain.checkpoint.manager import list_checkpoints, verify_files

    if os.path.isfile(os.path.join(path, "manifest.json")):
        problems = verify_files(path)
        if problems:
            raise ExportError(f"checkpoint {path} is incomplete or corrupt:\n  " + "\n  ".join(problems))
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
    raise ExportError(f"{path}: no complete checkpoint (step_<N>/ with a valid manifest.json) found"
                      + ("; skipped:\n  " + "\n  ".join(skipped) if skipped else ""))


def model_config_of(manifest: dict, ckpt_dir: str) -> ModelConfig:
    """The ModelConfig recorded in a checkpoint manifest."""
    recorded = manifest.get("model")
    if not isinstance(recorded, dict):
        raise ExportError(f"{ckpt_dir}/manifest.json has no 'model' section")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(recorded) - known)
    if unknown:
        raise ExportError(f"{ckpt_dir}/manifest.json: model fields this version does not know: {', '.join(unknown)}")
    return ModelConfig(**recorded)


def read_checkpoint_model(ckpt_dir: str) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """(ModelConfig, full canonical model tensors, manifest) of one verified checkpoint directory."""
    from llmtrain.checkpoint.shards import ShardIndex

    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        manifest = json.load(f)
    cfg = model_config_of(manifest, ckpt_dir)
    index = ShardIndex(ckpt_dir)
    try:
        state = {key[len("model/"):]: np.asarray(index.full(key), dtype=np.float32) for key in index.keys("model/")}
    finally:
        index.close()
    if not state:
        raise ExportError(f"{ckpt_dir}: no model tensors (keys 'model/...') in its rank_*.json files")
    return cfg, state, manifest


def tokenizer_for(manifest: dict, ckpt_dir: str, given: Optional[str]) -> Optional[str]:
    """The tokenizer to include: `given`, else the resolved config's `data.tokenizer`; checked against the manifest."""
    path = given
    if path is None and manifest.get("config"):
        from omegaconf import OmegaConf

        try:
            path = OmegaConf.select(OmegaConf.create(manifest["config"]), "data.tokenizer", default=None)
        except Exception:  # noqa: BLE001 - an unparsable config only means we cannot find the tokenizer
            path = None
        if path is not None and not os.path.exists(path):
            log0(f"export: the run's tokenizer {path} is not here; pass --tokenizer to include one")
            return None
    if path is None:
        return None
    recorded = (manifest.get("tokenizer") or {}).get("sha256")
    if recorded:
        from llmtrain.tokenizer import load_tokenizer

        model_file = load_tokenizer(path).model_file
        actual = hashlib.sha256(open(model_file, "rb").read()).hexdigest()
        if actual != recorded:
            raise ExportError(f"tokenizer {path} (sha256 {actual[:12]}…) is not the one checkpoint {ckpt_dir} was "
                              f"trained with (sha256 {recorded[:12]}…)")
    return path


def lora_of(manifest: dict):
    """The `LoraConfig` of a LoRA checkpoint (its manifest's "lora" entry), or None."""
    from llmtrain.models.lora import LoraConfig

    entry = manifest.get("lora")
    if not entry:
        return None
    return LoraConfig(rank=entry["rank"], alpha=entry["alpha"], dropout=entry["dropout"],
                      target_modules=list(entry["target_modules"]), merge=entry["merge"])


def base_state(cfg: ModelConfig, manifest: dict, ckpt_dir: str) -> dict[str, np.ndarray]:
    """The frozen base of a LoRA checkpoint, from its pointer: `model.init_from` (a PaddleNLP directory or one
    of our checkpoints) or, without one, the (seed, canonical name) initialisation."""
    base = manifest["lora"]["base"]
    src = base.get("init_from")
    if src is None:
        import paddle

        from llmtrain.models import build_model
        from llmtrain.models.stages import canonical_parameters
        from llmtrain.models.init import initial_value

        with paddle.LazyGuard():
            model = build_model(cfg)
        return {n: initial_value(n, p, cfg, int(base["seed"])) for n, p in canonical_parameters(model)}
    if not os.path.exists(src):
        raise ExportError(f"{ckpt_dir} stores LoRA adapters only; its base model.init_from={src} is not here")
    if os.path.exists(os.path.join(src, "manifest.json")):
        from llmtrain.checkpoint.shards import ShardIndex

        return {k: np.asarray(v, dtype=np.float32) for k, v in ShardIndex(src).model_state().items()}
    from llmtrain.interop import read_paddlenlp_checkpoint

    _, state, _ = read_paddlenlp_checkpoint(src)
    return {k: np.asarray(v, dtype=np.float32) for k, v in state.items()}


def export_checkpoint(checkpoint: str, output: str, fmt: str = "paddlenlp", safetensors: bool = False,
                      tokenizer: Optional[str] = None, overwrite: bool = False,
                      merge_lora: Optional[bool] = None) -> dict:
    """Export `checkpoint` (step dir or run dir) to `output`; returns what was written.

    A LoRA checkpoint becomes a PaddleNLP adapter directory (`lora_config.json` + weights, loadable with
    `paddlenlp.peft.LoRAModel.from_pretrained` on its base), or with `merge_lora` (default: the run's
    `finetune.lora.merge`) a plain PaddleNLP model with W + A B alpha/r."""
    if fmt != "paddlenlp":
        raise ExportError(f"--format {fmt!r}: only 'paddlenlp' is supported")
    from llmtrain.interop import write_paddlenlp_checkpoint

    ckpt_dir = resolve_checkpoint(checkpoint)
    cfg, state, manifest = read_checkpoint_model(ckpt_dir)
    tok = tokenizer_for(manifest, ckpt_dir, tokenizer)
    lora = lora_of(manifest)
    if lora is not None and not (lora.merge if merge_lora is None else merge_lora):
        from llmtrain.interop.lora_format import write_paddlenlp_lora

        info = write_paddlenlp_lora(cfg, lora, state, output, base=manifest["lora"]["base"].get("init_from"),
                                    safetensors=safetensors, overwrite=overwrite)
        info.update(family="LoRA adapters", notes=[f"base model: {manifest['lora']['base']}"],
                    checkpoint=ckpt_dir, tokenizer=None)
        return info
    if lora is not None:
        from llmtrain.interop.lora_format import merge_adapters

        state = merge_adapters(base_state(cfg, manifest, ckpt_dir), state, lora.alpha / lora.rank)
    elif merge_lora:
        raise ExportError(f"--merge-lora: {ckpt_dir} is not a LoRA checkpoint (its manifest has no 'lora' entry)")
    info = write_paddlenlp_checkpoint(cfg, state, output, safetensors=safetensors, tokenizer_dir=tok,
                                      overwrite=overwrite)
    info["checkpoint"] = ckpt_dir
    info["tokenizer"] = tok
    return info


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="step_<N> directory, or a run directory")
    parser.add_argument("--output", required=True, help="directory to create (PaddleNLP from_pretrained format)")
    parser.add_argument("--format", default="paddlenlp", choices=["paddlenlp"])
    parser.add_argument("--safetensors", action="store_true", help="write model.safetensors (default: pdparams)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory to include (default: the run's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output directory")
    parser.add_argument("--merge-lora", dest="merge_lora", action="store_true", default=None,
                        help="LoRA checkpoint: write the plain model with the adapters merged into its base")
    parser.add_argument("--no-merge-lora", dest="merge_lora", action="store_false",
                        help="LoRA checkpoint: write PaddleNLP adapters (lora_config.json + weights)")
    args = parser.parse_args(argv)
    from llmtrain.interop import CheckpointMismatch, UnsupportedConfig

    try:
        info = export_checkpoint(args.checkpoint, args.output, args.format, args.safetensors, args.tokenizer,
                                 args.overwrite, args.merge_lora)
    except (ExportError, UnsupportedConfig, CheckpointMismatch, FileExistsError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    print(f"exported {info['checkpoint']} -> {info['out_dir']} as PaddleNLP {info['family']} "
          f"({', '.join(info['files'])})")
    for note in info["notes"]:
        print(f"  note: {note}")
    if info["tokenizer"] is None and info["family"] != "LoRA adapters":
        print("  note: no tokenizer included (pass --tokenizer DIR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
