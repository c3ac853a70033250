"""Continue MLM pretraining of a real PaddleNLP ERNIE under tp2, with its own WordPiece tokenizer.

    python -m pytest tests/e2e/test_ernie_paddlenlp.py -q

A tiny `ErnieForMaskedLM` made by the real `paddlenlp` package, saved with `save_pretrained` beside an
`ErnieTokenizer` whose vocabulary holds the characters of a few People's Daily articles. Those
articles are preprocessed with that tokenizer directory (`data.tokenizer=DIR`, gold word
boundaries), then `llmtrain/pretrain.py model=ernie-tiny model.init_from=DIR +parallel=tp2` continues
pretraining with whole-word masking on 2 CPU processes: loss finite and falling, and the first step's
loss equal, within 1e-4, to the loss PaddleNLP's own model computes on the same masked batches
(`masked_positions=` and `labels=`, as PaddleNLP's ERNIE pretraining calls it). The run is `llmtrain/pretrain.py`'s
own main, started in place as the last run of the tp2 launch it shares with the other tp2 end-to-end files
collected with it (tests/e2e/shared_launch.py: test_export_roundtrip.py, test_qwen_e2e.py; tests/e2e/run_script.py).
"""
from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from llmtest import compose
from launch import metrics
from shared_launch import join, shared

# the real package (dev extra); a missing paddlenlp fails this test rather than skipping it
from paddlenlp.transformers import ErnieConfig, ErnieForMaskedLM, ErnieTokenizer  # noqa: E402

N_DOCS = 24
STEPS = 6
SPECIAL = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]


def vocabulary(texts) -> list[str]:
    """Special tokens, every (lower-cased) character, and its ## continuation form; a multiple of 8 entries."""
    chars = sorted({c for t in texts for c in t.lower() if not c.isspace()})
    vocab = SPECIAL + chars + ["##" + c for c in chars]
    vocab += [f"[unused{i}]" for i in range(-len(vocab) % 8)]
    return vocab


def ernie_dir(root):
    """(PaddleNLP ERNIE directory with model + tokenizer, data prefix) for a few pd1998 articles."""
    from llmtrain.corpus.parse import ParseOptions
    from llmtrain.corpus.peoples_daily import records
    from llmtrain.data.preprocess import preprocess

    root.mkdir(parents=True)
    recs = list(records(limit=N_DOCS))
    model_dir = root / "ernie"
    model_dir.mkdir()
    vocab = vocabulary(r["text"] for r in recs)
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    ErnieTokenizer(vocab_file=str(model_dir / "vocab.txt")).save_pretrained(str(model_dir))
    paddle.seed(5)
    model = ErnieForMaskedLM(ErnieConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                         type_vocab_size=4, pad_token_id=0))
    model.save_pretrained(str(model_dir), safe_serialization=True)
    jsonl = root / "pd.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    prefix = str(root / "pd_ernie_text_document")
    preprocess([str(jsonl)], str(model_dir), prefix, workers=0, opt=ParseOptions(words_key="words"),
               word_boundaries="gold", progress=False)
    return model_dir, prefix


def vocabulary_of(model_dir) -> list[str]:
    return (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()


def run_overrides(model_dir, prefix, run_dir) -> list[str]:
    return ["model=ernie-tiny", f"model.init_from={model_dir}", f"data.tokenizer={model_dir}",
            f"data.prefixes=[{prefix}]", "data.seq_len=32", "data.num_workers=0", f"train.max_steps={STEPS}",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.progress_bar=false",
            "train.visualdl=false", "train.loss_curve=false", "checkpoint.save_final=false", "checkpoint.resume=none", "optim.lr=5e-3",
            "optim.warmup_steps=1", f"run.dir={run_dir}"]


def build(root, tiny_corpus):
    """(run_many entries, (model_dir, overrides, run_dir)): the tp2 run from the PaddleNLP ERNIE directory."""
    model_dir, prefix = ernie_dir(root)
    overrides = run_overrides(model_dir, prefix, str(root / "run"))
    args = ["llmtrain/pretrain.py", *overrides, "+parallel=tp2"]
    return [{"call": "tests/e2e/run_script.py:run", "args": args}], (model_dir, overrides, root / "run")


join("tp2", "ernie", build, last=True)


@pytest.mark.slow
def test_paddlenlp_ernie_continues_mlm_pretraining_under_tp2(tiny_corpus, tmp_path_factory):
    from llmtrain.config import to_config
    from llmtrain.data.mlm import MLMData

    model_dir, overrides, run_dir = shared("tp2", "ernie", tiny_corpus, tmp_path_factory)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in recs]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses

    # PaddleNLP's own loss on the first step's batches (the same 4 masked micro-batches), computed the way its
    # ERNIE pretraining feeds it: masked_positions (flat indices) and the labels there. (Labels of -100 at the
    # other positions would not do: Paddle's cross_entropy divides by every position when ignore_index < 0.)
    cfg = to_config(compose(overrides))
    data = MLMData(cfg.data, seed=cfg.seed, global_batch_size=8, micro_batch_size=2)
    assert type(data.tokenizer).__name__ == "WordPieceTokenizer" and data.masker.strategy == "whole_word"
    theirs = ErnieForMaskedLM.from_pretrained(str(model_dir))
    theirs.eval()
    per_micro = []
    with paddle.no_grad():
        for mb in data.next_step():
            where = np.flatnonzero(mb["loss_mask"])  # [n_masked] positions in the flattened [m * S] batch
            out = theirs(paddle.to_tensor(mb["input_ids"]), masked_positions=paddle.to_tensor(where),
                         labels=paddle.to_tensor(mb["labels"].ravel()[where]), return_dict=True)
            assert out.logits.shape == [len(where), len(vocabulary_of(model_dir))]
            per_micro.append(float(out.loss))
    expected = float(np.mean(per_micro))  # our step loss: mean over micro-batches of each one's token mean
    print(f"first-step loss: ours {recs[0]['loss']:.7f}, PaddleNLP {expected:.7f}; losses {losses}")
    assert abs(recs[0]["loss"] - expected) <= 1e-4, (recs[0]["loss"], expected)
    assert recs[0]["tokens"] == sum(int(mb["loss_mask"].sum()) for mb in MLMData(
        cfg.data, seed=cfg.seed, global_batch_size=8, micro_batch_size=8).next_step())
