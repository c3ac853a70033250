"""Export a training checkpoint as one merged PaddleNLP, Hugging Face-layout or PaddleFormers model directory.

    python -m llmtrain.export --checkpoint outputs/RUN/checkpoints/step_1000 --output exported/ \\
        [--format auto|paddlenlp|hf|paddleformers] [--safetensors] [--tokenizer tokenizers/zh-32k] [--overwrite] \\
        [--merge-lora]
    # then: paddlenlp.transformers.AutoModelForCausalLM.from_pretrained("exported/")   (--format paddlenlp)
    #   or: transformers' AutoModelForCausalLM.from_pretrained("exported/")          (--format hf)
    #   or: paddleformers.transformers.AutoModelForCausalLM.from_pretrained("exported/")   (--format paddleformers)

--format: `paddlenlp` (GPT, Llama, Qwen, Mixtral, ERNIE), `hf` (Hugging Face Llama, Qwen2, Qwen3, Qwen3-MoE,
DeepSeek-V2/V3 or an ERNIE 4.5 `-PT` style directory: config.json + safetensors shards + index,
`llmtrain.interop.hf_format`; ERNIE 4.5 when `model.hf_family` says so, as its presets and imports do),
`paddleformers` (ERNIE 4.5 as PaddleFormers 1.2.0's save_pretrained writes it, `llmtrain.interop.ernie45`), or
`auto` (the default): the format the run started from (`model.init_from`: a PaddleFormers ERNIE 4.5 directory ->
paddleformers, another Hugging Face-layout one -> hf), else the first the model can be written in (`auto_format`:
paddleformers for ERNIE 4.5 presets, paddlenlp before hf otherwise). A format the model cannot be written in is
refused before any tensor is read, naming the formats it can be (`llmtrain.interop.formats`).

--checkpoint takes a `step_<N>` directory, or a run directory (or its `checkpoints/`),
in which case the newest complete checkpoint is used (the command names the run and step it read) (`llmtrain.checkpoint.reader`, the
reader generation and `model.init_from` use too). The checkpoint is verified
(manifest, sizes, sha256) before anything is read; its tensors, written by any
parallel layout, are assembled into full tensors (`llmtrain.checkpoint.shards`) and
written by `llmtrain.interop.write_paddlenlp_checkpoint` as a GPT (learned positions)
or Llama (RoPE) model, atomically. The tokenizer is included when --tokenizer is
given or the checkpoint's resolved config names one (`data.tokenizer`); its sha256
must equal the one the checkpoint recorded, so a model never ships with a tokenizer
it was not trained with. config.json's bos/eos/pad token ids, in every format, are that tokenizer's (the ones
the checkpoint recorded when none is shipped), checked against the tokenizer files shipped beside them (which
name its bos/eos/pad/unk pieces). Weights are fp32; `--safetensors` writes `model.safetensors`
instead of the pickled `model_state.pdparams`.

A LoRA checkpoint (adapters only, with a pointer to its base in the manifest) is written
as PaddleNLP adapters (`lora_config.json` + `lora_model_state.pdparams`, or
`peft_model.safetensors`; `paddlenlp.peft.LoRAModel.from_pretrained(base, OUT)`), or with
`--merge-lora` as a plain model whose weights are W + A B alpha/r (`llmtrain.interop.lora_format`). With
`--format hf` (or auto from a Hugging Face source) the adapters are always merged: no Hugging Face (PEFT) adapter
format is written. With `--format paddleformers` (an ERNIE 4.5 run) they are merged unless `--no-merge-lora` asks
for PaddleFormers' adapter files (`llmtrain.interop.ernie45_lora`).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from llmtrain.checkpoint.reader import Manifest, find_checkpoint, merged_state, model_state, tokenizer_of
from llmtrain.errors import CheckpointReadError
from llmtrain.interop.tokenizer_files import recorded_token_ids
from llmtrain.utils.cli import ArgumentParser


class ExportError(CheckpointReadError):
    """The checkpoint cannot be exported; the message names the directory and the reason."""


def source_format(init_from: Optional[str]) -> str:
    """`paddleformers` when `init_from` is an ERNIE 4.5 directory written by PaddleFormers, `hf` when it is another
    Hugging Face-layout directory (Llama, Qwen2/3, Qwen3-MoE, DeepSeek, an ERNIE 4.5 `-PT` release; still present),
    else `paddlenlp`."""
    family = source_family(init_from)
    if family is None:
        return "paddlenlp"
    from llmtrain.interop import ernie45
    from llmtrain.interop.paddlenlp_format import read_config

    if family in ernie45.ARCHITECTURES and ernie45.layout_of(read_config(init_from)) == "paddleformers":
        return "paddleformers"
    return "hf"


def source_family(init_from: Optional[str]) -> Optional[str]:
    """The Hugging Face model type of `init_from` (`hf_format.hf_family`), None for PaddleNLP or a missing dir."""
    if not init_from or not os.path.isfile(os.path.join(init_from, "config.json")):
        return None
    from llmtrain.interop.hf_format import hf_family
    from llmtrain.interop.paddlenlp_format import read_config

    return hf_family(read_config(init_from), init_from)


def auto_format(cfg) -> str:
    """`--format auto`: the format of the Hugging Face-layout directory the run started from, else the first format
    the model can be written in: ERNIE 4.5 (`model.hf_family`) paddleformers, another `hf_family` hf, else paddlenlp
    before hf (a Qwen3 preset run goes out as hf, a Llama one as paddlenlp)."""
    from llmtrain.interop import ernie45
    from llmtrain.interop.formats import export_formats

    if source_family(cfg.init_from) is not None:
        return source_format(cfg.init_from)
    order = (["paddleformers", "hf"] if cfg.hf_family in ernie45.ARCHITECTURES else
             ["hf", "paddlenlp"] if cfg.hf_family else ["paddlenlp", "hf"])
    can = export_formats(cfg)
    return next((f for f in order if can[f] is None), order[0])


def _model_for_export(cfg):
    """`cfg` with `hf_family` filled in for checkpoints written before it was recorded: ERNIE 4.5 when the run
    started from an ERNIE 4.5 directory that is still there (its dense blocks are a Llama's)."""
    import dataclasses

    from llmtrain.interop import ernie45

    if cfg.hf_family is None and source_family(cfg.init_from) in ernie45.ARCHITECTURES:
        return dataclasses.replace(cfg, hf_family="ernie4_5")
    return cfg


def check_format(cfg, fmt: str, ckpt_dir: str) -> None:
    """Refuse, before any tensor is read, a format the model cannot be written in, naming those it can."""
    from llmtrain.interop.formats import describe_formats, written_as
    from llmtrain.interop.keys import UnsupportedConfig

    try:
        written_as(cfg, fmt)
    except UnsupportedConfig as e:
        raise ExportError(f"{ckpt_dir}: --format {fmt}: {e}. This model can be exported as: "
                          f"{describe_formats(cfg)}") from None


def export_checkpoint(checkpoint: str, output: str, fmt: str = "auto", safetensors: bool = False,
                      tokenizer: Optional[str] = None, overwrite: bool = False,
                      merge_lora: Optional[bool] = None) -> dict:
    """Export `checkpoint` (step dir or run dir) to `output`; returns what was written.

    A LoRA checkpoint becomes a PaddleNLP adapter directory (`lora_config.json` + weights, loadable with
    `paddlenlp.peft.LoRAModel.from_pretrained` on its base), or with `merge_lora` (default: the run's
    `finetune.lora.merge`) a plain PaddleNLP model with W + A B alpha/r."""
    if fmt not in ("auto", "paddlenlp", "hf", "paddleformers"):
        raise ExportError(f"--format {fmt!r}: expected auto, paddlenlp, hf or paddleformers")
    from llmtrain.interop import write_paddlenlp_checkpoint

    manifest = Manifest.read(find_checkpoint(checkpoint))
    ckpt_dir, cfg, lora = manifest.path, _model_for_export(manifest.model), manifest.lora
    if fmt == "auto":
        fmt = auto_format(cfg)
    if lora is None or fmt == "hf":  # the model itself is written (adapter files are checked by their writers)
        check_format(cfg, fmt, ckpt_dir)
    state = model_state(manifest)
    tok = tokenizer_of(manifest, tokenizer)
    merged_note = []
    if lora is not None and fmt == "paddleformers" and merge_lora is False:  # PaddleFormers' own adapter files
        from llmtrain.interop.ernie45_lora import write_paddleformers_lora

        info = write_paddleformers_lora(cfg, lora, state, output, base=manifest.lora_base.get("init_from"),
                                        overwrite=overwrite)
        info.update(family="LoRA adapters", notes=[f"base model: {manifest.lora_base}"], checkpoint=ckpt_dir,
                    tokenizer=None, format=fmt)
        return info
    if lora is not None and fmt in ("hf", "paddleformers"):  # no HF LoRA files; PaddleFormers' on request: merged
        if merge_lora is False:
            raise ExportError(f"{ckpt_dir}: --format hf writes no LoRA adapter files (PEFT's format is not "
                              "implemented); export the merged model (drop --no-merge-lora) or --format paddlenlp")
        merge_lora = True
        merged_note = [f"LoRA adapters merged into the weights (W + A B alpha/r): {fmt} format"]
    if lora is not None and not (lora.merge if merge_lora is None else merge_lora):
        from llmtrain.interop.lora_format import write_paddlenlp_lora

        info = write_paddlenlp_lora(cfg, lora, state, output, base=manifest.lora_base.get("init_from"),
                                    safetensors=safetensors, overwrite=overwrite)
        info.update(family="LoRA adapters", notes=[f"base model: {manifest.lora_base}"],
                    checkpoint=ckpt_dir, read=manifest.describe(), tokenizer=None)
        return info
    if lora is not None:
        state = merged_state(manifest, state)
    elif merge_lora:
        raise ExportError(f"--merge-lora: {ckpt_dir} is not a LoRA checkpoint (its manifest has no 'lora' entry)")
    ids = recorded_token_ids(manifest.tokenizer)  # the run's tokenizer's, when no tokenizer directory is shipped
    if fmt in ("hf", "paddleformers"):
        from llmtrain.interop.formats import hf_target
        from llmtrain.interop.hf_format import write_hf_checkpoint

        info = write_hf_checkpoint(cfg, state, output, tokenizer_dir=tok, overwrite=overwrite,
                                   family=hf_target(cfg, fmt),
                                   layout="paddleformers" if fmt == "paddleformers" else "huggingface",
                                   special_ids=ids)
    else:
        info = write_paddlenlp_checkpoint(cfg, state, output, safetensors=safetensors, tokenizer_dir=tok,
                                          overwrite=overwrite, special_ids=ids)
    info["checkpoint"] = ckpt_dir
    info["format"] = fmt
    info["read"] = manifest.describe()
    info["tokenizer"] = tok
    info["notes"] = list(info.get("notes", [])) + merged_note
    return info


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m llmtrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="step_<N> directory, or a run directory")
    parser.add_argument("--output", required=True,
                        help="directory to create (from_pretrained format of PaddleNLP or Hugging Face)")
    parser.add_argument("--format", default="auto", choices=["auto", "paddlenlp", "hf", "paddleformers"],
                        help="auto: the format of the run's model.init_from (hf for a Hugging Face directory, "
                             "paddleformers for a PaddleFormers ERNIE 4.5 one), else paddlenlp")
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
    except (CheckpointReadError, UnsupportedConfig, CheckpointMismatch, FileExistsError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    kind = {"hf": "Hugging Face", "paddleformers": "PaddleFormers"}.get(info.get("format"), "PaddleNLP")
    print(f"exported {info['read']}: {info['checkpoint']} -> {info['out_dir']} as {kind} {info['family']} "
          f"({', '.join(info['files'])})")
    for note in info["notes"]:
        print(f"  note: {note}")
    if info["tokenizer"] is None and info["family"] != "LoRA adapters":
        print("  note: no tokenizer included (pass --tokenizer DIR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
