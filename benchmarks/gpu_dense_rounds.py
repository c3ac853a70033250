"""The held-out dense rows with each twin variant on one model, in interleaved rounds, beside the host's eager-op
seconds: which part of a row's call-to-call spread is the VM host and which the twin's op sequence.

    python benchmarks/gpu_dense_rounds.py --out DIR                 # CUDA GPU (an H100: about three minutes)
    python benchmarks/gpu_dense_rounds.py --out /tmp/smoke --smoke --cpu    # tiny shapes, logic only

Tables (one JSON file each in DIR, gpu_reference's `provenance`):

- `host`: gpu_reference.run_host (eager ops on [8, 64] tensors: host seconds per op forward and forward+backward,
  the in-place launch floor, the optimizer per tiny tensor), the same table the first H100 call's kernel tables
  hold (benchmarks/data/h100/host.json), run before and after the rounds (`when` "before" / "after").
- `rounds`: every held-out dense row (gpu_h100.dense_rows), one model and optimizer per row; each round times the
  row under every `VARIANTS` entry in turn (the variant is an attribute the forward reads, so the weights and the
  batch are the same): 1 warm-up + `--steps-n` timed steps (host clock between synchronisations), median per
  round; `--rounds` rounds. Variants: "call1" (fused weights kept for the backward, PyTorch's saved tensors: the
  first call's twin, benchmarks/data/h100/steps), "twin2" (fused weights rebuilt: the third call's twin) and
  "llmtrain" (rebuilt, and Paddle's saved tensors for split, RoPE and the loss: the twin as it runs today).
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h100  # noqa: E402
from gpu_model import Decoder, MasterAdamW, make_batch  # noqa: E402
from gpu_reference import run_host  # noqa: E402
from gpu_tables import _free as free, _timed_steps as timed, run_tables  # noqa: E402

VARIANTS = {"call1": ("kept", "torch"), "twin2": ("rebuilt", "torch"), "llmtrain": ("rebuilt", "llmtrain")}
"""name -> (Decoder.fused_weights, Decoder.saved)."""


def _host(b, when: str):
    start = len(b.rows("host"))
    run_host(b)
    for r in b.rows("host")[start:]:
        r["when"] = when
    b.flush("host")


def run_rounds(b, deadline: float):
    import time

    _host(b, "before")
    for name, (a, mb, recompute) in gpu_h100.dense_rows(b.args.smoke).items():
        row = {"name": name, "arch": a.as_dict(), "micro_batch": mb, "recompute": recompute}
        if time.time() > deadline:
            b.add("rounds", dict(row, error="time budget spent before this row"))
            continue
        model = opt = None
        try:
            free(b)
            model = Decoder(a, b.dev, b.dtype, recompute, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            batch = make_batch(a, mb, b.dev, b.gen)
            per = {v: [] for v in VARIANTS}
            for _ in range(b.args.rounds):
                for v, (fw, saved) in VARIANTS.items():
                    model.fused_weights, model.saved = fw, saved
                    per[v].append(statistics.median(timed(b, model, opt, batch, 1, b.args.steps_n)))
            row.update(step_s={v: t for v, t in per.items()},
                       step_s_median={v: statistics.median(t) for v, t in per.items()})
        except Exception as e:  # noqa: BLE001 - an out-of-memory row is recorded, the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add("rounds", row, {"notes": __doc__.split("\n\n")[2]})
        print(f"[rounds] {name}: " + (row.get("error") or ", ".join(
            f"{v} {t * 1e3:.1f} ms" for v, t in row["step_s_median"].items())), flush=True)
    _host(b, "after")


def main(argv=None):
    run_tables(__doc__, ("rounds",), {"rounds": run_rounds}, argv, warmup=1, steps_n=5,
               options=((("--rounds",), {"type": int, "default": 3, "help": "rounds of every variant per row"}),),
               setup=lambda b, only: gpu_h100.pin_for_steps(b, only, always=True))


if __name__ == "__main__":
    main()
