"""LoRA fine-tuning from a PaddleNLP Llama, one process: only adapters train and sit in the optimizer state,
checkpoints hold adapters alone and resume exactly, exports load in PaddleNLP, PaddleNLP adapters continue.

    python -m pytest tests/train/test_lora.py -q

One subprocess runs five fine-tuning runs (`run_many`, entry finetune): full-parameter (2 steps, for the
memory comparison), LoRA (6 steps, checkpoints at 3 and 6), LoRA resumed from that step_3, LoRA started
from adapters made and saved by PaddleNLP's own `LoRAModel` (1 step), and LoRA on packed sequences with a
held-out evaluation (2 steps).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from interop.interop_helpers import randomize_lora  # tests/interop (a namespace import)
from launch import metrics, run_many

EXAMPLES = [("人民日报的总部在哪里？", "人民日报社位于北京。"), ("请用一句话介绍长江。", "长江是中国最长的河流。"),
            ("什么是分词？", "分词是把句子切成词语。"), ("谁写了《春》？", "朱自清写了《春》。"),
            ("一加一等于几？", "一加一等于二。"), ("今天天气怎么样？", "今天晴，适合出门。")]
LORA = ["finetune.lora.rank=4", "finetune.lora.alpha=8"]
TOL = 1e-5


def _common(tiny_corpus, root, run_dir, steps, lr=3e-3):
    return [f"model.init_from={root / 'base'}", f"data.files=[{root / 'sft.jsonl'}]",
            f"data.tokenizer={tiny_corpus['tokenizer']}", "data.seq_len=48", f"train.max_steps={steps}",
            "train.global_batch_size=4", "train.micro_batch_size=2", f"optim.lr={lr}", f"optim.min_lr={lr / 10}",
            "optim.warmup_steps=2", "train.progress_bar=false", "train.visualdl=false", "train.loss_curve=false",
            "checkpoint.resume=none",
            f"run.dir={run_dir}"]


@pytest.fixture(scope="module")
def lora_runs(tiny_corpus, tmp_path_factory):
    import paddle
    from paddlenlp.peft import LoRAConfig, LoRAModel
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("lora")
    paddle.seed(11)
    cfg = LlamaConfig(vocab_size=load_tokenizer(tiny_corpus["tokenizer"]).vocab_size, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-6)
    base = LlamaForCausalLM(cfg)
    base.save_pretrained(str(root / "base"), safe_serialization=True)
    lm = LoRAModel(base, LoRAConfig(r=2, lora_alpha=4, target_modules=[".*q_proj", ".*v_proj", ".*up_proj"]))
    randomize_lora(lm, "lora_B", 0.3, seed=12)
    lm.save_pretrained(str(root / "pnlp_lora"))
    (root / "sft.jsonl").write_text("\n".join(json.dumps({"prompt": p, "response": r}, ensure_ascii=False)
                                              for p, r in EXAMPLES) + "\n", encoding="utf-8")
    out = root / "runs"
    runs = {
        "full": _common(tiny_corpus, root, out / "full", 2),
        "lora": _common(tiny_corpus, root, out / "lora", 6, lr=3e-2) + LORA + ["checkpoint.interval=3",
                                                                       "checkpoint.save_final=true"],
        "resumed": [o for o in _common(tiny_corpus, root, out / "resumed", 6, lr=3e-2) if o != "checkpoint.resume=none"]
        + LORA + [f"checkpoint.resume={out / 'lora' / 'checkpoints' / 'step_3'}"],
        "from_pnlp": _common(tiny_corpus, root, out / "from_pnlp", 1)
        + ["finetune.lora.rank=1", f"finetune.lora.init_from={root / 'pnlp_lora'}"],
        "packed": [o.replace("data.seq_len=48", "data.seq_len=96")
                   for o in _common(tiny_corpus, root, out / "packed", 2, lr=3e-2)] + LORA
        + ["data.packing=true", f"data.valid_files=[{root / 'sft.jsonl'}]", "train.eval_interval=2",
           "train.eval_batches=2"],
    }
    run_many(list(runs.values()), nproc=0, workdir=out, entry="finetune")
    return root, out, lm


def _memory(run_dir) -> dict:
    with open(run_dir / "memory.json") as f:
        return json.load(f)["ranks"][0]


def test_only_adapters_train_and_hold_optimizer_state(lora_runs):
    _, out, _ = lora_runs
    full, lora = _memory(out / "full"), _memory(out / "lora")
    adapters = {n: p["numel"] for n, p in lora["params"].items() if n.endswith((".lora_A", ".lora_B"))}
    assert len(adapters) == 2 * 7 * 2  # q k v o gate up down in 2 layers, A and B
    n_adapter = sum(adapters.values())
    assert set(lora["optimizer_params"]) == set(adapters)  # no base parameter has optimizer state
    assert lora["optimizer_numel"] == 2 * n_adapter + 2 * len(adapters)  # AdamW: 2 moments + 2 [1] beta powers
    assert lora["frozen_numel"] == full["param_numel"] == lora["param_numel"] - n_adapter
    assert lora["grad_bytes"] == 4 * n_adapter  # no gradient for the frozen base
    assert full["optimizer_bytes"] > 20 * lora["optimizer_bytes"]
    print(f"optimizer state per rank: full {full['optimizer_bytes']} B, LoRA r=4 {lora['optimizer_bytes']} B; "
          f"gradients: full {full['grad_bytes']} B, LoRA {lora['grad_bytes']} B")
    recs = metrics(out / "lora")
    assert recs[-1]["loss"] < recs[0]["loss"]


def test_checkpoint_holds_adapters_alone_and_resumes_exactly(lora_runs):
    from llmtrain.checkpoint.shards import ShardIndex

    root, out, _ = lora_runs
    step6 = out / "lora" / "checkpoints" / "step_6"
    manifest = json.loads((step6 / "manifest.json").read_text())
    assert manifest["lora"]["base"]["init_from"] == str(root / "base")
    assert manifest["lora"]["rank"] == 4 and manifest["lora"]["alpha"] == 8
    keys = ShardIndex(str(step6)).keys("")
    assert keys and all(".lora_A" in k or ".lora_B" in k for k in keys), [k for k in keys if "lora" not in k]
    ref, got = metrics(out / "lora"), metrics(out / "resumed")
    assert [r["step"] for r in got] == [4, 5, 6]
    for r, g in zip(ref[3:], got):
        assert abs(r["loss"] - g["loss"]) <= TOL and abs(r["grad_norm"] - g["grad_norm"]) <= TOL, (r, g)
        assert r["tokens_total"] == g["tokens_total"]


def test_exports_load_in_paddlenlp_with_our_logits(lora_runs, tmp_path):
    import paddle
    from interop.interop_helpers import assert_close, paddlenlp_logits, token_ids
    from paddlenlp.peft import LoRAModel
    from paddlenlp.transformers import AutoModelForCausalLM

    from llmtrain.checkpoint.shards import ShardIndex
    from llmtrain.checkpoint.reader import Manifest, base_state
    from llmtrain.export import main as export_main
    from llmtrain.models import build_model
    from llmtrain.models.stages import canonical_parameters
    from llmtrain.models.init import load_full_state
    from llmtrain.models.lora import attach_lora
    from llmtrain.models.roles import Roles

    root, out, _ = lora_runs
    step6 = out / "lora" / "checkpoints" / "step_6"
    manifest = Manifest.read(str(step6))
    cfg = manifest.model
    model = build_model(cfg)
    attach_lora(model, manifest.lora, Roles())
    adapters = ShardIndex(str(step6)).model_state()
    load_full_state(canonical_parameters(model), {**base_state(manifest), **adapters})
    model.eval()
    ids = token_ids(cfg.vocab_size, seed=5)
    with paddle.no_grad():
        ours = model(ids).numpy()

    assert export_main(["--checkpoint", str(out / "lora"), "--output", str(tmp_path / "adapters")]) == 0
    assert (tmp_path / "adapters" / "lora_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(str(root / "base"))
    base_logits = paddlenlp_logits(base, ids)
    assert float(np.abs(ours - base_logits).max()) > 1e-3  # the trained adapters changed the model
    assert_close(ours, paddlenlp_logits(LoRAModel.from_pretrained(base, str(tmp_path / "adapters")), ids),
                 "our LoRA checkpoint as PaddleNLP adapters")
    assert export_main(["--checkpoint", str(step6), "--output", str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert_close(ours, paddlenlp_logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")), ids),
                 "merged export vs our unmerged forward")
    # generation from the LoRA run directory (merged on load) = from the merged PaddleNLP export
    from llmtrain.generate import generate, load_model

    a, b = load_model(str(out / "lora"))[0], load_model(str(tmp_path / "merged"), trusted=True)[0]
    assert generate(a, [1, 40, 41, 42], 12) == generate(b, [1, 40, 41, 42], 12)


def test_packed_lora_finetuning_counts_tokens_exactly_and_evaluates(lora_runs, tiny_corpus):
    from llmtrain.data.sft import SFTData, SFTDataConfig

    root, out, _ = lora_runs
    recs = metrics(out / "packed")
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    cfg = SFTDataConfig(files=[str(root / "sft.jsonl")], tokenizer=tiny_corpus["tokenizer"], seq_len=96, packing=True)
    data = SFTData(cfg, seed=1234, global_batch_size=4, micro_batch_size=2)
    assert data.packed["examples_per_row"].max() > 1  # several examples share a row
    for r in train:
        assert r["tokens"] == int(sum(mb["loss_mask"].sum() for mb in data.next_step()))  # response tokens, exact
    (ev,) = evals
    valid = data.valid_batches(2)
    assert ev["eval_tokens"] == int(sum(mb["loss_mask"].sum() for mb in valid))
    assert abs(ev["eval_ppl"] - np.exp(ev["eval_loss"])) < 1e-6 * ev["eval_ppl"]


def test_paddlenlp_adapters_continue_in_our_finetuning(lora_runs, tiny_corpus):
    """Step 1 of the run started from PaddleNLP's adapters has the loss of PaddleNLP's LoRAModel on its batches."""
    import paddle
    import paddle.nn.functional as F

    from llmtrain.data.sft import SFTData, SFTDataConfig

    root, out, lm = lora_runs
    data = SFTData(SFTDataConfig(files=[str(root / "sft.jsonl")], tokenizer=tiny_corpus["tokenizer"], seq_len=48),
                   seed=1234, global_batch_size=4, micro_batch_size=2)
    lm.eval()
    means = []
    with paddle.no_grad():
        for mb in data.next_step():
            out_ = lm(paddle.to_tensor(mb["input_ids"]))
            logits = out_[0] if isinstance(out_, (tuple, list)) else out_
            ce = F.cross_entropy(logits.astype("float32"), paddle.to_tensor(mb["labels"]).unsqueeze(-1),
                                 reduction="none").squeeze(-1)
            m = paddle.to_tensor(mb["loss_mask"])
            means.append(float((ce * m).sum() / m.sum()))
    (rec,) = metrics(out / "from_pnlp")
    assert abs(rec["loss"] - float(np.mean(means))) < 1e-4, (rec["loss"], means)
    mem = _memory(out / "from_pnlp")
    assert len(mem["optimizer_params"]) == 2 * 3 * 2  # q, v, up of 2 layers, as PaddleNLP's targets said


def test_a_pipeline_stage_without_adapters_is_refused_by_name():
    """A stage whose blocks no target matches has no trainable parameter: refused with the targets and the stage
    (measured under pp2 with adapters on blocks 0-3 of 8: the rank raises this instead of AdamW's IndexError)."""
    import paddle

    from llmtrain.train.lora import no_adapter_problem

    msg = no_adapter_problem([], 1, 2, [r"layers\.[0-3]\..*_proj"])
    assert msg.startswith("finetune.lora.target_modules=") and "pipeline stage 1 of parallel.pp=2" in msg, msg
    assert "parallel.pp_layers" in msg and "AdamW.step" in msg, msg
    assert no_adapter_problem([("layers.4.mlp.up_proj.lora_A", paddle.zeros([2, 2]))], 1, 2, ["x"]) is None


def test_resume_contract_refuses_another_base_for_a_lora_checkpoint():
    from llmtrain.train.contract import review_resume

    saved = {"model": {"init_from": "a"}, "finetune": {"lora": {"rank": 4}}, "train": {"max_steps": 5}}
    r = review_resume(saved, {**saved, "model": {"init_from": "b"}}, None, None, 3)
    assert any("model.init_from" in x and "base model of a LoRA checkpoint" in x for x in r.refused), r
    r = review_resume(saved, {**saved, "finetune": {"lora": {"rank": 8}}}, None, None, 3)
    assert any("finetune.lora.rank" in x for x in r.refused), r


def test_a_lora_checkpoint_is_not_a_base_for_init_from(lora_runs, tiny_corpus):
    from llmtrain.config import ConfigError, compose_config, to_config
    from llmtrain.resolve import resolve

    root, out, _ = lora_runs
    ov = [o for o in _common(tiny_corpus, root, out / "x", 1) if not o.startswith("model.init_from")]
    cfg = to_config(compose_config(ov + [f"model.init_from={out / 'lora' / 'checkpoints' / 'step_6'}"],
                                   config_name="finetune"))
    with pytest.raises(ConfigError, match="is a LoRA checkpoint: it stores adapters only"):
        resolve(cfg, world_size=1)


@pytest.mark.slow
def test_packed_lora_finetuning_under_tp2_equals_one_process(lora_runs, tiny_corpus, tmp_path):
    """The packed LoRA run again under tp2 (one 2-process launch): per-step loss and grad norm within 1e-5,
    the same token counts and held-out loss; each tp rank holds half of every split adapter factor. The same
    launch resumes the one-process LoRA run's step_3 (adapters only) under tp2: steps 4-6 as uninterrupted."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "parallel"))
    from lora_checks import check_lora_memory

    root, out, _ = lora_runs
    overrides = [o.replace("data.seq_len=48", "data.seq_len=96")
                 for o in _common(tiny_corpus, root, tmp_path / "packed", 2, lr=3e-2)] + LORA + [
        "data.packing=true", f"data.valid_files=[{root / 'sft.jsonl'}]", "train.eval_interval=2",
        "train.eval_batches=2", "+parallel=tp2"]
    resumed = [o for o in _common(tiny_corpus, root, tmp_path / "resumed", 6, lr=3e-2) if o != "checkpoint.resume=none"] \
        + LORA + [f"checkpoint.resume={out / 'lora' / 'checkpoints' / 'step_3'}", "+parallel=tp2"]
    run_many([overrides, resumed], nproc=2, workdir=tmp_path, entry="finetune")
    for r, g in zip(metrics(out / "lora")[3:], metrics(tmp_path / "resumed")):
        assert r["step"] == g["step"] and abs(r["loss"] - g["loss"]) <= TOL and r["tokens_total"] == g["tokens_total"]
    assert [g["step"] for g in metrics(tmp_path / "resumed")] == [4, 5, 6]
    ref, got = metrics(out / "packed"), metrics(tmp_path / "packed")
    assert len(ref) == len(got) == 3
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in r:
                assert abs(r[key] - g[key]) <= TOL, (key, r, g)
        for key in ("tokens", "tokens_total", "eval_tokens"):
            assert r.get(key) == g.get(key), (key, r, g)
    check_lora_memory(json.loads((tmp_path / "packed" / "memory.json").read_text()),
                      json.loads((out / "packed" / "memory.json").read_text()), "tp2")


def test_lora_layout_rules_at_resolve(tiny_corpus, tmp_path):
    """Fused projections, sequence parallelism and ZeRO-2/3 take LoRA; MFU counts 4 N for the frozen base (no
    weight gradients) plus 6 N_lora."""
    from llmtest import tiny_overrides

    from llmtrain.config import ConfigError, compose_config, to_config
    from llmtrain.models.lora_targets import adapter_numel
    from llmtrain.models.size import flops_per_token
    from llmtrain.resolve import resolve

    base = tiny_overrides(tiny_corpus, str(tmp_path), "llama") + ["finetune.lora.rank=4"]

    def resolved(extra, world=2):
        return resolve(to_config(compose_config(base + extra)), world_size=world)

    run = resolved(["model.fuse_qkv=true", "model.fuse_ffn=true", "+parallel=tp2", "parallel.sequence_parallel=true"])
    n_lora = adapter_numel(run.cfg.model, run.cfg.finetune.lora)
    assert n_lora > 0 and run.flops_per_token == flops_per_token(run.cfg.model, 32, n_lora) < \
        flops_per_token(run.cfg.model, 32)
    resolved(["+parallel=zero2"])
    resolved(["+parallel=zero3"])
    with pytest.raises(ConfigError, match="finetune.lora.dropout=0.1 with parallel.tp=2"):
        resolved(["+parallel=tp2", "finetune.lora.dropout=0.1"])
