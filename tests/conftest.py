"""Shared pytest fixtures: tiny model configs composed from the real conf/ tree."""
from __future__ import annotations

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_TESTS), _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

os.environ.setdefault("FLAGS_cudnn_deterministic", "1")

from llmtest import REPO, compose, tiny_overrides  # noqa: E402,F401
from ports import worker_port_range  # noqa: E402

# A launch that does not go through tests/launch.py's env() (documented commands run as written) still draws its
# workers' ports from this xdist worker's own slice, above the kernel's ephemeral range (tests/ports.py).
os.environ.setdefault("PORT_RANGE", worker_port_range())


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A real tiny training set: 80 People's Daily articles, a 2500-piece BPE tokenizer (2560 rows padded), MMIDIDX files.

    Returns {"tokenizer": dir, "prefix": path prefix}."""
    import json

    from llmtrain.corpus.parse import ParseOptions
    from llmtrain.corpus.peoples_daily import records
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


def pytest_collection_modifyitems(session, config, items):
    """Under xdist's loadscope, the work units longest first (tests/xdist_schedule.py)."""
    if getattr(config.option, "dist", "no") == "loadscope" or os.environ.get("PYTEST_XDIST_WORKER"):
        from xdist_schedule import order

        by_id = {it.nodeid: it for it in items}
        items[:] = [by_id[n] for n in order(list(by_id))]


def pytest_xdist_make_scheduler(config, log):
    """tests/xdist_schedule.py's scheduler for `--dist loadscope` (scripts/test.sh); xdist's own otherwise."""
    if config.option.dist == "loadscope":
        from xdist_schedule import UnitScheduling

        return UnitScheduling(config, log)
    return None
