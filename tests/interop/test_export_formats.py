"""Every shipped preset can be exported in the formats docs/models.md promises, decided from its configuration
before any training (`llmtrain.interop.formats`); a format a model cannot be written in is refused before any tensor
is read, naming the formats it can be.

    python -m pytest -q tests/interop/test_export_formats.py
"""
from __future__ import annotations

import dataclasses

import pytest

from llmtrain.config import presets
from llmtrain.interop.formats import export_formats, written_as

PROMISED = {  # docs/models.md, "Model families and checkpoint formats": preset -> formats it is written in
    "gpt-tiny": {"paddlenlp"}, "gpt2-small": {"paddlenlp"},
    "llama-tiny": {"paddlenlp", "hf"}, "llama-7b": {"paddlenlp", "hf"}, "tinyllama-1.1b": {"paddlenlp", "hf"},
    "qwen-1.8b": {"paddlenlp"}, "qwen-7b": {"paddlenlp"},
    "qwen2-0.5b": {"hf"}, "qwen2-1.5b": {"hf"}, "qwen2-7b": {"hf"},
    "qwen3-0.6b": {"hf"}, "qwen3-8b": {"hf"}, "qwen3-32b": {"hf"}, "qwen3-30b-a3b": {"hf"}, "qwen3-235b-a22b": {"hf"},
    "mixtral-8x7b": {"paddlenlp"}, "deepseek-v2-lite": {"hf"}, "deepseek-v3": {"hf"}, "deepseek-tiny": {"hf"},
    "ernie-4.5-0.3b": {"hf", "paddleformers"}, "ernie-4.5-21b-a3b": {"hf", "paddleformers"},
    "ernie-4.5-300b-a47b": {"hf", "paddleformers"},
    "ernie-tiny": {"paddlenlp"}, "ernie-3.0-base-zh": {"paddlenlp"}, "ernie-3.0-medium-zh": {"paddlenlp"},
    "moe-tiny": None, "qwen-moe-a2.7b": None,  # shapes of our own (shared experts): no published class computes them
}


def preset(name):
    """The model config of conf/model/<name>.yaml, with a vocabulary when the preset leaves it to the tokenizer."""
    from llmtrain.config import preset_config

    cfg = preset_config("model", name)
    return dataclasses.replace(cfg, vocab_size=cfg.vocab_size or 16000)


def test_every_preset_exports_as_promised():
    """A qwen3-30b-a3b run used to fail `--format hf` on its own moe_aux_loss_scope=layer, and ERNIE 4.5 presets
    came out of `--format hf` as LlamaForCausalLM or failed as Qwen3MoeForCausalLM."""
    assert set(PROMISED) == set(presets()["model"]), set(PROMISED) ^ set(presets()["model"])
    for name, promised in PROMISED.items():
        cfg = preset(name)
        can = {fmt for fmt, why in export_formats(cfg).items() if why is None}
        if promised is None:  # each format's refusal names the field
            assert not can and all("moe_num_shared_experts" in why or "moe_aux_counts" in why
                                   for why in export_formats(cfg).values()), (name, export_formats(cfg))
            continue
        assert promised <= can, f"{name}: promised {sorted(promised)}, can {sorted(can)}: {export_formats(cfg)}"
    assert written_as(preset("ernie-4.5-0.3b"), "hf") == "Hugging Face Ernie4_5ForCausalLM"
    assert written_as(preset("ernie-4.5-21b-a3b"), "hf") == "Hugging Face Ernie4_5_MoeForCausalLM"
    assert written_as(preset("qwen3-30b-a3b"), "hf") == "Hugging Face Qwen3MoeForCausalLM"


def test_a_format_the_model_cannot_be_written_in_is_refused_naming_those_it_can():
    from llmtrain.export import ExportError, check_format

    with pytest.raises(ExportError) as e:
        check_format(preset("qwen3-30b-a3b"), "paddlenlp", "RUN/checkpoints/step_9")
    text = str(e.value)
    assert text.startswith("RUN/checkpoints/step_9: --format paddlenlp: model 'qwen3-30b-a3b' cannot be written as "
                           "a PaddleNLP mixtral"), text
    assert text.endswith("This model can be exported as: hf (Hugging Face Qwen3MoeForCausalLM)"), text
