"""One profiled training step of chosen held-out twin rows, kept whole as a gzipped Chrome trace, to find where the
GPU sits idle in a step the planner under- or over-prices (`python benchmarks/step_gaps.py TRACE` sums the idle
gaps by the host op that launched the kernel after each; the traces also open in Perfetto or chrome://tracing).

    python benchmarks/gpu_step_traces.py --out DIR                         # CUDA GPU (an H100: about a minute)
    python benchmarks/gpu_step_traces.py --out DIR --rows gpt-2048-mb1,gpt-1024-mb2    # other held-out rows
    python benchmarks/gpu_step_traces.py --out /tmp/smoke --smoke --cpu    # tiny shapes, logic only

Rows (`ROWS`): the MoE capacity-1.25 rows qwen-moe-4L mb1 / mb2 and deepseek-v2-lite-4L mb1 (gpu_h100.moe_rows,
seeded as gpu_h100_twin.run_moe seeds them) and the dense llama-1b mb1 / mb2 (gpu_reference.STEP_ROWS), attention
pinned as the held-out steps pinned it (gpu_h100.pin_for_steps: cuDNN where it runs, else FlashAttention-2). Per row:
2 warm-up steps, 5 timed (host clock between synchronisations, `step_s`), then one step under torch.profiler (CPU and
CUDA activities, input shapes) with `phase_forward` / `phase_backward` / `phase_optimizer` ranges, exported as
DIR/trace_<row>.json.gz; DIR/steps.json lists the rows with their times (gpu_reference's provenance).
"""
from __future__ import annotations

import gzip
import os
import shutil
import statistics
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h100  # noqa: E402
from gpu_model import Decoder, MasterAdamW, make_batch  # noqa: E402
from gpu_moe import MoEDecoder  # noqa: E402
from gpu_reference import STEP_ROWS, Bench, profiled_step  # noqa: E402
from gpu_tables import _free as free, _timed_steps as timed, run_tables  # noqa: E402

ROWS = ("qwen-moe-4L-mb1-slots-cap1.25", "qwen-moe-4L-mb2-slots-cap1.25", "deepseek-v2-lite-4L-mb1-slots-cap1.25",
        "llama-1b-mb1", "llama-1b-mb2")


def _rows(smoke: bool, names=ROWS) -> dict:
    """name -> (arch, MoE or None, micro-batch): the held-out rows `names` (smoke: the first MoE and dense smoke
    rows)."""
    moe = gpu_h100.moe_rows(smoke)
    dense = gpu_h100.dense_rows(smoke) if smoke else {k: v for k, v in STEP_ROWS.items() if k in names}
    if smoke:
        moe = dict(list((k, v) for k, v in moe.items() if "cap" in k)[:1])
        dense = dict(list(dense.items())[:1])
    out = {}
    for name, (a, m, mb, _n) in moe.items():
        if smoke or name in names:
            out[name] = (a, m, mb)
    for name, (a, mb, *_rest) in dense.items():
        out[name] = (a, None, mb)
    return out


def run_traces(b: Bench, deadline: float):
    import time

    names = tuple(b.args.rows.split(",")) if b.args.rows else ROWS
    for name, (a, m, mb) in _rows(b.args.smoke, names).items():
        row = {"name": name, "arch": a.as_dict(), "moe": m.as_dict() if m else None, "micro_batch": mb}
        if time.time() > deadline:
            b.add("steps", dict(row, error="time budget spent before this row"))
            continue
        model = opt = None
        try:
            free(b)
            if m is not None:
                b.gen.manual_seed(zlib.crc32(name.rsplit("-", 2)[0].encode()))  # as gpu_h100_twin.run_moe
                model = MoEDecoder(a, m, b.dev, b.dtype, generator=b.gen)
            else:
                model = Decoder(a, b.dev, b.dtype, generator=b.gen)
            opt = MasterAdamW(model.parameters())
            batch = make_batch(a, mb, b.dev, b.gen)
            times = timed(b, model, opt, batch, 2, 2 if b.args.smoke else 5)
            row.update(step_s=times, step_s_median=statistics.median(times))
            b.sync()
            prof = profiled_step(b, model, opt, batch)
            raw = os.path.join(b.args.out, f"trace_{name}.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
            os.remove(raw)
            row["trace"] = os.path.basename(raw) + ".gz"
        except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        del model, opt
        b.add("steps", row, {"notes": __doc__.split("\n\n")[2]})
        print(f"[traces] {name}: " + (row.get("error") or f"{row['step_s_median'] * 1e3:.1f} ms, {row['trace']}"),
              flush=True)


def main(argv=None):
    run_tables(__doc__, ("steps",), {"steps": run_traces}, argv, warmup=2, steps_n=5,
               options=((("--rows",), {"default": "", "help": f"comma list of held-out rows (default {','.join(ROWS)})"}),),
               setup=lambda b, only: gpu_h100.pin_for_steps(b, only, always=True))


if __name__ == "__main__":
    main()
