"""The resume contract, one test per row of the table in docs/changing-runs.md (pure: no training).

    python -m pytest tests/train/test_contract.py -q

Each test composes the checkpoint's config and the new one with Hydra, as the recipes do, and
asks `review_resume` what a resume at step 4 does. The end-to-end runs of the rows (the refusal
reaching the user, batch/AMP honoured, both on_resume choices) are in test_changing_runs.py; any
layout to any layout is tests/checkpoint/test_resume.py.
"""
from __future__ import annotations

import functools

import pytest
from omegaconf import OmegaConf

from llmtest import compose, tiny_overrides
from llmtrain.train.contract import LR_RTOL, review_resume

CORPUS = {"prefix": "/data/pd_text_document", "tokenizer": "/data/tokenizer"}
TOK = {"name": "bpe", "sha256": "ab" * 32, "vocab_size": 2560, "sp_vocab_size": 2500, "pad_multiple": 128,
       "model_type": "bpe", "special_ids": {"pad": 0, "unk": 1, "bos": 2, "eos": 3, "mask": None, "eod": 3}}


@functools.lru_cache(maxsize=None)
def _composed(groups: tuple) -> "OmegaConf":
    return compose([*tiny_overrides(CORPUS, "/runs/r", "gpt", steps=4), "optim.warmup_steps=1",
                    "model.vocab_size=2560", *groups])


def cfg(*extra, steps=4):
    """The resolved config as a checkpoint stores it (Hydra composes group choices; values merge on top)."""
    groups = tuple(e for e in extra if e.startswith("+"))
    values = [e for e in extra if not e.startswith("+")] + [f"train.max_steps={steps}"]
    c = OmegaConf.merge(_composed(groups), OmegaConf.from_dotlist(values))
    return OmegaConf.to_container(c, resolve=True)


def review(old=(), new=(), old_steps=4, new_steps=4, tok=TOK, step=4):
    return review_resume(cfg(*old, steps=old_steps), cfg(*new, steps=new_steps), TOK, tok, step)


def test_same_config_nothing_to_say():
    r = review()
    assert not r.refused and not r.warnings and not r.honoured


def test_layout_degrees_honoured():
    r = review(new=["+parallel=dp2tp2"])
    assert not r.refused and not r.warnings and any(h.startswith("parallel.") for h in r.honoured)


def test_a_new_layout_reports_only_what_changed():
    """One device -> dp2: the degree and the layout's name, not a line for each of ~25 parallel fields (issue 38 §5)."""
    r = review(new=["+parallel=dp2"])
    assert [h.split(":")[0] for h in r.honoured] == ["parallel.dp=1 in the checkpoint, 2 now",
                                                      "parallel.name='single' in the checkpoint, 'dp2' now",
                                                      "run.name='gpt-tiny-single' in the checkpoint, 'gpt-tiny-dp2' now"]
    more = review(old=["+parallel=tp2"], new=["+parallel=tp2", "parallel.pp=2"])
    assert [h.split(":")[0] for h in more.honoured] == ["parallel.pp=1 in the checkpoint, 2 now",
                                                         "run.name='gpt-tiny-tp2' in the checkpoint, 'gpt-tiny-tp2pp2' now"]


def test_every_refusal_says_the_override_that_gets_past_it():
    r = review(new=["model.hidden_size=64", "seed=7", "optim.name=sgd"])
    assert sorted(p.rsplit("; to continue this run: ", 1)[1] for p in r.refused) == \
        ["model.hidden_size=32", "optim.name=adamw", "seed=1234"]
    other = review(new=["data.tokenizer=/elsewhere/tokenizer"], tok=dict(TOK, sha256="cd" * 32))
    assert other.refused[0].endswith("to continue this run: data.tokenizer=/data/tokenizer (the checkpoint's)")
    assert "optim.on_resume=config" in review(new_steps=8).refused[0]


def test_the_divergence_stop_advice_works_as_written():
    """The stop message's advice, followed as written (a lower optim.lr, resumed with the overrides it names), is
    accepted by the resume contract; the old advice (a lower optim.lr and checkpoint.resume=auto alone) was refused
    with "Set optim.on_resume=config" (issue 38 §5)."""
    import re

    from llmtrain.train.anomaly_report import STOP_ADVICE

    advice = re.findall(r"\b([a-z_.]+=\S+)", STOP_ADVICE.split(": ")[-1])
    assert advice == ["optim.lr=<lower>", "optim.on_resume=config", "checkpoint.resume=auto"], advice
    followed = [a.replace("<lower>", "5e-4") for a in advice]  # the checkpoint's run: optim.lr=1e-3
    assert not review(new=followed, step=2).refused
    assert "Set optim.on_resume=config" in review(new=["optim.lr=5e-4", "checkpoint.resume=auto"], step=2).refused[0]


