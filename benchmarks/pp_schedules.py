"""Wall time of the pipeline schedules on the same work: 1F1B vs interleaved vs DualPipeV, pp2 and pp4 CPU processes,
beside the planner's predicted step and bubble.

    python benchmarks/pp_schedules.py [--rounds 2] [--steps 6] [--hidden 128] [--layers 8] [--seq 64]

One tiny People's Daily corpus is built (as the tests build theirs). Then one `paddle.distributed.launch` per pp
runs that pp's schedules in the same processes, alternating (`tests/e2e/multirun_worker.py`: 1F1B, [interleaved,]
DualPipeV, 1F1B, ... `--rounds` times), so the schedules share the host's phases (other processes on this 2-core
host move a run's speed by up to 3x between minutes; side by side, interleaved, is the only fair comparison). Every
run trains the same Llama (`--layers` blocks of `--hidden`, sequences of `--seq`, global batch 16 of micro-batches
of 1, so 16 micro-batches a step: >= 2 x pp for DualPipeV and the interleaved 1F1B) through the real entry
function; its step time is the median of `step_time` in its metrics.jsonl after the first 2 steps. One process
runs the same work in its own rounds (the ideal below). Layouts: pp2 1f1b, pp2 dualpipev, pp4 1f1b, pp4
interleaved (2 virtual stages), pp4 dualpipev; interleaved at pp2 is not run (Paddle 3.3.1 asserts pp > 2 for it).

Printed as markdown: per layout the step (s) of each round, its ratio to 1F1B at the same pp in the same round
(the mean over rounds), the excess over the ideal (one process's step / min(pp, cores): what a bubble-free pipeline with free
send/recv would take on this host), and the planner's step and bubble (`llmtrain.plan.estimate.time_estimate` on
the packaged `cpu-here` profile, this run's model and batch; DualPipeV priced by
`llmtrain.plan.dualpipe_bubble`). On a 2-core host 4 processes share 2 cores: a stage idle in the bubble lends
its core to another, so pp4 wall times show less of the bubble than a machine with a core per stage would.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYOUTS = [  # (name, processes, overrides)
    ("pp2 1f1b", 2, ["+parallel=pp2"]),
    ("pp2 dualpipev", 2, ["+parallel=pp2dpv"]),
    ("pp4 1f1b", 4, ["+parallel=pp4"]),
    ("pp4 interleaved v2", 4, ["+parallel=pp4v2"]),
    ("pp4 dualpipev", 4, ["+parallel=pp4dpv"]),
]
BATCH = ["train.global_batch_size=16", "train.micro_batch_size=1"]


def build_corpus(root: str) -> dict:
    """80 People's Daily articles, a 2500-piece BPE tokenizer, MMIDIDX files (tests/conftest.py's tiny corpus)."""
    from llmtrain.corpus.parse import ParseOptions
    from llmtrain.corpus.peoples_daily import records
    from llmtrain.data.preprocess import preprocess
    from llmtrain.tokenizer.train import main as train_tokenizer

    jsonl = os.path.join(root, "pd.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for r in records(limit=80):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tok = os.path.join(root, "tokenizer")
    assert train_tokenizer(["--input", jsonl, "--vocab-size", "2500", "--output", tok,
                            "--character-coverage", "0.995"]) == 0
    prefix = os.path.join(root, "pd_text_document")
    preprocess([jsonl], tok, prefix, workers=0, opt=ParseOptions(words_key="words"), word_boundaries="gold",
               progress=False)
    return {"tokenizer": tok, "prefix": prefix}


def model_overrides(corpus: dict, *, hidden: int, layers: int, seq: int, steps: int) -> list[str]:
    return ["model=llama-tiny", f"model.hidden_size={hidden}", f"model.num_layers={layers}", "model.num_heads=4",
            "model.num_kv_heads=4", f"model.ffn_hidden_size={4 * hidden}", f"data.prefixes=[{corpus['prefix']}]",
            f"data.tokenizer={corpus['tokenizer']}", "data.num_workers=0", f"train.max_steps={steps}",
            "train.progress_bar=false", "train.visualdl=false", "checkpoint.save_final=false",
            "checkpoint.resume=none", "train.eval_interval=0", f"data.seq_len={seq}", *BATCH]


def median_step(run_dir: str) -> float:
    """Median step_time (s) after the first 2 steps of one run."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return statistics.median(r["step_time"] for r in map(json.loads, f) if "step_time" in r and r["step"] > 2)


