"""Qwen in, trained under tp2 and pp2, Qwen out: a PaddleNLP Qwen directory and a Hugging Face-layout Qwen2 one.

    python -m pytest tests/e2e/test_qwen_e2e.py -q

Two launches cover both sources (`run_many`, one fleet topology each), both shared with other end-to-end files
(tests/e2e/shared_launch.py):
- tp2 (`llmtrain/finetune.py`'s entry): supervised fine-tuning from the PaddleNLP Qwen (our SentencePiece
  tokenizer), from the HF Qwen2 (its own tokenizer.json), and LoRA from the PaddleNLP Qwen starting from
  adapters PaddleNLP's `LoRAModel` made (fused c_attn); the tp2 launch is shared with the other tp2 end-to-end
  files collected with this one (tests/e2e/shared_launch.py; hence a global batch of 8, their batch layout);
- pp2 (`llmtrain/pretrain.py`'s entry): continued pretraining from both directories, in the pp2 launch shared with
  tests/e2e/test_families_e2e.py (global batch 4, micro-batch 2).
Each run: step 1's loss equals the source model's own forward on the same micro-batches (PaddleNLP's Qwen, or
the numpy Qwen2 of tests/hf_tiny.py), so the weights arrived whole under the layout; memory.json shows each rank
holding its tp half / its pipeline stage; the final checkpoint exports in the source format (`--format auto`)
and loads back there (PaddleNLP's `from_pretrained`, `LoRAModel.from_pretrained`, or the numpy reference) with
the logits of the trained checkpoint within 1e-4.
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hf_tiny import make_hf_checkpoint, make_hf_tokenizer, reference_logits

from launch import metrics
from shared_launch import join, shared

EXAMPLES = [("人民日报的总部在哪里？", "人民日报社位于北京。"), ("请用一句话介绍长江。", "长江是中国最长的河流。"),
            ("一加一等于几？", "一加一等于二。"), ("谁写了《春》？", "朱自清写了《春》。"),
            ("今天天气怎么样？", "今天晴，适合出门。"), ("什么是分词？", "分词是把句子切成词语。")]
STEPS = 3
GLOBAL_BATCH = {"tp2": 8, "pp2": 4}
"""Global batch per layout (micro-batch 2): tp2 matches the other runs of the shared tp2 launch."""
TP2 = ["pnlp", "hf", "pnlp_lora"]
PP2 = ["pnlp", "hf"]


def make_sources(root, tiny_corpus):
    import paddle
    from paddlenlp.peft import LoRAConfig, LoRAModel
    from paddlenlp.transformers import QWenConfig, QWenForCausalLM

    from llmtrain.tokenizer import load_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    vocab = load_tokenizer(tiny_corpus["tokenizer"]).vocab_size
    paddle.seed(11)
    qwen = QWenForCausalLM(QWenConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      kv_channels=8, intermediate_size=128, max_position_embeddings=128,
                                      seq_length=64))
    rng = np.random.default_rng(0)
    with paddle.no_grad():  # c_attn biases start at zero: make them matter
        for block in qwen.qwen.h:
            block.attn.c_attn.bias.set_value(paddle.to_tensor(0.2 * rng.standard_normal([96]).astype(np.float32)))
    qwen.save_pretrained(str(root / "pnlp_qwen"), safe_serialization=True)
    lora = LoRAModel(qwen, LoRAConfig(r=2, lora_alpha=4, target_modules=[".*c_attn", ".*mlp.w1"]))
    with paddle.no_grad():
        for name, p in lora.model.named_parameters():
            if "lora_" in name:
                p.set_value(paddle.to_tensor((0.2 * rng.standard_normal(p.shape)).astype(np.float32)))
    lora.save_pretrained(str(root / "pnlp_lora"))
    texts = [p + r for p, r in EXAMPLES] * 10
    make_hf_checkpoint(root / "hf_qwen2", "qwen2", seed=5, vocab_size=vocab, intermediate_size=64,
                       max_position_embeddings=128)
    make_hf_tokenizer(root / "hf_qwen2", texts)
    (root / "sft.jsonl").write_text("\n".join(json.dumps({"prompt": p, "response": r}, ensure_ascii=False)
                                              for p, r in EXAMPLES) + "\n", encoding="utf-8")
    return root


_BUILT = {}


def built_sources(root, tiny_corpus):
    """The source directories, made once (in `root`) by whichever needs them first: the tp2 or the pp2 launch."""
    if "root" not in _BUILT:
        _BUILT["root"] = make_sources(root, tiny_corpus)
    return _BUILT["root"]


def _common(run_dir, layout):
    return [f"train.max_steps={STEPS}", f"train.global_batch_size={GLOBAL_BATCH[layout]}", "train.micro_batch_size=2",
            "optim.lr=3e-3",
            "optim.min_lr=3e-4", "optim.warmup_steps=1", "train.progress_bar=false", "train.visualdl=false",
            "train.loss_curve=false", "train.eval_interval=0", "checkpoint.save_final=true", "checkpoint.resume=none",
            f"run.dir={run_dir}"]


def finetune_run(root, tiny_corpus, name):
    src = "hf_qwen2" if name.startswith("hf") else "pnlp_qwen"
    tok = root / "hf_qwen2" if name.startswith("hf") else tiny_corpus["tokenizer"]
    extra = [f"finetune.lora.init_from={root / 'pnlp_lora'}", "finetune.lora.rank=2"] if name.endswith("lora") else []
    return [f"model.init_from={root / src}", f"data.files=[{root / 'sft.jsonl'}]", f"data.tokenizer={tok}",
            "data.seq_len=40", *extra, *_common(root / "tp2" / name, "tp2")]


def pretrain_run(root, tiny_corpus, name):
    src = "hf_qwen2" if name.startswith("hf") else "pnlp_qwen"
    return [f"model.init_from={root / src}", f"data.prefixes=[{tiny_corpus['prefix']}]",
            f"data.tokenizer={tiny_corpus['tokenizer']}", "data.seq_len=32", "data.num_workers=0",
            *_common(root / "pp2" / name, "pp2")]


@functools.lru_cache(maxsize=None)
def source_model(root, name):
    """PaddleNLP's Qwen of the source directory (+ its LoRAModel for `*lora`), loaded once."""
    from paddlenlp.peft import LoRAModel
    from paddlenlp.transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root / "pnlp_qwen"))
    if name.endswith("lora"):
        model = LoRAModel.from_pretrained(model, str(root / "pnlp_lora"))
    model.eval()
    return model