def test_schedule_change_moving_the_lr_refused_unless_chosen():
    r = review(new_steps=8)
    assert len(r.refused) == 1
    msg = r.refused[0]
    assert "train.max_steps=4 in the checkpoint, 8 now" in msg and "optim.on_resume=config" in msg
    assert r.lr_checkpoint == pytest.approx(3e-5) and r.lr_config > 10 * r.lr_checkpoint
    assert f"{r.lr_checkpoint:.6g}" in msg and f"{r.lr_config:.6g}" in msg
    chose = review(new=["optim.on_resume=config"], new_steps=8)
    assert not chose.refused and chose.schedule_from == "config"
    kept = review(new=["optim.on_resume=checkpoint"], new_steps=8)
    assert not kept.refused and kept.schedule_from == "checkpoint"
    assert any("train.max_steps=4" in w for w in kept.warnings)
    lr = review(new=["optim.lr=2e-3"], step=2)  # mid-decay: a new peak moves the LR
    assert "optim.lr=0.001 in the checkpoint, 0.002 now" in lr.refused[0]


def test_schedule_change_within_tolerance_honoured():
    """min_lr moved by far less than LR_RTOL of the resume step's LR (a warmup step, which min_lr does not touch)."""
    r = review(new=["optim.min_lr=3.1e-5"], step=0)
    assert not r.refused and any("optim.min_lr" in h for h in r.honoured)
    wsd = ("optim.schedule=wsd", "optim.decay_fraction=0.5")
    ext = review(old=wsd, new=wsd, old_steps=6, new_steps=10, step=2)  # a stable checkpoint, longer horizon
    assert not ext.refused and ext.lr_checkpoint == ext.lr_config == pytest.approx(1e-3)
    assert LR_RTOL <= 1e-3


def test_batch_sizes_honoured():
    r = review(new=["train.global_batch_size=16", "train.micro_batch_size=4", "train.batch_rampup=[4,4,64]"])
    assert not r.refused and not r.warnings and len(r.honoured) == 3


def test_seq_len_and_mixture_warn():
    r = review(new=["data.seq_len=48", "data.prefixes=[/data/a,/data/b]", "data.weights=[0.5,0.5]"])
    assert not r.refused
    text = "\n".join(r.warnings)
    assert "data.seq_len=32 in the checkpoint, 48 now" in text and "data.weights=None" in text
    assert "sample order" in text


def test_tokenizer_refused_unless_vocabulary_identical():
    moved = review(new=["data.tokenizer=/elsewhere/tokenizer"])  # same identity, another path
    assert not moved.refused and not moved.warnings
    other = dict(TOK, sha256="cd" * 32)
    r = review(new=["data.tokenizer=/elsewhere/tokenizer"], tok=other)
    assert len(r.refused) == 1 and "data.tokenizer: vocabulary differs (sha256" in r.refused[0]


def test_model_shape_refused():
    r = review(new=["model.hidden_size=64", "model.num_layers=2"])
    text = "\n".join(r.refused)
    assert "model.hidden_size=32 in the checkpoint, 64 now: refused" in text
    assert "model.num_layers=4 in the checkpoint, 2 now: refused" in text
    assert not review(new=["model.attention=math"]).refused


def test_seed_refused_with_the_reason():
    r = review(new=["seed=7"])
    assert len(r.refused) == 1 and "seed=1234 in the checkpoint, 7 now: refused" in r.refused[0]
    assert "sample order" in r.refused[0]


def test_amp_honoured():
    r = review(new=["train.amp=bf16"])
    assert not r.refused and not r.warnings and "train.amp='none' in the checkpoint, 'bf16' now" in r.honoured[0]


def test_optimizer_hyperparameters_warn():
    r = review(new=["optim.weight_decay=0.0", "optim.clip_grad=0.5"])
    assert not r.refused and len(r.warnings) == 2


def test_bookkeeping_honoured():
    r = review(new=["train.log_interval=2", "checkpoint.interval=10", "run.dir=/runs/other", "train.eval_interval=5"])
    assert not r.refused and not r.warnings and len(r.honoured) == 4


def test_schedule_kept_by_on_resume_checkpoint_stays_the_reference():
    """A checkpoint written while optim.on_resume=checkpoint kept an older schedule (horizon 4) records that
    schedule: resuming it with the same config (max_steps 8, on_resume unset) is refused, not a silent LR jump."""
    from types import SimpleNamespace

    from llmtrain.config import ConfigError, to_config
    from llmtrain.train.contract import apply_resume_contract
    from llmtrain.train.schedule import WarmupDecay

    written = cfg("optim.on_resume=checkpoint", steps=8)  # the run that kept the 4-step schedule
    manifest = {"step": 6, "config": OmegaConf.to_yaml(OmegaConf.create(written)), "tokenizer": None,
                "schedule_in_force": {"optim": written["optim"] | {"on_resume": None}, "max_steps": 4}}
    now = to_config(OmegaConf.merge(_composed(()), OmegaConf.from_dotlist(["train.max_steps=8"])))
    sched = WarmupDecay(now.optim, 8)
    with pytest.raises(ConfigError) as e:
        apply_resume_contract(manifest, SimpleNamespace(cfg=now, tokenizer=None), sched)
    assert "train.max_steps=4 in the checkpoint, 8 now" in str(e.value)
    kept = to_config(OmegaConf.merge(_composed(()), OmegaConf.from_dotlist(["train.max_steps=8",
                                                                            "optim.on_resume=checkpoint"])))
    apply_resume_contract(manifest, SimpleNamespace(cfg=kept, tokenizer=None), sched)
    assert sched.max_steps == 4  # the kept schedule stays in force