def launch(nproc: int, runs: list[list[str]], workdir: str) -> None:
    """The runs (override lists), one after another in the same `nproc` processes (one process: in this one's
    child)."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    spec = os.path.join(workdir, "runs.json")
    with open(spec, "w") as f:
        json.dump([{"overrides": r} for r in runs], f)
    worker = os.path.join(REPO, "tests", "e2e", "multirun_worker.py")
    cmd = [sys.executable, worker, spec] if nproc == 1 else [
        sys.executable, "-m", "paddle.distributed.launch", "--log_dir", os.path.join(workdir, "log"),
        "--nproc_per_node", str(nproc), worker, spec]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def planned(overrides: list[str], nproc: int, run_dir: str) -> dict:
    """The planner's step and bubble (s) for the layout on the packaged cpu-here profile, all ranks on one host
    (the config resolved as the run resolves it: vocabulary from the tokenizer, the pipeline split)."""
    from llmtrain.config import compose_config, to_config
    from llmtrain.plan.estimate import time_estimate
    from llmtrain.plan.profile import load_profile
    from llmtrain.resolve import resolve

    run = resolve(to_config(compose_config(overrides + [f"run.dir={run_dir}"])), world_size=nproc)
    est = time_estimate(run.cfg.model, run.layout, run.cfg.data.seq_len, False, load_profile("cpu-here"), nproc,
                        amp="none")
    return {"step_s": est["step_time_s"], "bubble_s": est["bubble_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="pp_schedules_") as tmp:
        corpus = build_corpus(tmp)
        base = model_overrides(corpus, hidden=args.hidden, layers=args.layers, seq=args.seq, steps=args.steps)
        rows = {name: [] for name, _, _ in LAYOUTS}
        single = []
        for nproc in (1, 2, 4):
            members = [(name, extra) for name, n, extra in LAYOUTS if n == nproc] if nproc > 1 else [("single", [])]
            runs, dirs = [], []
            for r in range(args.rounds):
                for name, extra in members:
                    dirs.append((name, os.path.join(tmp, f"{name.replace(' ', '_')}_{r}")))
                    runs.append(base + extra + [f"run.dir={dirs[-1][1]}"])
            launch(nproc, runs, tmp)
            for name, run_dir in dirs:
                (single if name == "single" else rows[name]).append(median_step(run_dir))
                print(f"{name}: {(single if name == 'single' else rows[name])[-1]:.3f} s/step", file=sys.stderr)
        plan = {name: planned(base + extra, nproc, os.path.join(tmp, "plan", name.replace(" ", "_")))
                for name, nproc, extra in LAYOUTS}
    print(f"\n{args.layers} blocks of hidden {args.hidden}, seq {args.seq}, 16 micro-batches of 1 a step, {cores} cores; "
          f"one process: {', '.join(f'{s:.3f}' for s in single)} s/step (rounds)\n")
    print("| layout | step s (rounds) | / 1F1B same pp | excess over ideal s | planner step s | planner bubble s |")
    print("|---|---|---|---|---|---|")
    for name, nproc, _ in LAYOUTS:
        ref = rows[f"pp{nproc} 1f1b"]
        ratio = statistics.mean(a / b for a, b in zip(rows[name], ref))
        excess = statistics.mean(t - s / min(nproc, cores) for t, s in zip(rows[name], single))
        print(f"| {name} | {' / '.join(f'{t:.3f}' for t in rows[name])} | {ratio:.3f} | {excess:.3f} | "
              f"{plan[name]['step_s']:.3f} | {plan[name]['bubble_s']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
