"""The planner (`plan.device=h100`) against the H100's held-out twin steps (benchmarks/data/h100/steps, never fitted).

    python benchmarks/planner_h100.py                 # the tables of benchmarks/README.md's "H100" section
    python benchmarks/planner_h100.py --scaled /tmp/h100_scaled.json   # also a scaled profile's error (same rows)
    python benchmarks/planner_h100.py --twin2         # also the third call's rows (data/h100/twin2) and the MoE split

The seventh call's tables (data/h100/rounds: the dense rows under three twin variants on one host, its eager-op
table beside the first call's, its MoE rows) print whenever that folder is present.

Rows: dense <= 8k (steps.json), 16k-64k (long_steps.json), MoE capacity 1.25 and dropless (moe_steps.json), all
with cuDNN attention (the FA3-class kernel the h100 profile prices). The overrides are benchmarks/planner.py's
for the H200 rows with `plan.device=h100`; dropless rows are priced twice: with the routing's measured C (the
host reads, `plan.moe_imbalance` = capacity_mean_factor, an input) and with the planner's own expected busiest
expert from E, k and tokens (`plan.moe_imbalance` unset: llmtrain/plan/moe.py `expected_imbalance`).
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.planner import _row, h200_moe_overrides, h200_overrides  # noqa: E402
from llmtrain.config import register_configs  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "h100" / "steps"
TWIN2 = DATA.parent / "twin2"
"""The third call's rows: the twin as llmtrain runs it (fused weights rebuilt in the backward, experts as two bmm)."""
ROUNDS = DATA.parent / "rounds"
"""The seventh call's rows (benchmarks/gpu_dense_rounds.py): every dense row under the three twin variants on one
model, interleaved rounds, beside the host's eager-op table before and after."""
EIGHTH = DATA.parent / "dispatch"
"""The eighth call's rows (benchmarks/gpu_dispatch.py three times, pass1-3/dispatch.json: the host's unsynchronised
dispatch at real shapes; then benchmarks/gpu_dense_rounds.py, rounds/: the dense rows again, two rounds)."""
NINTH = DATA.parent / "repeat"
"""The ninth call's rows: the first call's own step harness (`gpu_h100.py --only steps_dense --steps-n 6`) three
times on one fresh host (pass1-3/steps.json), then its MoE rows once (moe/log.txt: the JSON did not come back)."""
LAUNCHES = DATA.parent / "launches"
"""The fourth call's rows (benchmarks/gpu_moe_launches.py): kernels per op class, tiny-shape host rows, dropless
steps under the init and a balanced router."""
HOST_BOUND = 0.85
"""A row whose profiled GPU busy time is below this share of its step is host-bound: its time is the VM host's
Python (20-39% between processes on the H200's VM), which a ±10% check cannot hold."""


def _device(overrides: list[str], device: str) -> list[str]:
    return [o if not o.startswith("plan.device=") else f"plan.device={device}" for o in overrides]


def _read(name: str, data: Path) -> list[dict]:
    return [r for r in json.loads((data / name).read_text())["rows"] if r.get("step_s_median")]


def _read_all(name: str, data: Path) -> list[dict]:
    return [r for r in json.loads((data / name).read_text())["rows"] if "error" not in r]


def dense_rows(data: Path = DATA, device: str = "h100", extra: list[str] | None = None) -> list[dict]:
    out = []
    for r in _read("steps.json", data):
        pred = _row(_device(h200_overrides(r["arch"], r["micro_batch"], r["recompute"]), device) + (extra or []))
        busy = r.get("kernel_time_s")
        out.append({"name": r["name"], "measured_s": r["step_s_median"], "predicted_s": pred["step_time_s"],
                    "error": pred["step_time_s"] / r["step_s_median"] - 1, "busy_s": busy,
                    "host_bound": bool(busy and busy < HOST_BOUND * r["step_s_median"])})
    return out


def long_rows(data: Path = DATA, device: str = "h100", extra: list[str] | None = None) -> list[dict]:
    out = []
    for r in _read("long_steps.json", data):
        pred = _row(_device(h200_overrides(r["arch"], r["micro_batch"], False), device) + (extra or []))
        out.append({"name": r["name"], "measured_s": r["step_s_median"], "predicted_s": pred["step_time_s"],
                    "error": pred["step_time_s"] / r["step_s_median"] - 1})
    return out