def source_logits(root, name, ids):
    """The source model's own logits [b, s, V]: PaddleNLP's Qwen (+ its LoRAModel), or the numpy Qwen2."""
    import paddle

    if name.startswith("hf"):
        return reference_logits(root / "hf_qwen2", ids)
    model = source_model(root, name)
    with paddle.no_grad():
        out = model(paddle.to_tensor(ids))
    return (out[0] if isinstance(out, (tuple, list)) else out).numpy().astype(np.float64)


def first_step_loss(root, name, batches) -> float:
    """Mean over micro-batches of the masked mean cross entropy of the source model (as the trainer logs it)."""
    means = []
    for mb in batches:
        logits = source_logits(root, name, mb["input_ids"])
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        ce = -np.take_along_axis(logp, mb["labels"][..., None].astype(np.int64), -1)[..., 0]
        means.append(float((ce * mb["loss_mask"]).sum() / mb["loss_mask"].sum()))
    return float(np.mean(means))


def check_run(root, tiny_corpus, layout, name, overrides, entry):
    from llmtrain.config import compose_config, to_config
    from llmtrain.data.loader import PretrainData
    from llmtrain.data.sft import SFTData
    from llmtrain.checkpoint.reader import Manifest, model_state
    from llmtrain.export import export_checkpoint
    from llmtrain.tokenizer import load_tokenizer

    run_dir = root / layout / name
    train = [r for r in metrics(run_dir) if "loss" in r]
    assert len(train) == STEPS and all(np.isfinite(r["loss"]) for r in train), train
    cfg = to_config(compose_config(overrides, config_name="finetune" if entry == "finetune" else "config"))
    cls = SFTData if entry == "finetune" else PretrainData
    data = cls(cfg.data, seed=cfg.seed, global_batch_size=GLOBAL_BATCH[layout], micro_batch_size=2, dp_world=1,
               tokenizer=load_tokenizer(cfg.data.tokenizer))
    want = first_step_loss(root, name, data.next_step())
    assert abs(train[0]["loss"] - want) < 1e-4, (layout, name, train[0]["loss"], want)

    ranks = json.loads((run_dir / "memory.json").read_text())["ranks"]
    held = [e["params"] for e in sorted(ranks, key=lambda e: e["rank"])]
    if layout == "tp2":  # column-split q/k/v (and their biases) and row-split o: each rank holds half
        for p in held:
            assert p["layers.0.attn.k_proj.bias"]["shape"] == [8 if name.startswith("hf") else 16]  # 2 or 4 kv heads of 8
            assert p["layers.0.attn.o_proj.weight"]["shape"] == [16, 32]
    else:  # two stages of one layer each
        assert "layers.0.attn.q_proj.bias" in held[0] and "layers.1.attn.q_proj.bias" not in held[0]
        assert "layers.1.attn.q_proj.bias" in held[1] and "layers.0.attn.q_proj.bias" not in held[1]

    out = root / "exported" / f"{layout}_{name}"
    info = export_checkpoint(str(run_dir), str(out))  # --format auto: the source's format
    step = run_dir / "checkpoints" / f"step_{STEPS}"
    manifest = Manifest.read(str(step))
    cfg_m, state = manifest.model, dict(model_state(manifest))
    ids = np.random.default_rng(2).integers(0, cfg_m.vocab_size, (2, 20))
    if name.endswith("lora"):
        ours = trained_lora_logits(cfg_m, state, manifest, ids)
        import paddle
        from paddlenlp.peft import LoRAModel
        from paddlenlp.transformers import AutoModelForCausalLM

        theirs = LoRAModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(root / "pnlp_qwen")), str(out))
        theirs.eval()
        with paddle.no_grad():
            got = theirs(paddle.to_tensor(ids))[0].numpy()
    else:
        ours = trained_logits(cfg_m, state, ids)
        if name.startswith("hf"):
            assert info["family"] == "Qwen2ForCausalLM"
            got = reference_logits(out, ids)
        else:
            import paddle
            from paddlenlp.transformers import AutoModelForCausalLM

            assert info["family"] == "qwen"
            theirs = AutoModelForCausalLM.from_pretrained(str(out))
            theirs.eval()
            with paddle.no_grad():
                got = theirs(paddle.to_tensor(ids))[0].numpy()
    assert np.abs(ours - source_logits(root, name, ids)).max() > 1e-4  # training changed the model
    assert np.abs(ours - got).max() <= 1e-4, (layout, name, float(np.abs(ours - got).max()))