def test_schedule_check_at_the_sample_position_under_rampup():
    """Under train.batch_rampup the LR of the step after the resume is the schedule's at consumed samples /
    train.global_batch_size, where the run stands, not at the step: step 5 of the ramp [4,4,48] to 16 has consumed 16
    samples, position 1.0, the peak under both horizons (warmup 1), so a longer horizon is honoured (at step 5 the two
    cosines differ). Switching the ramp-up off there moves the position from 1 to 5: refused unless chosen."""
    from types import SimpleNamespace

    from llmtrain.config import ConfigError, to_config
    from llmtrain.parallel.layout import layout_problems
    from llmtrain.train.config import OptimConfig
    from llmtrain.train.contract import apply_resume_contract
    from llmtrain.train.schedule import WarmupDecay, lr_at

    ramp = ["train.global_batch_size=16", "train.batch_rampup=[4,4,48]"]
    written = cfg(*ramp, steps=10)
    manifest = {"step": 5, "config": OmegaConf.to_yaml(OmegaConf.create(written)), "tokenizer": None,
                "data": {"consumed_samples": 16, "global_batch_size": 16}}

    def resume(*values):
        now = to_config(OmegaConf.merge(_composed(()), OmegaConf.from_dotlist(list(values))))
        layout, problems = layout_problems(now.parallel, now.train, 1)
        assert not problems, problems
        return apply_resume_contract(manifest, SimpleNamespace(cfg=now, tokenizer=None, layout=layout),
                                     WarmupDecay(now.optim, now.train.max_steps))

    longer = resume(*ramp, "train.max_steps=12")
    assert longer.lr_checkpoint == longer.lr_config == pytest.approx(1e-3)
    assert any("train.max_steps=10 in the checkpoint, 12 now: honoured" in h for h in longer.honoured)
    assert review(old=ramp, new=ramp, old_steps=10, new_steps=12, step=5).refused  # the step would say it moved
    with pytest.raises(ConfigError) as e:
        resume("train.global_batch_size=16", "train.max_steps=10")
    assert "schedule position (consumed samples / train.global_batch_size under train.batch_rampup, else the step)=1 " \
           "in the checkpoint, 5 now" in str(e.value)
    chose = resume("train.global_batch_size=16", "train.max_steps=10", "optim.on_resume=config")
    assert chose.lr_config == pytest.approx(lr_at(5, OptimConfig(**written["optim"]), 10)) and not chose.refused



def _schema_fields(cls, prefix: str = "") -> set[str]:
    """Every dotted field of a config dataclass, through nested (and Optional) dataclasses; the Optional groups
    themselves too (they may be null as a whole: `parallel`)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        t, path = hints[f.name], prefix + f.name
        args = [a for a in typing.get_args(t) if a is not type(None)]
        inner = t if dataclasses.is_dataclass(t) else (args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0])
                                                       else None)
        if inner is None:
            out.add(path)
            continue
        if len(args) == 1 and type(None) in typing.get_args(t):
            out.add(path)
        out |= _schema_fields(inner, path + ".")
    return out


def test_every_config_field_has_an_explicit_rule():
    """The contract is total: every field of the pretraining and fine-tuning schemas, and of the composed configs as
    the recipes see them (with a layout and LoRA adapters), is named by a rule of its own; no rule names a field
    that does not exist. A field added without a rule fails here (and is refused at resume)."""
    from llmtrain.config import Config, FinetuneConfig, compose_config
    from llmtrain.train.contract import RULES, flatten, rule_of

    named = {path for path, _, _ in RULES}
    fields = _schema_fields(Config) | _schema_fields(FinetuneConfig)
    composed = set()
    for overrides, name in (([*tiny_overrides(CORPUS, "/runs/r", "gpt"), "+parallel=dp2", "finetune.lora.rank=4"],
                             "config"),
                            ([f"data.tokenizer={CORPUS['tokenizer']}", "data.files=[/data/sft.jsonl]", "+parallel=tp2",
                              "finetune.lora.rank=4"], "finetune")):
        composed |= set(flatten(OmegaConf.to_container(compose_config(overrides, config_name=name), resolve=False)))
    assert composed - {f for f in fields} == set(), "composed fields the schemas do not list"
    missing = sorted(fields - named)
    assert not missing, f"config fields without a resume rule in llmtrain/train/contract.py RULES: {missing}"
    stale = sorted(named - fields)
    assert not stale, f"RULES names fields no config has: {stale}"
    # no default: a field the contract does not name is refused, naming the field
    r = review_resume({**cfg(), "new_field": 1}, {**cfg(), "new_field": 2}, TOK, TOK, 4)
    assert rule_of("new_field")[0] == "refuse" and len(r.refused) == 1 and "new_field=1" in r.refused[0], r.refused
