"""Shared pytest fixtures: tiny model configs composed from the real conf/ tree."""
from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

os.environ.setdefault("FLAGS_cudnn_deterministic", "1")


def compose(overrides=()):
    """The root config composed with Hydra's compose API, as llmtrain/pretrain.py would see it."""
    from llmtrain.config import compose_config

    return compose_config(overrides)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A real tiny training set: 80 People's Daily articles, a 2500-piece BPE tokenizer (2560 rows padded), MMIDIDX files.

    Returns {"tokenizer": dir, "prefix": path prefix}."""
    import json

    from llmtrain.data.corpus import ParseOptions
    from llmtrain.data.embedded import records
    from llmtrain.data.preprocess import preprocess
    from llmtrain.tokenizer.train import main as train_tokenizer

    root = tmp_path_factory.mktemp("tiny_corpus")
    jsonl = root / "pd.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for r in records(limit=80):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tok = root / "tokenizer"
    assert train_tokenizer(["--input", str(jsonl), "--vocab-size", "2500", "--output", str(tok),
                            "--character-coverage", "0.995"]) == 0
    prefix = str(root / "pd_text_document")
    preprocess([str(jsonl)], str(tok), prefix, workers=0, opt=ParseOptions(words_key="words"),
               word_boundaries="gold", progress=False)
    return {"tokenizer": str(tok), "prefix": prefix}


def tiny_overrides(corpus: dict, run_dir: str, model: str = "gpt", steps: int = 8) -> list[str]:
    """Hydra overrides for a seconds-long run of a tiny GPT or Llama on `corpus`."""
    arch = {
        "gpt": ["model=gpt-tiny", "model.max_position_embeddings=64"],
        "llama": ["model=llama-tiny", "model.num_kv_heads=2"],
        "ernie": ["model=ernie-tiny", "model.max_position_embeddings=64"],
    }[model]
    return arch + [
        "model.hidden_size=32", "model.num_layers=4", "model.num_heads=4", "model.ffn_hidden_size=64",
        f"data.prefixes=[{corpus['prefix']}]", f"data.tokenizer={corpus['tokenizer']}", "data.seq_len=32",
        "data.num_workers=0", f"train.max_steps={steps}", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false", "checkpoint.resume=none",
        "optim.lr=1e-3", "optim.warmup_steps=2", f"run.dir={run_dir}",
    ]

@pytest.fixture
def tiny_gpt():
    from llmtrain.models.config import ModelConfig

    return ModelConfig(
        name="t-gpt", hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, vocab_size=256,
        max_position_embeddings=64, position="learned", norm="layernorm", activation="gelu_tanh", bias=True,
        tie_embeddings=True,
    )


@pytest.fixture
def tiny_llama():
    from llmtrain.models.config import ModelConfig

    return ModelConfig(
        name="t-llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
        vocab_size=256, max_position_embeddings=64, position="rope", norm="rmsnorm", norm_eps=1e-6,
        activation="swiglu", bias=False, tie_embeddings=False,
    )
