"""Fine-tuning from a real PaddleNLP checkpoint: prompt tokens carry no loss, the loss on the examples falls.

    python -m pytest tests/e2e/test_finetune.py -q

The dp2 run is `llmtrain/finetune.py`'s own main (Hydra's command line), started in place as the last run of the dp2
launch it shares with tests/e2e/test_pretrain.py when both files are collected (tests/e2e/shared_launch.py,
tests/e2e/run_script.py); hence a global batch of 8, that launch's batch layout.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from launch import metrics
from shared_launch import join, shared

EXAMPLES = [
    ("人民日报的总部在哪里？", "人民日报社位于北京。"),
    ("一九九八年一月的新闻讲了什么？", "讲了经济建设和改革开放。"),
    ("请用一句话介绍长江。", "长江是中国最长的河流。"),
    ("什么是分词？", "分词是把句子切成词语。"),
    ("今天天气怎么样？", "今天晴，适合出门。"),
    ("谁写了《春》？", "朱自清写了《春》。"),
    ("一加一等于几？", "一加一等于二。"),
]


GLOBAL_BATCH = 8
_BUILT = {}


@pytest.fixture(scope="module")
def sft_setup(tiny_corpus, tmp_path_factory):
    return built_setup(tmp_path_factory.mktemp("sft"), tiny_corpus)


def built_setup(root, tiny_corpus):
    """(directory, PaddleNLP model): made once, by the dp2 launch or the first test that needs it."""
    if "setup" not in _BUILT:
        _BUILT["setup"] = make_setup(root, tiny_corpus)
    return _BUILT["setup"]


def make_setup(root, tiny_corpus):
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.tokenizer import load_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size
    paddle.seed(7)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(root / "pnlp"), safe_serialization=True)
    records = [json.dumps({"prompt": p, "response": r}, ensure_ascii=False) for p, r in EXAMPLES]
    records.append(json.dumps({"messages": [{"role": "system", "content": "你是助手。"},
                                            {"role": "user", "content": "你好"},
                                            {"role": "assistant", "content": "你好！"}]}, ensure_ascii=False))
    records += ['{"prompt": "坏的 JSON', json.dumps({"prompt": "没有回答"}, ensure_ascii=False)]
    (root / "sft.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    return root, model


def _overrides(tiny_corpus, root, run_dir, steps):
    return [
        f"model.init_from={root / 'pnlp'}", f"data.files=[{root / 'sft.jsonl'}]", f"data.tokenizer={tiny_corpus['tokenizer']}",
        "data.seq_len=48", f"train.max_steps={steps}", f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=2",
        "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=2", "train.eval_interval=5", "train.eval_batches=4",
        "train.progress_bar=false", "train.visualdl=false", "train.loss_curve=false", "checkpoint.save_final=true",
        "checkpoint.resume=none", f"run.dir={run_dir}",
    ]


def test_prompt_tokens_carry_no_loss_and_bad_records_are_counted(tiny_corpus, sft_setup):
    from llmtrain.data.sft import SFTData, SFTDataConfig
    from llmtrain.tokenizer import load_tokenizer

    root, _ = sft_setup
    tok = load_tokenizer(tiny_corpus["tokenizer"])
    data = SFTData(SFTDataConfig(files=[str(root / "sft.jsonl")], tokenizer=tiny_corpus["tokenizer"], seq_len=48),
                   seed=1, global_batch_size=8, micro_batch_size=8)
    assert len(data.tokens) == len(EXAMPLES) + 1
    assert dict(data.bad.counts) == {"malformed_json": 1, "missing_field": 1}
    assert "sft.jsonl:9" in data.bad.examples["malformed_json"][0]
    for (prompt, response), row, mask in zip(EXAMPLES, data.tokens, data.mask):
        learned = [int(t) for t, m in zip(row, mask) if m == 1]
        assert learned == tok.encode(response) + [tok.eos_id]  # exactly the response and its eos
        assert tok.decode([int(t) for t, m in zip(row, mask) if m == 0 and t != tok.pad_id]).find(prompt) >= 0
    (mb,) = data.next_step()
    examples = data._example(mb["sample_ids"])
    np.testing.assert_array_equal(mb["input_ids"], data.tokens[examples][:, :-1])
    np.testing.assert_array_equal(mb["loss_mask"], data.mask[examples][:, 1:])
    assert mb["loss_mask"].sum() < mb["loss_mask"].size / 2  # prompts and padding excluded


def build(root, tiny_corpus):
    """(run_many entries, (setup directory, PaddleNLP model, run directory)): `llmtrain/finetune.py` in place."""
    setup_root, model = built_setup(root / "setup", tiny_corpus)
    run_dir = root / "run"
    args = ["llmtrain/finetune.py", "+parallel=dp2", *_overrides(tiny_corpus, setup_root, run_dir, 15)]
    return [{"call": "tests/e2e/run_script.py:run", "args": args}], (setup_root, model, run_dir)


join("dp2", "finetune", build, last=True)


@pytest.mark.slow
def test_finetune_imported_paddlenlp_llama_under_dp2(tiny_corpus, tmp_path_factory):
    import paddle
    import paddle.nn.functional as F

    from llmtrain.data.sft import SFTData, SFTDataConfig

    root, pnlp_model, run_dir = shared("dp2", "finetune", tiny_corpus, tmp_path_factory)
    recs = metrics(run_dir)
    train = [r for r in recs if "loss" in r]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert len(train) == 15 and len(evals) == 3
    assert evals[-1] < evals[0] - 0.5  # the loss on the examples falls
    assert train[-1]["loss"] < train[0]["loss"]
    # step 1 starts from the PaddleNLP weights: its loss equals PaddleNLP's own forward on the same batches
    data = SFTData(SFTDataConfig(files=[str(root / "sft.jsonl")], tokenizer=tiny_corpus["tokenizer"], seq_len=48),
                   seed=1234, global_batch_size=GLOBAL_BATCH, micro_batch_size=2, dp_world=1)
    pnlp_model.eval()
    means, tokens = [], 0
    for mb in data.next_step():
        out = pnlp_model(paddle.to_tensor(mb["input_ids"]))
        logits = out[0] if isinstance(out, (tuple, list)) else out
        ce = F.cross_entropy(logits.astype("float32"), paddle.to_tensor(mb["labels"]).unsqueeze(-1), reduction="none").squeeze(-1)
        m = paddle.to_tensor(mb["loss_mask"])
        means.append(float((ce * m).sum() / m.sum()))
        tokens += int(mb["loss_mask"].sum())
    assert abs(train[0]["loss"] - np.mean(means)) < 1e-4
    assert train[0]["tokens"] == tokens  # response tokens only
    assert (run_dir / "checkpoints" / "step_15" / "manifest.json").exists()