def trained_logits(cfg, state, ids):
    import paddle

    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.init import load_full_state

    model = build_model(cfg)
    load_full_state(canonical_parameters(model), state)
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()


def trained_lora_logits(cfg, adapters, manifest, ids):
    """Our model: the LoRA checkpoint's base (its model.init_from) merged with its trained adapters."""
    from llmtrain.checkpoint.reader import base_state
    from llmtrain.interop.lora_format import merge_adapters

    lora = manifest.lora
    return trained_logits(cfg, merge_adapters(base_state(manifest), adapters, lora.alpha / lora.rank), ids)


def build_tp2(root, tiny_corpus):
    """(run_many entries, (sources root, overrides per run)): the fine-tuning runs of the shared tp2 launch."""
    src = built_sources(root, tiny_corpus)
    runs = {n: finetune_run(src, tiny_corpus, n) for n in TP2}
    return [{"overrides": r + ["+parallel=tp2"], "entry": "finetune"} for r in runs.values()], (src, runs)


join("tp2", "qwen", build_tp2)


@pytest.mark.slow
def test_qwen_sources_finetune_under_tp2_and_export_back(tiny_corpus, tmp_path_factory):
    root, runs = shared("tp2", "qwen", tiny_corpus, tmp_path_factory)
    for n in TP2:
        check_run(root, tiny_corpus, "tp2", n, runs[n], "finetune")


def build_pp2(root, tiny_corpus):
    """(run_many entries, (sources root, overrides per run)): the continued-pretraining runs of the shared pp2 launch
    (with tests/e2e/test_families_e2e.py's)."""
    src = built_sources(root, tiny_corpus)
    runs = {n: pretrain_run(src, tiny_corpus, n) for n in PP2}
    return [{"overrides": r + ["+parallel=pp2"], "entry": "pretrain"} for r in runs.values()], (src, runs)


join("pp2", "qwen", build_pp2)


@pytest.mark.slow
def test_qwen_sources_continue_pretraining_under_pp2_and_export_back(tiny_corpus, tmp_path_factory):
    root, runs = shared("pp2", "qwen", tiny_corpus, tmp_path_factory)
    for n in PP2:
        check_run(root, tiny_corpus, "pp2", n, runs[n], "pretrain")
