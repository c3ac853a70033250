"""DeepSeek-V3- and V2-Lite-shaped Hugging Face checkpoints in, trained under tp2, pp2 and ep2, DeepSeek out.

    python -m pytest tests/e2e/test_deepseek_e2e.py -q

The sources are tiny checkpoints written by tests/hf_deepseek.py (multi-head latent attention, a dense first block
and an MoE block: V3's sigmoid router with its correction bias and group-limited top-2, V2-Lite's softmax greedy
top-2 with 2 shared experts). No launch of its own: the runs join the shared launches of their layouts
(tests/e2e/shared_launch.py):
- tp2 (`llmtrain/finetune.py`'s entry, the HF tokenizer.json): fine-tuning from both, and LoRA on every MLA linear
  (replicated down-projections included) of the V3 with a merged export; in the same processes every gradient of
  an MLA block with adapters against one device (tests/parallel/mla_grads.py);
- pp2 (`llmtrain/pretrain.py`'s entry): continued pretraining from both, one block per stage;
- ep2 (the dp2 launch, parallel.ep=2): continued pretraining from both, 4 of the 8 experts per rank.
Each run: step 1's loss equals the numpy reference forward's (tests/hf_deepseek.py) on the same micro-batches
within 1e-4, so the weights arrived whole under the layout; memory.json shows what each rank holds (tp: heads
split, the compressed down-projections and the experts whole; pp: one block per stage; ep: half the experts);
the final checkpoint exports as DeepSeek (`--format auto`) and the numpy reference reads it back with the
trained model's logits within 1e-4.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hf_deepseek import deepseek_logits, make_deepseek_checkpoint
from hf_tiny import make_hf_tokenizer

from launch import metrics
from shared_launch import join, shared

SOURCES = {"v3": "deepseek_v3", "v2": "deepseek_v2"}
SOURCE_FIELDS = dict(num_hidden_layers=2, max_position_embeddings=128, rope_scaling=None)
"""Two blocks (dense, MoE) so that pp2 puts one on each stage."""
EXAMPLES = [("人民日报的总部在哪里？", "人民日报社位于北京。"), ("请用一句话介绍长江。", "长江是中国最长的河流。"),
            ("一加一等于几？", "一加一等于二。"), ("什么是分词？", "分词是把句子切成词语。")]
STEPS = 3
GLOBAL_BATCH = {"tp2": 8, "pp2": 4, "ep2": 8}
"""Global batch per layout (micro-batch 2): tp2 and ep2 (dp2) match the other runs of their shared launches."""
RUNS = {"tp2": ["v3", "v2", "v3_lora"], "pp2": ["v3", "v2"], "ep2": ["v3", "v2"]}
LORA = ["finetune.lora.rank=2", "finetune.lora.alpha=4", "finetune.lora.merge=true",
        r"finetune.lora.target_modules=['layers\.\d+\.attn\.(q_a|q_b|kv_a|kv_b|o)_proj','layers\.\d+\.mlp\.(gate|up|down)_proj']"]


@functools.lru_cache(maxsize=None)
def make_sources(root, tokenizer: str):
    """The two checkpoints (vocabulary rows: our tokenizer's) with an HF tokenizer.json each, and the SFT file."""
    from llmtrain.tokenizer import load_tokenizer

    vocab = load_tokenizer(tokenizer).vocab_size
    texts = [p + r for p, r in EXAMPLES] * 10
    for seed, (name, model_type) in enumerate(SOURCES.items()):
        make_deepseek_checkpoint(root / name, model_type, seed=seed + 7, vocab_size=vocab, **SOURCE_FIELDS)
        make_hf_tokenizer(root / name, texts)
    (root / "sft.jsonl").write_text("\n".join(json.dumps({"prompt": p, "response": r}, ensure_ascii=False)
                                              for p, r in EXAMPLES) + "\n", encoding="utf-8")
    return root


def run_overrides(root, tiny_corpus, layout: str, name: str) -> list[str]:
    """The overrides of run `name` (a source, `_lora`: with adapters) under `layout`."""
    src = root / name.split("_")[0]
    common = [f"model.init_from={src}", f"train.max_steps={STEPS}", f"train.global_batch_size={GLOBAL_BATCH[layout]}",
              "train.micro_batch_size=2", "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=1",
              "train.progress_bar=false", "train.visualdl=false", "train.eval_interval=0", "checkpoint.save_final=true",
              "checkpoint.resume=none", f"run.dir={root / layout / name}", "+parallel=" + layout]
    if layout == "tp2":  # supervised fine-tuning with the checkpoint's own tokenizer.json
        return common + [f"data.files=[{root / 'sft.jsonl'}]", f"data.tokenizer={src}", "data.seq_len=40"] + (
            LORA if name.endswith("lora") else [])
    return common + [f"data.prefixes=[{tiny_corpus['prefix']}]", f"data.tokenizer={tiny_corpus['tokenizer']}",
                     "data.seq_len=32", "data.num_workers=0"]


def builder(layout: str):
    def build(out, tiny_corpus):
        root = make_sources(out.parent.parent / "deepseek_sources", tiny_corpus["tokenizer"])
        entry = "finetune" if layout == "tp2" else "pretrain"
        runs = {n: run_overrides(root, tiny_corpus, layout, n) for n in RUNS[layout]}
        entries = [{"overrides": r, "entry": entry} for r in runs.values()]
        if layout == "tp2":  # every gradient of an MLA block under tp against one device, in the same processes
            entries.append({"call": "tests/parallel/mla_grads.py:measure", "args": [str(root / "mla_grads")]})
        return entries, (root, runs)

    return build


join("tp2", "deepseek", builder("tp2"))
join("pp2", "deepseek", builder("pp2"))
join("dp2", "deepseek", builder("ep2"))  # ep2 is dp2 with parallel.ep=2: the same fleet topology


def reference_step_loss(src, batches) -> float:
    """Mean over micro-batches of the masked mean cross entropy of the numpy reference (as the trainer logs it)."""
    means = []
    for mb in batches:
        logits = deepseek_logits(src, mb["input_ids"])
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        ce = -np.take_along_axis(logp, mb["labels"][..., None].astype(np.int64), -1)[..., 0]
        means.append(float((ce * mb["loss_mask"]).sum() / mb["loss_mask"].sum()))
    return float(np.mean(means))


def check_holdings(layout: str, name: str, ranks: list) -> None:
    """What each rank's memory.json lists: 4 heads of q (8 + 8 wide), k/v (8 + 6), compressed ranks 12 / 16."""
    held = [e["params"] for e in sorted(ranks, key=lambda e: e["rank"])]
    shape = [{k: v["shape"] for k, v in p.items()} for p in held]
    if layout == "tp2":  # heads split (2 of 4 per rank), compressions and experts whole
        for s in shape:
            q = "layers.0.attn.q_b_proj.weight" if name.startswith("v3") else "layers.0.attn.q_proj.weight"
            assert s[q][1] == 2 * 16 and s["layers.0.attn.kv_b_proj.weight"] == [16, 2 * 14], s
            assert s["layers.1.attn.o_proj.weight"] == [2 * 6, 32] and s["layers.1.attn.kv_a_proj.weight"] == [32, 24]
            assert s["layers.1.mlp.experts.w_gate"] == [8, 32, 16]
            assert s["lm_head.proj.weight"] == [32, s["embed.word.weight"][0]]  # the vocabulary split alike
            if name.endswith("lora"):  # a replicated linear's adapter is whole on every rank, a column one's B split
                assert s["layers.1.attn.kv_a_proj.lora_B"] == [2, 24] and s["layers.1.attn.kv_b_proj.lora_B"] == [2, 28]
    elif layout == "pp2":  # one block per stage
        assert any(k.startswith("layers.0.") for k in shape[0]) and not any(k.startswith("layers.1.") for k in shape[0])
        assert any(k.startswith("layers.1.") for k in shape[1]) and not any(k.startswith("layers.0.") for k in shape[1])
    else:  # ep2: 4 of the 8 experts per rank, attention whole
        for s in shape:
            assert s["layers.1.mlp.experts.w_down"] == [4, 16, 32] and s["layers.1.attn.kv_b_proj.weight"] == [16, 56]


def trained_logits(manifest, ids):
    """Logits [b, s, V] of the run's final checkpoint (a LoRA run: its base merged with the trained adapters)."""
    import paddle

    from llmtrain.checkpoint.reader import base_state, model_state
    from llmtrain.interop.lora_format import merge_adapters
    from llmtrain.models import build_model
    from llmtrain.models.init import load_full_state
    from llmtrain.models.stages import canonical_parameters

    state = dict(model_state(manifest))
    if manifest.lora is not None:
        state = merge_adapters(base_state(manifest), state, manifest.lora.alpha / manifest.lora.rank)
    model = build_model(manifest.model)
    load_full_state(canonical_parameters(model), state)
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()


def check_run(root, tiny_corpus, layout: str, name: str, overrides: list[str]) -> None:
    from llmtrain.checkpoint.reader import Manifest
    from llmtrain.config import compose_config, to_config
    from llmtrain.data.loader import PretrainData
    from llmtrain.data.sft import SFTData
    from llmtrain.export import export_checkpoint
    from llmtrain.tokenizer import load_tokenizer

    run_dir, src = root / layout / name, root / name.split("_")[0]
    train = [r for r in metrics(run_dir) if "loss" in r]
    assert len(train) == STEPS and all(np.isfinite(r["loss"]) for r in train), train
    cfg = to_config(compose_config(overrides, config_name="finetune" if layout == "tp2" else "config"))
    data = (SFTData if layout == "tp2" else PretrainData)(
        cfg.data, seed=cfg.seed, global_batch_size=GLOBAL_BATCH[layout], micro_batch_size=2, dp_world=1,
        tokenizer=load_tokenizer(cfg.data.tokenizer))
    want = reference_step_loss(src, data.next_step())
    assert abs(train[0]["loss"] - want) < 1e-4, (layout, name, train[0]["loss"], want)
    check_holdings(layout, name, json.loads((run_dir / "memory.json").read_text())["ranks"])

    out = root / "exported" / f"{layout}_{name}"
    info = export_checkpoint(str(run_dir), str(out))  # --format auto: the source's format (merged for LoRA)
    assert info["family"] == {"v3": "DeepseekV3ForCausalLM", "v2": "DeepseekV2ForCausalLM"}[name.split("_")[0]]
    ids = np.random.default_rng(2).integers(0, 2000, (2, 24))
    ours = trained_logits(Manifest.read(str(run_dir / "checkpoints" / f"step_{STEPS}")), ids)
    assert np.abs(ours - deepseek_logits(src, ids)).max() > 1e-4  # training changed the model
    got = deepseek_logits(out, ids)
    assert np.abs(ours - got).max() <= 1e-4, (layout, name, float(np.abs(ours - got).max()))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(RUNS))
def test_deepseek_sources_train_under_the_layout_and_export_back(layout, tiny_corpus, tmp_path_factory):
    root, runs = shared("dp2" if layout == "ep2" else layout, "deepseek", tiny_corpus, tmp_path_factory)
    if layout == "tp2":
        import runpy

        check = runpy.run_path(str(Path(__file__).parents[1] / "parallel" / "mla_grads.py"))["check"]
        print(f"tp2 MLA block: largest |gradient - one device| / max = {check(root / 'mla_grads'):.2e}")
    for name in RUNS[layout]:
        check_run(root, tiny_corpus, layout, name, runs[name])
