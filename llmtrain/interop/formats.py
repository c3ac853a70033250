"""Which export formats a model can be written in, decided from its configuration alone (no tensor is read).

    python -m llmtrain.export --checkpoint RUN --output OUT --format hf   # refused before any tensor is read
    export_formats(cfg)        # {"paddlenlp": None, "hf": None, "paddleformers": "why not"}: None = it can
    describe_formats(cfg)      # "paddlenlp (PaddleNLP llama), hf (Hugging Face LlamaForCausalLM)"

Each format's answer is the writer's own config conversion (`paddlenlp_format.paddlenlp_config`,
`hf_format.hf_config`), so what is said here is what the export does. `paddleformers` is ERNIE 4.5 only: a model
whose switches ERNIE 4.5 cannot express is refused there like any other field.
"""
from __future__ import annotations

from typing import Optional

from llmtrain.interop.keys import UnsupportedConfig

FORMATS = ("paddlenlp", "hf", "paddleformers")


def hf_target(cfg, fmt: str) -> Optional[str]:
    """The Hugging Face model type a `hf` / `paddleformers` export of `cfg` writes when it is not the switches'
    own: ERNIE 4.5 for `paddleformers` (else `hf_format.hf_config` decides from `cfg.hf_family` and the switches)."""
    from llmtrain.interop import ernie45

    return ernie45.family_of(cfg) if fmt == "paddleformers" else None


def written_as(cfg, fmt: str) -> str:
    """`PaddleNLP llama`, `Hugging Face Qwen3MoeForCausalLM`, ...: what a `fmt` export of `cfg` writes; raises
    UnsupportedConfig when it cannot."""
    if fmt == "paddlenlp":
        from llmtrain.interop.paddlenlp_format import paddlenlp_config

        family, _, _ = paddlenlp_config(cfg)
        return f"PaddleNLP {family}"
    if cfg.family != "decoder":
        raise UnsupportedConfig(f"model {cfg.name!r} is an encoder: written as PaddleNLP ERNIE only")
    from llmtrain.interop.hf_format import hf_config

    _, config = hf_config(cfg, hf_target(cfg, fmt), "paddleformers" if fmt == "paddleformers" else "huggingface")
    return f"{'PaddleFormers' if fmt == 'paddleformers' else 'Hugging Face'} {config['architectures'][0]}"


def export_formats(cfg) -> dict:
    """{format: None when `cfg` can be written in it, else why not} for every format."""
    out = {}
    for fmt in FORMATS:
        try:
            written_as(cfg, fmt)
            out[fmt] = None
        except UnsupportedConfig as e:
            out[fmt] = str(e)
    return out


def describe_formats(cfg) -> str:
    """`paddlenlp (PaddleNLP llama), hf (Hugging Face LlamaForCausalLM)`: the formats `cfg` can be written in."""
    can = []
    for fmt in FORMATS:
        try:
            can.append(f"{fmt} ({written_as(cfg, fmt)})")
        except UnsupportedConfig:
            continue
    return ", ".join(can) or "none"
