"""A real Prometheus server scrapes a 2-process CPU run; its query API sees the exact tokens_total, and every
Grafana panel's and every alert rule's expression of deploy/ runs against it and returns series.

    python -m pytest -q tests/deploy/test_prometheus_server.py

Needs the `prometheus` binary (Debian's package; `bash scripts/test.sh` installs it through
scripts/install_system_deps.sh). The server runs from the test on 127.0.0.1 with its own
config and storage directory, scraping both ranks (metrics_port, metrics_port + 1) every 200 ms: the run's 60 steps of 32
sequences take seconds even when the host is fast, so many scrapes land while the counter rises.

Executed expressions (`_executed`), at the time of the run's last scrape: each dashboard query with its
variables set ($job: this run, $node: any, $__rate_interval: 10 s) must return series, except the DCGM panels
(NVIDIA's exporter needs a GPU: they must run without error and are the only ones allowed to be empty); each
alert rule's expression with every comparison made a `bool` comparison (so a quiet alert still yields its
0/1 series: the metrics exist with the labels its matching needs) must return series. New panels and rules are
picked up from the files, none is listed here.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from deploy.test_monitoring_files import FOREIGN_PREFIXES, dashboard_exprs, metric_names, rule_exprs
from launch import free_port, metrics, require_binary, run_launch
from llmtest import tiny_overrides



def _two_free_ports() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (local ranks 0 and 1)."""
    for _ in range(50):
        p = free_port()
        if p >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def _get(url: str, timeout: float = 5) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=timeout).read().decode())


SCRAPE_S = 0.2  # Prometheus' scrape interval (and query resolution) in seconds
STEPS = 60  # steps of the run, each of 32 sequences (8 finished 60 steps within one 1-second scrape on a fast host)