def moe_rows(data: Path = DATA, device: str = "h100", routing: str = "measured",
             extra: list[str] | None = None, dropless_only: bool = False) -> list[dict]:
    """`routing`: "measured" (dropless C from the row's host reads) or "expected" (the planner's own expected
    busiest-expert load: no plan.moe_imbalance)."""
    out = []
    for r in _read("moe_steps.json", data):
        dropless = r["moe"]["capacity_factor"] == 0
        if dropless_only and not dropless:
            continue
        imb = r.get("capacity_mean_factor") or 1.0
        ov = _device(h200_moe_overrides(r["arch"], r["moe"], r["micro_batch"], imb), device)
        if routing == "expected":
            ov = [o for o in ov if not o.startswith("plan.moe_imbalance=")]
        pred = _row(ov + (extra or []))
        out.append({"name": r["name"], "dropless": dropless, "measured_s": r["step_s_median"],
                    "predicted_s": pred["step_time_s"], "error": pred["step_time_s"] / r["step_s_median"] - 1,
                    "measured_factor": imb if dropless else None})
    return out


def median_rows(device: str = "h100") -> list[dict]:
    """Each held-out dense row's median over every run of the first call's harness: the first call's steps.json
    and the ninth call's three passes (pass*/steps.json), four runs on two hosts; `runs_s` lists them, `spread` is
    max / min - 1."""
    runs = [{r["name"]: r["step_s_median"] for r in _read("steps.json", d)} for d in sorted(NINTH.glob("pass*"))]
    out = []
    for r in dense_rows(DATA, device):  # priced once: the ninth call ran the same rows
        name = r["name"]
        ms = [r["measured_s"]] + [run[name] for run in runs]
        med = statistics.median(ms)
        out.append({"name": name, "measured_s": med, "predicted_s": r["predicted_s"],
                    "error": r["predicted_s"] / med - 1, "runs_s": ms, "spread": max(ms) / min(ms) - 1})
    return out


def moe_log_rows(log: Path = NINTH / "moe" / "log.txt", device: str = "h100") -> list[dict]:
    """MoE rows read from a call's log (`[moe_steps] NAME: X ms`, where the JSON did not come back), priced as
    moe_rows prices the first call's rows of the same name: the same arch, and dropless at the first call's
    measured C (the twin's routers are seeded: the seventh call read the same C within 0.2% for 9 of 10 rows)."""
    measured = {m.group(1): float(m.group(2)) / 1e3
                for m in re.finditer(r"^\[moe_steps\] (\S+): ([0-9.]+) ms", log.read_text(), re.M)}
    return [{**r, "measured_s": measured[r["name"]], "error": r["predicted_s"] / measured[r["name"]] - 1}
            for r in moe_rows(device=device) if r["name"] in measured]


def dropless_router_rows(data: Path = LAUNCHES, device: str = "h100") -> list[dict]:
    """The dropless rows of the launches call (benchmarks/gpu_moe_launches.py `dropless_steps`) with the router the
    twin has at initialisation (`router` "init") and with i.i.d. logits per token ("balanced"): priced with the
    planner's own expected busiest expert (`expected_s`: no plan.moe_imbalance) and at the factor the row's
    dispatcher read (`stated_s`)."""
    from llmtrain.plan.moe import expected_imbalance

    out = []
    for r in _read("dropless_steps.json", data):
        m, a = r["moe"], r["arch"]
        ov = _device(h200_moe_overrides(a, m, r["micro_batch"], r["capacity_mean_factor"]), device)
        stated = _row(ov)["step_time_s"]
        expected = _row([o for o in ov if not o.startswith("plan.moe_imbalance=")])["step_time_s"]
        T = r["micro_batch"] * a["seq"]
        out.append({"name": r["name"], "router": r["router"], "measured_s": r["step_s_median"],
                    "factor": r["capacity_mean_factor"], "expected_factor": expected_imbalance(m["experts"], m["top_k"], T),
                    "shared_share": r.get("shared_share"), "expected_s": expected, "stated_s": stated,
                    "error": expected / r["step_s_median"] - 1, "stated_error": stated / r["step_s_median"] - 1})
    return out


