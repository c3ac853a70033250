"""The host's dispatch time of a training step's forward and backward at real shapes, read without a synchronise:
the Python call returns once every kernel is queued, so its wall time is the host's while the device is the slower
side (the queue never fills), beside the same twin at the tiny shapes the planner's host block is fitted on.

    python benchmarks/gpu_dispatch.py --out DIR                 # CUDA GPU (an H100: about two minutes)
    python benchmarks/gpu_dispatch.py --out /tmp/smoke --smoke --cpu    # tiny shapes, logic only

Table `dispatch` (DIR/dispatch.json, gpu_reference's `provenance`), one row per shape and twin variant
(gpu_dense_rounds.VARIANTS: "llmtrain" the twin as llmtrain runs it, "call1" the first H100 call's): after 3
warm-up steps, `--steps-n` whole training steps through gpu_reference.step_phases (no synchronise inside a step:
`fwd_host_s`, `bwd_host_s`, `opt_host_s` the host's dispatch time of each phase, `step_s` the wall time to the
end of the device work; medians, and every step in `step_s`, `fwd_host_all`, `bwd_host_all`). `queue_bound`
marks a row whose dispatch reached 90% of its step (the launch queue filled or the row is host-bound: its
host figure is then an upper bound of the device's, not the host's). Shapes: the tiny rows of gpu_reference.host_model_rows (h 64, seq 16: the host block's fitting rows),
real shapes that are not held-out rows (llama-1b at seq 1024 and at 11 layers, gpt-1024 at seq 512, gpt-2048 at
12 layers), and three held-out rows for reference (read, never fitted on).
"""
from __future__ import annotations

import os
import statistics
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h100  # noqa: E402
from gpu_dense_rounds import VARIANTS  # noqa: E402
from gpu_model import Decoder, MasterAdamW, gpt, llama, make_batch, train_step  # noqa: E402
from gpu_reference import STEP_ROWS, step_phases  # noqa: E402
from gpu_tables import _free as free, run_tables  # noqa: E402


def rows(smoke: bool) -> dict:
    """name -> (arch, micro_batch, kind): kind "tiny" | "real" | "held_out"."""
    if smoke:
        return {"llama-L2": (llama(2, 64, 4, 2, 160, 16, vocab=256), 1, "tiny"),
                "llama-smoke-s64": (llama(2, 64, 4, 2, 160, 64, vocab=256), 2, "real")}
    out = {}
    for n in (4, 16):
        out[f"llama-L{n}"] = (llama(n, 64, 4, 2, 160, 16, vocab=256), 1, "tiny")
        out[f"gpt-L{n}"] = (gpt(n, 64, 4, 256, 16, vocab=256), 1, "tiny")
    out["llama-1b-s1024-mb1"] = (llama(22, 2048, 32, 4, 5632, 1024), 1, "real")
    out["llama-1b-11L-mb1"] = (llama(11, 2048, 32, 4, 5632, 2048), 1, "real")
    out["gpt-1024-s512-mb2"] = (gpt(24, 1024, 16, 4096, 512), 2, "real")
    out["gpt-2048-12L-mb1"] = (gpt(12, 2048, 16, 8192, 2048), 1, "real")
    for name in ("llama-1b-mb1", "gpt-1024-mb2", "gpt-2048-mb1"):
        a, mb, _rc = STEP_ROWS[name]
        out[name] = (a, mb, "held_out")
    return out


def run_dispatch(b, deadline: float):
    for name, (a, mb, kind) in rows(b.args.smoke).items():
        for variant, (fw, saved) in VARIANTS.items():
            if variant == "twin2":
                continue
            row = {"name": name, "kind": kind, "variant": variant, "arch": a.as_dict(), "micro_batch": mb,
                   "recompute": False}
            if time.time() > deadline:
                b.add("dispatch", dict(row, error="time budget spent before this row"))
                continue
            model = opt = None
            try:
                free(b)
                model = Decoder(a, b.dev, b.dtype, False, generator=b.gen, fused_weights=fw, saved=saved)
                opt = MasterAdamW(model.parameters())
                row["tensors"] = len(opt.params)
                batch = make_batch(a, mb, b.dev, b.gen)
                for _ in range(3):
                    train_step(model, opt, batch)
                ph = [step_phases(model, opt, batch, b.sync) for _ in range(b.args.steps_n)]
                row.update({k: statistics.median(p[k] for p in ph) for k in ph[0]})
                row.update(step_s=[p["step_s"] for p in ph], step_s_median=row.pop("step_s"),
                           fwd_host_all=[p["fwd_host_s"] for p in ph], bwd_host_all=[p["bwd_host_s"] for p in ph])
                dispatch = row["fwd_host_s"] + row["bwd_host_s"] + row["opt_host_s"]
                row["queue_bound"] = dispatch > 0.9 * row["step_s_median"]
            except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            del model, opt
            b.add("dispatch", row, {"notes": __doc__.split("\n\n")[2]})
            print(f"[dispatch] {name} {variant}: " + (row.get("error") or (
                f"host fwd {row['fwd_host_s'] * 1e3:.2f} ms, bwd {row['bwd_host_s'] * 1e3:.2f} ms, step "
                f"{row['step_s_median'] * 1e3:.2f} ms" + (" (queue-bound)" if row["queue_bound"] else ""))), flush=True)


def main(argv=None):
    run_tables(__doc__, ("dispatch",), {"dispatch": run_dispatch}, argv, warmup=3, steps_n=7,
               setup=lambda b, only: gpu_h100.pin_for_steps(b, only, always=True))


if __name__ == "__main__":
    main()
