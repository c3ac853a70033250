"""The model families' end-to-end checks: one registry, one launch per layout for all of them.

    from family_checks import Family, register, FAMILIES
    register(Family(name="qwen3", make=make_qwen3, layouts=("tp2", "pp2"), held=held_qwen3, ...))   # at import
    python -m pytest tests/e2e/test_families_e2e.py -q

A family registers its tiny source checkpoint (made in the test: Hugging Face layout, real PaddleFormers), its
reference (`reference_loss(src, batch)`, `reference_logits(dir, ids)`: a forward we did not write through our
model: numpy of the published architecture, or the real package), and what each rank must hold per layout.
tests/e2e/test_families_e2e.py turns the registry into launches (tests/e2e/shared_launch.py):
- tp2: one fine-tuning run per family (and its LoRA run, `lora=True`) joins the shared tp2 launch of the other
  end-to-end files (global batch 8, micro-batch 2: that launch's batch layout);
- pp2: one continued-pretraining run per family in the shared pp2 launch (global batch 4, micro-batch 2);
- ep2 (dp2 x ep2): one continued-pretraining run per MoE family, in the shared dp2 launch (`+parallel=dp2
  parallel.ep=2`: the same processes and fleet topology; global batch 8, micro-batch 2).
Each run trains `STEPS` steps; its test then checks: step 1's loss equals the reference's on the same
micro-batches (1e-4), memory.json's per-rank parameter shapes (`held`), and the final checkpoint exported with
`--format auto` (the source's format; LoRA merged where the format has no adapter files) read back by the reference
with logits within 1e-4 of our model on the trained weights, and differing from the source's (training moved it).

To add a family (as family_qwen3.py, family_deepseek.py, family_ernie45.py do): write a `family_<name>.py` beside this file that
calls `register(...)`, and add its module name to `FAMILY_MODULES`; no new launch.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

STEPS = 3
GLOBAL_BATCH = {"tp2": 8, "pp2": 4, "ep2": 8}
"""Global batch per layout, micro-batch 2 everywhere (the shared launches' batch layouts)."""
ENTRY = {"tp2": "finetune", "pp2": "pretrain", "ep2": "pretrain"}
PARALLEL = {"tp2": ["+parallel=tp2"], "pp2": ["+parallel=pp2"], "ep2": ["+parallel=dp2", "parallel.ep=2"]}
LAUNCH = {"tp2": "tp2", "pp2": "pp2", "ep2": "dp2"}
"""The shared launch (tests/e2e/shared_launch.py) each layout's runs join."""
TOL = 1e-4
FAMILY_MODULES = ["family_qwen3", "family_deepseek", "family_ernie45"]
"""Modules (beside this file) whose import registers families."""


@dataclass
class Family:
    name: str
    """Run label, e.g. `qwen3`, `qwen3_moe`."""
    make: Callable
    """make(root, tiny_corpus) -> source directory (made once; holds its tokenizer files for fine-tuning)."""
    reference_loss: Callable
    """reference_loss(source_dir, micro_batch) -> the reference's training loss of one micro-batch (a dict with
    input_ids, labels, loss_mask, as the trainer's data gives them)."""
    reference_logits: Callable
    """reference_logits(directory, ids [b, s]) -> logits [b, s, V] of the reference reading `directory`."""
    held: Callable
    """held(layout, [per-rank {canonical name: {"shape": [...]}}]) -> None: asserts what each rank holds."""
    layouts: tuple = ("tp2", "pp2")
    """Layouts this family runs under (of tp2, pp2, ep2)."""
    lora: bool = False
    """Also a LoRA fine-tuning run under tp2 (exported merged where the format has no adapter files)."""
    finetune_overrides: list = field(default_factory=list)
    pretrain_overrides: list = field(default_factory=list)
    lora_targets: Optional[str] = None
    """finetune.lora.target_modules override (None: the default targets)."""
    extra: Optional[Callable] = None
    """extra(layout, run, ours, ids, tmp_path) -> dict of figures: the family's own further checks of a finished run
    (`ours`: our logits of its final checkpoint for `ids`), e.g. an adapter export read by the real package."""


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    assert family.name not in FAMILIES, f"family {family.name!r} registered twice"
    FAMILIES[family.name] = family
    return family


def load_families() -> dict[str, Family]:
    for module in FAMILY_MODULES:
        importlib.import_module(module)
    return FAMILIES


_SOURCES: dict = {}


def source(family: Family, root, tiny_corpus):
    """The family's source directory, made once (by whichever launch needs it first)."""
    if family.name not in _SOURCES:
        _SOURCES[family.name] = family.make(root / "sources" / family.name, tiny_corpus)
    return _SOURCES[family.name]


def _common(run_dir, layout):
    return [f"train.max_steps={STEPS}", f"train.global_batch_size={GLOBAL_BATCH[layout]}", "train.micro_batch_size=2",
            "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=1", "train.progress_bar=false",
            "train.visualdl=false", "train.loss_curve=false", "train.eval_interval=0", "checkpoint.save_final=true", "checkpoint.resume=none",
            f"run.dir={run_dir}"]


def run_overrides(family: Family, layout: str, src, tiny_corpus, run_dir, lora: bool = False) -> list[str]:
    """The Hydra overrides of `family`'s run under `layout` (fine-tuning on its tokenizer under tp2, continued
    pretraining on the tiny People's Daily corpus otherwise)."""
    if ENTRY[layout] == "finetune":
        extra = ["finetune.lora.rank=2", "finetune.lora.alpha=4"] if lora else []
        if lora and family.lora_targets:
            extra.append(f"finetune.lora.target_modules={family.lora_targets}")
        return [f"model.init_from={src}", f"data.files=[{sft_file(src)}]", f"data.tokenizer={src}",
                "data.seq_len=40", *family.finetune_overrides, *extra, *_common(run_dir, layout)]
    return [f"model.init_from={src}", f"data.prefixes=[{tiny_corpus['prefix']}]",
            f"data.tokenizer={tiny_corpus['tokenizer']}", "data.seq_len=32", "data.num_workers=0",
            *family.pretrain_overrides, *_common(run_dir, layout)]


EXAMPLES = [("人民日报的总部在哪里？", "人民日报社位于北京。"), ("请用一句话介绍长江。", "长江是中国最长的河流。"),
            ("一加一等于几？", "一加一等于二。"), ("谁写了《春》？", "朱自清写了《春》。"),
            ("今天天气怎么样？", "今天晴，适合出门。"), ("什么是分词？", "分词是把句子切成词语。")]


def sft_file(src):
    """The fine-tuning records beside a source directory (written by `write_sft`)."""
    return src.parent / f"{src.name}.sft.jsonl"


def write_sft(src) -> None:
    sft_file(src).write_text("\n".join(json.dumps({"prompt": p, "response": r}, ensure_ascii=False)
                                       for p, r in EXAMPLES) + "\n", encoding="utf-8")


def runs_of(layout: str) -> list[tuple[Family, bool]]:
    """(family, lora) of every run under `layout`."""
    out = []
    for fam in load_families().values():
        if layout in fam.layouts:
            out.append((fam, False))
            if layout == "tp2" and fam.lora:
                out.append((fam, True))
    return out


def run_name(family: Family, lora: bool) -> str:
    return family.name + ("_lora" if lora else "")


@dataclass
class Run:
    """One run of a launch: its family, LoRA or not, source directory, overrides (without the layout) and run dir."""

    family: Family
    lora: bool
    src: object
    overrides: list
    run_dir: object


def build(layout: str):
    """A shared_launch `build` for `layout`: (run_many entries, {run name: Run})."""
    def _build(root, tiny_corpus):
        entries, info = [], {}
        for fam, lora in runs_of(layout):
            src = source(fam, root.parent, tiny_corpus)
            run_dir = root / run_name(fam, lora)
            ov = run_overrides(fam, layout, src, tiny_corpus, run_dir, lora)
            entries.append({"overrides": ov + PARALLEL[layout], "entry": ENTRY[layout]})
            info[run_name(fam, lora)] = Run(fam, lora, src, ov, run_dir)
        return entries, info
    return _build


def first_step_batches(layout: str, overrides: list[str]):
    """The micro-batches of step 1 as the run's data gives them (the trainer's data class on the same config)."""
    from llmtrain.config import compose_config, to_config
    from llmtrain.data.loader import PretrainData
    from llmtrain.data.sft import SFTData
    from llmtrain.tokenizer import load_tokenizer

    entry = ENTRY[layout]
    cfg = to_config(compose_config(overrides, config_name="finetune" if entry == "finetune" else "config"))
    cls = SFTData if entry == "finetune" else PretrainData
    data = cls(cfg.data, seed=cfg.seed, global_batch_size=GLOBAL_BATCH[layout], micro_batch_size=2, dp_world=1,
               tokenizer=load_tokenizer(cfg.data.tokenizer))
    return data.next_step()


def trained_logits(run_dir, ids):
    """Our model's logits on the final checkpoint's weights (LoRA: merged into its base)."""
    import paddle

    from llmtrain.checkpoint.reader import Manifest, base_state, model_state
    from llmtrain.interop.lora_format import merge_adapters
    from llmtrain.models import build_model
    from llmtrain.models.init import load_full_state
    from llmtrain.models.stages import canonical_parameters

    manifest = Manifest.read(str(run_dir / "checkpoints" / f"step_{STEPS}"))
    cfg, state = manifest.model, dict(model_state(manifest))
    if manifest.lora is not None:
        state = merge_adapters(base_state(manifest), state, manifest.lora.alpha / manifest.lora.rank)
    model = build_model(cfg)
    load_full_state(canonical_parameters(model), state)
    model.eval()
    with paddle.no_grad():
        return cfg, model(paddle.to_tensor(ids)).numpy().astype(np.float64)


def check_run(layout: str, name: str, run: Run, tmp_path) -> dict:
    """Every check of one run (see the module docstring); returns its figures (printed by the test)."""
    from launch import metrics

    from llmtrain.export import export_checkpoint

    fam, src, overrides, run_dir = run.family, run.src, run.overrides, run.run_dir
    train = [r for r in metrics(run_dir) if "loss" in r]
    assert len(train) == STEPS and all(np.isfinite(r["loss"]) for r in train), (layout, name, train)
    want = float(np.mean([fam.reference_loss(src, mb) for mb in first_step_batches(layout, overrides)]))
    assert abs(train[0]["loss"] - want) < TOL, (layout, name, train[0]["loss"], want)

    ranks = json.loads((run_dir / "memory.json").read_text())["ranks"]
    fam.held(layout, [e["params"] for e in sorted(ranks, key=lambda e: e["rank"])])

    out = tmp_path / f"exported_{layout}_{name}"
    info_out = export_checkpoint(str(run_dir), str(out))  # --format auto: the source's format
    ids = np.random.default_rng(2).integers(0, 300, (2, 40))  # ids below every family's vocabulary
    cfg, ours = trained_logits(run_dir, ids)
    got = fam.reference_logits(out, ids)
    diff = float(np.abs(ours - got).max())
    assert np.abs(ours - fam.reference_logits(src, ids)).max() > TOL, (layout, name, "training changed nothing")
    assert diff <= TOL, (layout, name, diff)
    more = fam.extra(layout, run, ours, ids, tmp_path) if fam.extra else {}
    return dict(loss=train[0]["loss"], reference=want, export_diff=diff, family=info_out["family"],
                notes=info_out.get("notes"), **more)