def _planned_host(a: dict, moe: dict | None, micro_batch: int, recompute: bool, device: str) -> tuple:
    """The planner's host seconds for one micro-batch's forward and backward dispatches of the model `a` (and
    `moe`) as benchmarks/planner.py configures the H200 rows (timeline.Stream over micro_batch_kernels; the host
    constants of `device`'s profile), and the micro-batch's kernel list."""
    from benchmarks.planner import compose_config
    from llmtrain.config import to_config
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.kernels import MicroBatchSpec, micro_batch_kernels
    from llmtrain.plan.moe import MoEPlan
    from llmtrain.plan.timeline import Stream

    ov = h200_moe_overrides(a, moe, micro_batch, 1.0) if moe else h200_overrides(a, micro_batch, recompute)
    cfg = to_config(compose_config(_device(ov, device))).model
    mb = micro_batch_kernels(MicroBatchSpec(cfg, micro_batch, a["seq"], 1, 2, True, True,
                                            "full" if recompute else "none", moe=MoEPlan() if moe else None))
    st = Stream(get_device(device), fast=False)
    st.run(mb.forward, False)
    fwd = st.host_total
    st.run(mb.backward, True)
    return fwd, st.host_total - fwd, mb


def tiny_host_rows(data: Path = LAUNCHES, device: str = "h100") -> list[dict]:
    """The launches call's tiny-shape rows (`layers.json`: the twin at h 64, seq 16, where the wall time is the
    host's), first sweep, against the planner's host seconds for the same model (`_planned_host`)."""
    out = []
    for r in _read_all("layers.json", data):
        if r.get("sweep") != 1 or "fwd_s" not in r:
            continue
        fwd, bwd, mb = _planned_host(r["arch"], r["moe"], 1, False, device)
        out.append({"name": r["name"], "fwd_s": r["fwd_s"], "bwd_s": r["fwd_bwd_s"] - r["fwd_s"],
                    "fwd_kernels": r.get("fwd_kernels", 0) + r.get("fwd_memsets", 0) + r.get("fwd_memcpys", 0),
                    "bwd_kernels": r.get("bwd_kernels", 0) + r.get("bwd_memsets", 0) + r.get("bwd_memcpys", 0),
                    "plan_fwd_s": fwd, "plan_bwd_s": bwd,
                    "listed_fwd": sum(k.kind != "view" for k in mb.forward),
                    "listed_bwd": sum(k.kind != "view" for k in mb.backward)})
    return out


def moe_split_rows(data: Path = TWIN2, device: str = "h100") -> list[dict]:
    """The capacity rows' forward+backward and optimizer step, measured apart (twin2's `fwd_bwd_s`, `opt_s`), against
    the planner's one micro-batch (`micro_batch_s`) and the rest of its step (gradient adds and AdamW)."""
    import dataclasses

    from benchmarks.planner import compose_config
    from llmtrain.config import to_config
    from llmtrain.parallel.layout import Layout
    from llmtrain.plan.devices import get_device
    from llmtrain.plan.estimate import compute_estimate
    from llmtrain.plan.moe import MoEPlan

    out = []
    for r in _read("moe_steps.json", data):
        if r["moe"]["capacity_factor"] == 0 or "fwd_bwd_s" not in r:
            continue
        cfg = to_config(compose_config(_device(h200_moe_overrides(r["arch"], r["moe"], r["micro_batch"], 1.0),
                                               device))).model
        layout = dataclasses.replace(Layout(), micro_batch=r["micro_batch"], grad_accum=1)
        c = compute_estimate(cfg, layout, r["arch"]["seq"], "none", get_device(device), True, "bf16", 1, MoEPlan())
        out.append({"name": r["name"], "fwd_bwd_s": r["fwd_bwd_s"], "opt_s": r["opt_s"],
                    "micro_s": c["micro_batch_s"], "after_s": c["compute_s"] - c["micro_batch_s"]})
    return out


