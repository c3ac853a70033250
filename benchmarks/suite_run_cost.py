"""CPU seconds of the suite's tiny runs, side by side: with and without loss_curve.png, per process and per run.

    python benchmarks/suite_run_cost.py --repeats 2        # prints a table; benchmarks/README.md "Test suite: ..."

The suite's parity and end-to-end tests run many tiny trainings (tests/llmtest.py `tiny_overrides`: h 32, 4 steps of
4 micro-batches of 2, sequence 32) several to a process (tests/e2e/multirun_worker.py). This times such processes
by the CPU seconds they and their children used (user + sys, `resource.getrusage`), never wall clock (this 2-core
host runs other work): a process that only imports the training stack, and processes running 1 and 6 runs (an
8-block GPT, Llama and MoE in turn), each with `train.loss_curve` on (the default) and off (the tests' setting),
interleaved `--repeats` times. Per run = (6 runs - 1 run) / 5; start-up = the import-only process.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

MODELS = ("gpt", "llama", "moe", "gpt", "llama", "moe")


def corpus(root: str) -> dict:
    """The tests' tiny corpus (tests/conftest.py `tiny_corpus`): 80 People's Daily articles, a 2500-piece BPE."""
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


def cpu_of(cmd: list[str]) -> float:
    """User + sys CPU seconds of `cmd` and its children (run to completion, output discarded)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def process_cpu(tmp: str, data: dict, n: int, curve: bool, tag: str) -> float:
    """CPU seconds of one tests/e2e/multirun_worker.py process running the first `n` of MODELS."""
    from llmtest import tiny_overrides

    runs = [{"overrides": [o for o in tiny_overrides(data, os.path.join(tmp, f"{tag}_{i}"), m, steps=4)
                           if not o.startswith("train.loss_curve=")]
             + ["model.num_layers=8", f"train.loss_curve={str(curve).lower()}"]} for i, m in enumerate(MODELS[:n])]
    spec = os.path.join(tmp, f"{tag}.json")
    with open(spec, "w") as f:
        json.dump(runs, f)
    return cpu_of([sys.executable, os.path.join(REPO, "tests/e2e/multirun_worker.py"), spec])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(tmp)
        rows: dict[str, list[float]] = {}
        for r in range(args.repeats):
            rows.setdefault("import only", []).append(cpu_of([sys.executable, "-c", "import llmtrain.pretrain, "
                                                              "llmtrain.train.trainer, paddle.distributed.fleet"]))
            for curve in (True, False):
                for n in (1, 6):
                    rows.setdefault(f"{n} run(s), loss_curve={curve}", []).append(
                        process_cpu(tmp, data, n, curve, f"r{r}_{curve}_{n}"))
    mean = {k: sum(v) / len(v) for k, v in rows.items()}
    print("| process | CPU s (each repeat) | mean |\n|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {' / '.join(f'{x:.2f}' for x in v)} | {mean[k]:.2f} |")
    for curve in (True, False):
        per_run = (mean[f"6 run(s), loss_curve={curve}"] - mean[f"1 run(s), loss_curve={curve}"]) / 5
        print(f"loss_curve={curve}: {per_run:.3f} CPU s per run")
    on, off = (mean[f"6 run(s), loss_curve={c}"] for c in (True, False))
    print(f"6-run process: off / on = {off / on:.3f}")


if __name__ == "__main__":
    main()
