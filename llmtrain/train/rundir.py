"""A run directory belongs to one run: what it holds is checked before any work; an old run is moved aside on request.

    python llmtrain/pretrain.py run.dir=outputs/a checkpoint.resume=none   # exit 2 when outputs/a holds another run
    python llmtrain/pretrain.py run.dir=outputs/a run.overwrite=true       # the old run -> outputs/a.old-1; a new run
    python llmtrain/pretrain.py checkpoint.resume=outputs/b                # a run directory: its newest checkpoint
    review = review_run_dir(cfg, layout, tokenizer)   # llmtrain.resolve: problems, the checkpoint a resume reads
    claim_run_dir(run)                                # the recipes, before any process group: run.overwrite's move

What `llmtrain.resolve` checks, on every rank, before any process group starts:
- `checkpoint.resume=none` (a new run) in a directory holding checkpoints is refused with the ways out: a new
  `run.dir`, `run.overwrite=true` (the old run is moved aside to `<run.dir>.old-<k>`, never deleted), or
  `checkpoint.resume=auto` to continue it;
- `checkpoint.resume=auto` with checkpoints there: the newest one the resume would take is reviewed by the
  resume contract (`llmtrain.train.contract`); a config that cannot continue it (another model shape, seed,
  tokenizer, an LR jump) is refused up front with what to set to continue it and how to start a new run instead;
  damaged checkpoints are named (with `python -m llmtrain.checkpoint.rebuild` when only the manifest is); when
  every one is damaged the run is refused (a new run there would replace them) with the choices;
- a resume from a checkpoint older than the directory's newest moves the later checkpoints and metrics to
  `<run.dir>/superseded/<k>/` first (`llmtrain.train.branch`), said in the log;
- `checkpoint.resume=PATH`: a `step_<N>` directory, or a run directory (or its `checkpoints/`), whose newest
  complete checkpoint is taken (as `python -m llmtrain.export` and `generate` do); missing, incomplete or corrupt
  is a problem; continuing another directory's checkpoint inside a run directory that holds a run is refused
  (the two would mix);
- a run already at `train.max_steps` is `RunFinished`: the entry script says so and exits 0.
"Complete" here is the manifest and every file it lists present with its recorded size; the sha256 of every file
is verified when the checkpoint is loaded, shared among the ranks (hashing a large checkpoint on every rank up
front would cost minutes).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from llmtrain.checkpoint.health import resume_order
from llmtrain.checkpoint.listing import STEP_DIR, list_checkpoints
from llmtrain.checkpoint.reader import describe_manifest
from llmtrain.checkpoint.rebuild import manifest_only_damage, rebuild_command
from llmtrain.checkpoint.verify import verify_files
from llmtrain.train.branch import Branch, plan_branch, set_branch_aside
from llmtrain.utils.log import global_rank, log0


@dataclass
class RunDirReview:
    """What the run directory and `checkpoint.resume` mean for this run (identical on every rank)."""

    problems: list = field(default_factory=list)
    """Config problems (each a line of the ConfigError)."""
    resume: str = "auto"
    """The `checkpoint.resume` the run uses: `auto`, `none`, or a `step_<N>` directory (a run directory given there
    is replaced by its newest complete checkpoint; run.overwrite=true makes `auto` `none`)."""
    move_aside: Optional[str] = None
    """run.overwrite=true and the directory holds something: where it is moved before any work."""
    finished: Optional[str] = None
    """The message of a run already at train.max_steps (nothing to train), else None."""
    notes: list = field(default_factory=list)
    """What rank 0 logs (the run and step a resume continues)."""
    branch: Optional[Branch] = None
    """A resume from a checkpoint older than the directory's newest: the later ones, moved aside by
    `claim_run_dir` (`llmtrain.train.branch`)."""


def quick_problems(ckpt_dir: str) -> list[str]:
    """Problems of a checkpoint seen without hashing: a readable manifest of our format and every file it lists
    present with its recorded size (`verify.verify_files` without checksums)."""
    return verify_files(ckpt_dir, checksums=False)


def _manifest(ckpt_dir: str) -> dict:
    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        return json.load(f)


def describe_checkpoint(ckpt_dir: str, manifest: Optional[dict] = None) -> str:
    """`step 200 of run gpt-tiny-dp2 (model gpt-tiny, layout dp2, 409600 tokens)` (`reader.describe_manifest`)."""
    return describe_manifest(manifest if manifest is not None else _manifest(ckpt_dir))


def _free(path: str, suffix: str, k: int) -> str:
    """`<path><suffix><k>` for the first k from `k` that does not exist."""
    path = path.rstrip("/")
    while os.path.exists(f"{path}{suffix}{k}"):
        k += 1
    return f"{path}{suffix}{k}"


def aside_path(run_dir: str) -> str:
    """Where run.overwrite=true moves an old run: `<run.dir>.old-<k>`, the first that does not exist."""
    return _free(run_dir, ".old-", 1)


def ways_out(run_dir: str) -> str:
    """The two ways to start a new run when `run_dir` holds another one (the overrides, with paths)."""
    return (f"start the new run in its own directory (run.dir={_free(run_dir, '-', 2)}), or run.overwrite=true to "
            f"move the old run aside to {aside_path(run_dir)} (nothing is deleted)")


def explicit_checkpoint(how: str) -> tuple[Optional[str], list[str], list[str]]:
    """(the step_<N> directory `checkpoint.resume=how` names, problems, notes): `how` itself, or the newest complete
    checkpoint of a run directory (or its `checkpoints/`)."""
    if not os.path.isdir(how):
        return None, [f"checkpoint.resume={how}: no such directory; give a step_<N> checkpoint directory, a run "
                      "directory (its newest complete checkpoint is taken), auto or none"], []
    if os.path.isfile(os.path.join(how, "manifest.json")) or STEP_DIR.match(os.path.basename(how.rstrip("/"))):
        bad = quick_problems(how)
        return (None, [f"checkpoint.resume={how} is incomplete or corrupt: " + "; ".join(bad)], []) if bad \
            else (how, [], [])
    root = os.path.join(how, "checkpoints") if os.path.isdir(os.path.join(how, "checkpoints")) else how
    skipped = []
    for _, path in list_checkpoints(root):
        bad = quick_problems(path)
        if not bad:
            return path, [], [f"checkpoint.resume={how}: a run directory; its newest complete checkpoint is {path}"]
        skipped.append("; ".join(bad))
    return None, [f"checkpoint.resume={how}: no complete checkpoint (step_<N>/ with its manifest.json) under {root}"
                  + (" (incomplete: " + " | ".join(skipped) + ")" if skipped else "")], []


def damage_note(path: str, problems: list[str]) -> str:
    """`step_10 (what is wrong)`, with the command that rebuilds its manifest when only the manifest is damaged."""
    if manifest_only_damage(path, problems):
        return (f"{os.path.basename(path)} ({'; '.join(problems)}; its tensor files match their listings: only the "
                f"manifest is damaged; `{rebuild_command(path)}` rebuilds it)")
    return f"{os.path.basename(path)} ({'; '.join(problems)})"


def all_damaged(run_dir: str, damaged: dict) -> str:
    """The refusal of `checkpoint.resume=auto` when every checkpoint of `run_dir` is damaged."""
    rebuildable = [p for p, v in damaged.items() if manifest_only_damage(p, v)]
    return (f"run.dir={run_dir}: every checkpoint there is damaged, so checkpoint.resume=auto has nothing to continue "
            f"and nothing was changed: " + "; ".join(damage_note(p, v) for p, v in damaged.items()) + ". Choices: "
            + (f"rebuild the manifest (`{rebuild_command(rebuildable[0])}`) and run the same command again to "
               "continue the run; " if rebuildable else "")
            + f"start a new run in its own directory (checkpoint.resume=none run.dir={_free(run_dir, '-', 2)}); or "
            f"run.overwrite=true to move the old run aside to {aside_path(run_dir)} (nothing is deleted) and start a "
            "new run here")


def _inside(path: str, run_dir: str) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(run_dir).rstrip(os.sep) + os.sep)


def _continue(review: RunDirReview, ckpt: str, cfg, layout, tokenizer, header: str,
              damaged: Optional[dict] = None) -> None:
    """Review resuming `ckpt` under `cfg`: its refusals become problems under `header`; a finished run is said;
    later checkpoints of the run directory (`damaged`: {path: problems} among them) make a `Branch`."""
    from llmtrain.train.contract import review_manifest

    manifest = _manifest(ckpt)
    what = describe_checkpoint(ckpt, manifest)
    if layout is not None:
        r = review_manifest(manifest, cfg, layout, tokenizer)
        if r.refused:
            review.problems.append(f"{header} ({ckpt}: {what}); what stops it:")
            review.problems += [f"resume from step {manifest['step']}: {p}" for p in r.refused]
            return
    review.notes.append(f"continuing {what} from {ckpt}")
    if int(manifest["step"]) >= cfg.train.max_steps:
        review.finished = (f"nothing to train: run.dir={cfg.run.dir} holds {what} ({ckpt}), already at "
                           f"train.max_steps={cfg.train.max_steps}. To train on, raise train.max_steps (with "
                           f"optim.on_resume=config to stretch the LR schedule, or optim.on_resume=checkpoint to keep "
                           f"it; docs/changing-runs.md); to start a new run instead: {ways_out(cfg.run.dir)}")
        return
    if _inside(ckpt, cfg.run.dir):
        review.branch = plan_branch(cfg.run.dir, ckpt, int(manifest["step"]), damaged)  # said when moved


def review_run_dir(cfg, layout, tokenizer) -> RunDirReview:
    """Check `cfg.run.dir` and `cfg.checkpoint.resume` against what the directory holds (see the module doc).
    `layout`: the resolved layout, None when it has problems of its own (the resume contract is then not asked)."""
    run_dir, how = cfg.run.dir, cfg.checkpoint.resume
    held = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    review = RunDirReview(resume=how)
    target = None
    if how not in ("auto", "none"):
        target, review.problems, review.notes = explicit_checkpoint(how)
        if target is None:
            return review
        review.resume = target
    if cfg.run.overwrite:
        if target is not None and _inside(target, run_dir):
            review.problems.append(f"run.overwrite=true with checkpoint.resume={how}: the checkpoint is inside "
                                   f"run.dir={run_dir}, which is moved aside first; resume from a checkpoint outside "
                                   "it, or drop run.overwrite=true to branch this run from it")
            return review
        if os.path.isdir(run_dir) and os.listdir(run_dir):
            review.move_aside = aside_path(run_dir)
            review.notes.append(f"run.overwrite=true: {run_dir} holds "
                                + (f"a run (newest checkpoint step_{held[0][0]})" if held else "files")
                                + f"; moving it aside to {review.move_aside} before the new run starts")
        if target is None:
            review.resume = "none"
            return review
    names = ", ".join(os.path.basename(p) for _, p in held[:6]) + (", ..." if len(held) > 6 else "")
    if how == "none":
        if held:
            review.problems.append(
                f"run.dir={run_dir} holds another run's checkpoints ({names}; the newest is "
                f"{describe_checkpoint(held[0][1]) if not quick_problems(held[0][1]) else 'incomplete'}) and "
                f"checkpoint.resume=none starts a new run there: the two runs would mix. Either {ways_out(run_dir)}; "
                "or checkpoint.resume=auto to continue the run that is there")
        return review
    if target is not None:
        if held and not cfg.run.overwrite and not _inside(target, run_dir):
            review.problems.append(
                f"run.dir={run_dir} holds a run ({names}) and checkpoint.resume={how} continues a checkpoint from "
                f"elsewhere: the two would mix in {run_dir}. Either {ways_out(run_dir)}; or checkpoint.resume=auto "
                "to continue the run that is there")
            return review
        _continue(review, target, cfg, layout, tokenizer, f"checkpoint.resume={how} cannot be continued by this "
                                                          f"configuration; to start a new run from it instead: "
                                                          f"model.init_from={target} (weights only)")
        return review
    ordered, passed_over = resume_order([p for _, p in held])  # healthy ones first; the newer anomalous are named
    review.notes += passed_over
    damage = {p: quick_problems(p) for p in ordered}
    newest = next((p for p in ordered if not damage[p]), None)
    damaged = {p: v for p, v in damage.items() if v}
    if newest is None and held:  # nothing to continue: a new run here would replace the damaged ones
        review.problems.append(all_damaged(run_dir, damaged))
    elif newest is not None:
        if damaged:
            review.notes += [f"checkpoint.resume=auto: skipping damaged {damage_note(p, v)}" for p, v in damaged.items()]
        _continue(review, newest, cfg, layout, tokenizer,
                  f"run.dir={run_dir} holds a run this configuration cannot continue (checkpoint.resume=auto would "
                  f"resume it). To continue it, set what is named below; to start a new run, {ways_out(run_dir)}",
                  damaged)
    return review


def claim_run_dir(run) -> None:
    """Rank 0, before any process group starts: a resume from an older checkpoint moves the later ones aside
    (`branch.set_branch_aside`); run.overwrite=true moves what the run directory holds aside to
    `run.move_aside` (renamed, never deleted). The other ranks start no work before rank 0 joins the process
    groups, so nothing of the new run is written before the moves."""
    if run.run_dir is None or global_rank() != 0:
        return
    run_dir, aside = run.cfg.run.dir, run.run_dir.move_aside
    if run.run_dir.branch is not None:  # a resume from an older checkpoint: the later ones set aside first
        set_branch_aside(run_dir, run.run_dir.branch)
    if aside is None:
        return
    if os.path.isdir(run_dir) and os.listdir(run_dir) and not os.path.exists(aside):
        os.rename(run_dir, aside)
        os.makedirs(run_dir, exist_ok=True)
        log0(f"run.overwrite=true: the previous run of {run_dir} is now {aside}")