def rounds_rows(data: Path = ROUNDS, device: str = "h100") -> list[dict]:
    """The seventh call's dense rows (`rounds.json`), one entry per row and twin variant ("call1": the first call's
    twin, "twin2": the third call's, "llmtrain": the twin as llmtrain runs it): the median over rounds of each
    round's median step (`measured_s`), the rounds' spread (max / min - 1), and the planner's error."""
    out = []
    for r in _read_all("rounds.json", data):
        pred = _row(_device(h200_overrides(r["arch"], r["micro_batch"], r["recompute"]), device))["step_time_s"]
        for variant, med in r["step_s_median"].items():
            rounds = r["step_s"][variant]
            out.append({"name": r["name"], "variant": variant, "measured_s": med, "predicted_s": pred,
                        "error": pred / med - 1, "spread": max(rounds) / min(rounds) - 1, "rounds_s": rounds})
    return out


def dispatch_rows(data: Path = EIGHTH, device: str = "h100") -> list[dict]:
    """The eighth call's dispatch rows (pass*/dispatch.json), one entry per shape and twin variant: the host's
    forward and backward dispatch seconds of each pass (medians of the pass's steps) beside the planner's host
    seconds for the same model (`_planned_host`), and each pass's step."""
    by: dict = {}
    for f in sorted(data.glob("pass*/dispatch.json")):
        for r in json.loads(f.read_text())["rows"]:
            by.setdefault((r["name"], r["variant"]), []).append(r)
    planned, out = {}, []
    for (name, variant), rs in by.items():
        r = rs[0]
        if name not in planned:
            planned[name] = _planned_host(r["arch"], None, r["micro_batch"], r["recompute"], device)[:2]
        out.append({"name": name, "variant": variant, "kind": r["kind"],
                    "queue_bound": any(x["queue_bound"] for x in rs),
                    "fwd_s": [x["fwd_host_s"] for x in rs], "bwd_s": [x["bwd_host_s"] for x in rs],
                    "step_s": [x["step_s_median"] for x in rs],
                    "plan_fwd_s": planned[name][0], "plan_bwd_s": planned[name][1]})
    return out


def host_table(data: Path) -> dict:
    """`host.json`'s eager-op seconds of one call: (op, "fwd" | "fwd_bwd", when) -> seconds per op."""
    out = {}
    for r in json.loads((data / "host.json").read_text())["rows"]:
        if r.get("kind") == "eager_op":
            out[(r["op"], "fwd", r.get("when", ""))] = r["fwd_s_per_op"]
            out[(r["op"], "fwd_bwd", r.get("when", ""))] = r["fwd_bwd_s_per_op"]
    return out


def _table(title: str, rows: list[dict]) -> None:
    _rows_table([title, "measured s", "predicted s", "error"], rows, lambda r: [
        r["name"] + (" (host-bound)" if r.get("host_bound") else ""), f"{r['measured_s']:.4f}",
        f"{r['predicted_s']:.4f}", f"{100 * r['error']:+.1f}%"])
    errs = [abs(r["error"]) for r in rows]
    print(f"mean |error| {100 * sum(errs) / len(errs):.1f}%, worst {100 * max(errs):.1f}%, "
          f"{sum(e <= 0.10 for e in errs)} of {len(rows)} within 10%")