def _start_prometheus(tmp_path, targets: list[str]):
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        f"global:\n  scrape_interval: {SCRAPE_S * 1000:.0f}ms\n  scrape_timeout: {SCRAPE_S * 1000:.0f}ms\n"
        "scrape_configs:\n  - job_name: llmtrain\n    honor_labels: true\n"
        f"    static_configs:\n      - targets: [{', '.join(targets)}]\n"
    )
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [require_binary("prometheus", "prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 20
    while True:
        try:
            urllib.request.urlopen(base + "/-/ready", timeout=1)
            return proc, base
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise AssertionError("prometheus did not start:\n" + (tmp_path / "prometheus.log").read_text()[-3000:])
            time.sleep(0.2)


COMPARISON = re.compile(r"(==|!=|>=|<=|>(?!=)|<(?!=))(?!\s*bool\b)")


def as_bool(expr: str) -> str:
    """`expr` with every comparison operator outside label matchers and strings turned into its `bool` form
    (`a > 600` -> `a > bool 600`): filtering comparisons keep their operands' series, valued 0 or 1."""
    out, i, depth, quote = [], 0, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(expr[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
            out.append(c)
        elif c == "{":
            depth += 1
            out.append(c)
        elif c == "}":
            depth -= 1
            out.append(c)
        elif depth == 0 and (m := COMPARISON.match(expr, i)):
            out.append(m.group(1) + " bool ")
            i = m.end()
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def test_as_bool():
    assert as_bool('time() - max by (job) (x{a=~"b", c!="d"}) > 600') == \
        'time() - max by (job) (x{a=~"b", c!="d"}) > bool  600'
    assert as_bool("(l != l) or (abs(l) == Inf) and a >= bool 1 and b<2") == \
        "(l != bool  l) or (abs(l) == bool  Inf) and a >= bool 1 and b< bool 2"


def _executed(base: str, at: float) -> dict:
    """{expression as sent: number of series} for every dashboard query and (bool form) alert expression."""
    subst = {"$job": "promtest", "$node": ".+", "$__rate_interval": "10s"}
    queries = []
    for expr in dashboard_exprs():
        for k, v in subst.items():
            expr = expr.replace(k, v)
        queries.append(expr)
    queries += [as_bool(e) for e in rule_exprs()]
    got = {}
    for expr in queries:
        q = urllib.parse.urlencode({"query": expr, "time": at})
        r = _get(f"{base}/api/v1/query?{q}")
        assert r["status"] == "success", (expr, r)
        got[expr] = len(r["data"]["result"])
    return got


@pytest.mark.slow
def test_prometheus_scrapes_exact_tokens_total(tiny_corpus, tmp_path):
    mport = _two_free_ports()
    proc, base = _start_prometheus(tmp_path, [f"'127.0.0.1:{mport}'", f"'127.0.0.1:{mport + 1}'"])
    try:
        start = time.time()
        run_dir = tmp_path / "run"
        run_launch(
            ["llmtrain/pretrain.py", "+parallel=dp2", *tiny_overrides(tiny_corpus, str(run_dir), steps=STEPS),
             "train.global_batch_size=32",
             f"train.metrics_port={mport}", "train.metrics_job=promtest", "train.metrics_linger_s=3",
             "checkpoint.save_final=true"],
            nproc=2, log_dir=tmp_path / "log",
        )
        end = time.time()
        recs = [r for r in metrics(run_dir) if "tokens_total" in r]
        res, steps = ({}, {})
        for query, out in (("llmtrain_tokens_total", res), ("llmtrain_step", steps)):
            q = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": str(SCRAPE_S)})
            out.update(_get(f"{base}/api/v1/query_range?{q}"))
        at_end = {}  # the other series at the end of the run, per rank
        for query in ("llmtrain_step", "llmtrain_checkpoint_last_success_timestamp_seconds",
                      "llmtrain_step_duration_seconds_count", 'llmtrain_memory_bytes{kind="parameters"}', "llmtrain_loss",
                      "llmtrain_info"):
            q = urllib.parse.urlencode({"query": f"last_over_time({query}[2m])", "time": end})
            at_end[query] = {r["metric"]["rank"]: float(r["value"][1]) for r in _get(f"{base}/api/v1/query?{q}")["data"]["result"]}
        # the last moment both ranks' series were live (the endpoints close after train.metrics_linger_s)
        live = min(float(s["values"][-1][0]) for s in steps["data"]["result"])
        executed = _executed(base, live)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert res["status"] == steps["status"] == "success", (res, steps)
    gpu_only = {e for e in executed if any(n.startswith(FOREIGN_PREFIXES) for n in metric_names(e))}
    empty = sorted(e for e, n in executed.items() if n == 0 and e not in gpu_only)
    assert not empty, f"expressions of deploy/ returning no series on a live run: {empty}"
    assert len(executed) - len(gpu_only) >= 20 and len(gpu_only) == 2, executed
    for rank in ("0", "1"):
        assert at_end["llmtrain_step"][rank] == STEPS == at_end["llmtrain_step_duration_seconds_count"][rank], at_end
        assert at_end["llmtrain_checkpoint_last_success_timestamp_seconds"][rank] >= start, at_end  # the final save
        assert at_end['llmtrain_memory_bytes{kind="parameters"}'][rank] > 0 and at_end["llmtrain_info"][rank] == 1
    assert at_end["llmtrain_loss"]["0"] == pytest.approx(recs[-1]["loss"], rel=1e-6)
    series = {s["metric"]["rank"]: s for s in res["data"]["result"]}
    step_series = {s["metric"]["rank"]: dict(s["values"]) for s in steps["data"]["result"]}
    assert set(series) == set(step_series) == {"0", "1"}, res
    total_at = {0: 0, **{r["step"]: r["tokens_total"] for r in recs}}  # metrics.jsonl's tokens_total after each step
    for rank, s in series.items():
        assert s["metric"]["job"] == "promtest" and s["metric"]["node"], s["metric"]
        values = [int(float(v)) for _, v in s["values"]]
        assert values == sorted(values), (rank, values)  # a counter: never down
        assert values[-1] == recs[-1]["tokens_total"], (rank, values[-1], recs[-1]["tokens_total"])
        assert len(set(values)) >= 3, (rank, values)  # seen rising, through intermediate steps (17-23 values locally)
        for t, v in s["values"]:  # each scrape: the exact count of the step the rank was at (or the one before:
            step = int(float(step_series[rank][t]))  # the step gauge moves just before the record is made)
            assert int(float(v)) in (total_at[step], total_at.get(step - 1)), (rank, t, step, v)