def _rows_table(header: list[str], rows: list[dict], cells) -> None:
    """A markdown table: `header`, then `cells(row)` of every row."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(cells(r)) + " |")


def main(argv: list[str]) -> None:
    register_configs()
    _table("H100 dense row (cuDNN attention)", dense_rows())
    _table("H100 long row", long_rows())
    _table("H100 MoE row, dropless at the measured C", moe_rows())
    _table("H100 MoE row, dropless at the expected busiest expert", moe_rows(routing="expected"))
    if (LAUNCHES / "dropless_steps.json").exists():
        _rows_table(["dropless row (fifth call)", "router", "busiest / mean: measured, expected", "measured s",
                     "at the expectation", "at the measured factor"], dropless_router_rows(), lambda r: [
            r["name"], r["router"], f"{r['factor']:.2f}, {r['expected_factor']:.2f}", f"{r['measured_s']:.4f}",
            f"{r['expected_s']:.4f} ({100 * r['error']:+.1f}%)", f"{r['stated_s']:.4f} ({100 * r['stated_error']:+.1f}%)"])
    if (LAUNCHES / "layers.json").exists():
        _rows_table(["tiny twin (fifth call)", "fwd ms measured / planned host", "bwd ms measured / planned host",
                     "device launches fwd / bwd", "listed kernels fwd / bwd"], tiny_host_rows(), lambda r: [
            r["name"], f"{r['fwd_s'] * 1e3:.2f} / {r['plan_fwd_s'] * 1e3:.2f}",
            f"{r['bwd_s'] * 1e3:.2f} / {r['plan_bwd_s'] * 1e3:.2f}", f"{r['fwd_kernels']:.0f} / {r['bwd_kernels']:.0f}",
            f"{r['listed_fwd']} / {r['listed_bwd']}"])
    first = host_table(DATA.parent)
    for call, folder in (("seventh", ROUNDS), ("eighth", EIGHTH / "rounds")):
        if not (folder / "rounds.json").exists():
            continue
        rows = rounds_rows(folder)
        for variant in ("llmtrain", "twin2", "call1"):
            _table(f"{call} call: dense row, twin variant {variant}", [r for r in rows if r["variant"] == variant])
        now = host_table(folder)
        _rows_table(["eager op [8, 64] (host)", "first call us fwd / fwd+bwd", f"{call} call before", "after"],
                    sorted({k[0] for k in first}), lambda op: [op] + [
            f"{t[(op, 'fwd', w)] * 1e6:.1f} / {t[(op, 'fwd_bwd', w)] * 1e6:.1f}"
            for t, w in ((first, ""), (now, "before"), (now, "after"))])
        if (folder / "moe_steps.json").exists():
            _table(f"{call} call: MoE row, dropless at the measured C", moe_rows(folder))
    if list(NINTH.glob("pass*/steps.json")):
        for i, d in enumerate(sorted(NINTH.glob("pass*")), 1):
            _table(f"ninth call, pass {i}: dense row, the first call's harness", dense_rows(d))
        _rows_table(["dense row: median of four runs of the first call's harness", "runs ms (first call, ninth x3)",
                     "spread", "median s", "predicted s", "error"], median_rows(), lambda r: [
            r["name"], " ".join(f"{x * 1e3:.1f}" for x in r["runs_s"]), f"{100 * r['spread']:.1f}%",
            f"{r['measured_s']:.4f}", f"{r['predicted_s']:.4f}", f"{100 * r['error']:+.1f}%"])
        if (NINTH / "moe" / "log.txt").exists():
            _table("ninth call: MoE row (log), dropless at the first call's C", moe_log_rows())
    if list(EIGHTH.glob("pass*/dispatch.json")):
        ms = lambda xs: " ".join(f"{x * 1e3:.1f}" for x in xs)  # noqa: E731
        _rows_table(["eighth call: dispatch row", "variant", "fwd host ms, passes 1-3 / planned",
                     "bwd host ms, passes 1-3 / planned", "step ms, passes 1-3"], dispatch_rows(), lambda r: [
            r["name"] + (" (queue-bound)" if r["queue_bound"] else ""), r["variant"],
            f"{ms(r['fwd_s'])} / {r['plan_fwd_s'] * 1e3:.1f}", f"{ms(r['bwd_s'])} / {r['plan_bwd_s'] * 1e3:.1f}",
            ms(r["step_s"])])
    if "--twin2" in argv:
        _table("third call: dense row", dense_rows(TWIN2))
        _table("third call: MoE row, dropless at the measured C", moe_rows(TWIN2))
        _rows_table(["third call: capacity row", "fwd+bwd ms measured / planned",
                     "optimizer ms measured / planned (after the micro-batch)"], moe_split_rows(), lambda r: [
            r["name"], f"{r['fwd_bwd_s'] * 1e3:.1f} / {r['micro_s'] * 1e3:.1f}",
            f"{r['opt_s'] * 1e3:.1f} / {r['after_s'] * 1e3:.1f}"])


if __name__ == "__main__":
    main(sys.argv[1:])
