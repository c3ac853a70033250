"""deploy/prometheus and deploy/grafana: promtool accepts them, alerts fire on synthetic series, every metric
they query is one the exporter serves, the dashboard is valid under Grafana's dashboard JSON schema, and the
scrape ports agree with the Kubernetes manifests without colliding.

    python -m pytest -q tests/deploy/test_monitoring_files.py

Every expression is also executed against a live Prometheus scraping a real run in
tests/deploy/test_prometheus_server.py. The dashboard schema is Grafana's own (tests/deploy/schemas/README.md).
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.schema_check import check
from launch import require_binary
from llmtest import REPO
from llmtrain.train.prometheus import METRIC_NAMES

DEPLOY = Path(REPO) / "deploy"
RULES = DEPLOY / "prometheus" / "llmtrain.rules.yml"
CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "llmtrain.json"


@pytest.fixture
def promtool() -> str:
    """Debian's promtool; missing: skip locally, fail under CI=true (naming the package)."""
    return require_binary("promtool", "prometheus")

# Served names plus the series a histogram family adds.
SERVED = set(METRIC_NAMES) | {
    f"llmtrain_step_duration_seconds{suffix}" for suffix in ("_bucket", "_sum", "_count")
}
FOREIGN = {"up"}  # Prometheus' own per-target series
FOREIGN_PREFIXES = ("DCGM_FI_",)  # NVIDIA's DCGM exporter (GPU panels)
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
    "Inf", "NaN", "inf", "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords or label names."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if call or word in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"])
            assert m, var["query"]
            exprs.append(m.group(1))
    return exprs


def test_metric_name_parser():
    assert metric_names('max by (job) (rate(llmtrain_tokens_total{job=~"$job"}[$__rate_interval])) > 0') == {
        "llmtrain_tokens_total"}
    assert metric_names("(a != a) or (abs(b) == Inf) and on (job) c offset 5m") == {"a", "b", "c"}


def test_every_queried_metric_is_served():
    rules, dash = rule_exprs(), dashboard_exprs()
    assert len(rules) == 7 and len(dash) >= 12
    used = set().union(*(metric_names(e) for e in rules + dash))
    unknown = {n for n in used if n not in SERVED and n not in FOREIGN and not n.startswith(FOREIGN_PREFIXES)}
    assert not unknown, f"queried but not served by llmtrain/train/prometheus.py: {sorted(unknown)}"
    # the dashboard shows the panels: throughput, MFU, loss, grad norm, step split, checkpoint age, skew, DCGM
    for name in ("llmtrain_tokens_per_second", "llmtrain_mfu_ratio", "llmtrain_loss", "llmtrain_grad_norm",
                 "llmtrain_data_wait_seconds", "llmtrain_checkpoint_last_success_timestamp_seconds", "llmtrain_step",
                 "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"):
        assert any(name in metric_names(e) for e in dash), name


def test_promtool_checks_config_and_rules(promtool):
    for args in (["check", "rules", str(RULES)], ["check", "config", str(CONFIG)]):
        proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alerts_fire_on_synthetic_series(tmp_path, promtool):
    """promtool's rule unit tests: each alert stays quiet on a healthy stretch and fires on its fault."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")  # promtool compares annotations too; the expressions are what is tested here
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    lab = 'job="r",node="n"'
    tests = {
        "rule_files": [str(tmp_path / "rules.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                # rank 0 stepped until minute 5 (its last step's Unix time is 300 s), then nothing
                {"series": f'llmtrain_last_step_timestamp_seconds{{{lab},rank="0"}}', "values": "60+60x4 300x30"},
                {"series": f'llmtrain_loss{{{lab},rank="0"}}', "values": "7 6.5 NaN NaN"},
                # 1000 tokens/s for 70 minutes, then 400
                {"series": f'llmtrain_tokens_per_second{{{lab},rank="0"}}', "values": "1000x70 400x20"},
                {"series": f'llmtrain_step{{{lab},rank="0"}}', "values": "1+1x90"},
                {"series": f'llmtrain_step{{{lab},rank="1"}}', "values": "1+1x40"},  # rank 1 gone after minute 40
                # checkpoint every 10 steps of 10 s; the last save ended at Unix time 100 s
                {"series": f'llmtrain_checkpoint_last_success_timestamp_seconds{{{lab},rank="0"}}', "values": "100x40"},
                {"series": f'llmtrain_checkpoint_interval_steps{{{lab},rank="0"}}', "values": "10x40"},
                {"series": f'llmtrain_step_duration_seconds_sum{{{lab},rank="0"}}', "values": "0+60x40"},
                {"series": f'llmtrain_step_duration_seconds_count{{{lab},rank="0"}}', "values": "0+6x40"},
                # divergence guard: one rejected step at minute 20; a transient fault at minute 10
                {"series": f'llmtrain_anomalies_total{{{lab},rank="0",kind="loss_spike"}}', "values": "0x20 1x40"},
                {"series": f'llmtrain_transient_faults_total{{{lab},rank="0"}}', "values": "0x10 1x40"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "LLMTrainStalled", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "LLMTrainStalled",
                 "exp_alerts": [{"exp_labels": {"job": "r", "severity": "page"}}]},
                {"eval_time": "1m", "alertname": "LLMTrainLossNotFinite", "exp_alerts": []},
                {"eval_time": "2m", "alertname": "LLMTrainLossNotFinite",
                 "exp_alerts": [{"exp_labels": {"job": "r", "rank": "0", "node": "n", "severity": "page"}}]},
                {"eval_time": "60m", "alertname": "LLMTrainThroughputHalved", "exp_alerts": []},
                {"eval_time": "85m", "alertname": "LLMTrainThroughputHalved",
                 "exp_alerts": [{"exp_labels": {"job": "r", "severity": "warn"}}]},
                {"eval_time": "4m", "alertname": "LLMTrainCheckpointStale", "exp_alerts": []},  # 140 s < 3 x 100 s
                {"eval_time": "15m", "alertname": "LLMTrainCheckpointStale",
                 "exp_alerts": [{"exp_labels": {"job": "r", "severity": "warn"}}]},
                {"eval_time": "30m", "alertname": "LLMTrainRankMissing", "exp_alerts": []},
                {"eval_time": "50m", "alertname": "LLMTrainRankMissing",
                 "exp_alerts": [{"exp_labels": {"job": "r", "severity": "page"}}]},
                {"eval_time": "19m", "alertname": "LLMTrainDivergence", "exp_alerts": []},
                {"eval_time": "22m", "alertname": "LLMTrainDivergence",
                 "exp_alerts": [{"exp_labels": {"job": "r", "severity": "page"}}]},
                {"eval_time": "45m", "alertname": "LLMTrainDivergence", "exp_alerts": []},  # quiet 15 min later
                {"eval_time": "9m", "alertname": "LLMTrainTransientFault", "exp_alerts": []},
                {"eval_time": "12m", "alertname": "LLMTrainTransientFault",
                 "exp_alerts": [{"exp_labels": {"job": "r", "node": "n", "severity": "warn"}}]},
            ],
        }],
    }
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(tests))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


SCHEMAS = Path(REPO) / "tests" / "deploy" / "schemas"


def test_dashboard_is_valid_under_grafanas_dashboard_schema():
    """check-jsonschema with Grafana's dashboard JSON schema (grafana-foundation-sdk, vendored): unknown or
    misspelt fields, wrong types and missing required parts (annotations, templating) are errors."""
    rc, output = check(SCHEMAS / "grafana-dashboard.jsonschema.json", [DASHBOARD])
    assert rc == 0, output


def _k8s_metrics_ranges() -> dict:
    """{manifest: (train.metrics_port, processes per node, {container port name: number})} of the `paddle`
    container of each Kubernetes workload in deploy/k8s."""
    out = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("PaddleJob", "Job"):
                continue
            spec = (doc["spec"]["paddleReplicaSpecs"]["Worker"]["template"]["spec"] if doc["kind"] == "PaddleJob"
                    else doc["spec"]["template"]["spec"])
            (c,) = [c for c in spec["containers"] if c["name"] == "paddle"]
            (port,) = [int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("train.metrics_port=")]
            nproc = int({e["name"]: e.get("value") for e in c["env"]}["PADDLE_NPROC_PER_NODE"])
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert len(set(ports.values())) == len(ports), (path.name, ports)  # no port listed twice
            out[f"{path.name}:{doc['kind']}"] = (port, nproc, ports)
    return out


def test_ports_agree_across_prometheus_config_and_manifests_without_collisions():
    """Each rank serves train.metrics_port + local rank: on a node of the manifests' size that is a range of
    processes-per-node ports. The manifests' `metrics-K` container ports are metrics_port + K inside it and no
    other container port is; every llmtrain scrape target of prometheus.yml is inside it; no other scrape job
    (NVIDIA's DCGM exporter) uses a port inside it, and no host:port is scraped by two jobs."""
    ranges = _k8s_metrics_ranges()
    assert len(ranges) == 2, ranges
    (base, nproc), = {(b, n) for b, n, _ in ranges.values()}  # one metrics range for every workload
    in_range = range(base, base + nproc)
    for name, (_, _, ports) in ranges.items():
        for pname, number in ports.items():
            if pname.startswith("metrics-"):
                assert number == base + int(pname.split("-", 1)[1]) and number in in_range, (name, pname, number)
            else:
                assert number not in in_range, f"{name}: container port {pname}={number} inside the metrics range"
    config = yaml.safe_load(CONFIG.read_text())
    seen = {}
    for job in config["scrape_configs"]:
        for target in (t for sc in job["static_configs"] for t in sc["targets"]):
            host, port = target.rsplit(":", 1)
            assert seen.setdefault((host, int(port)), job["job_name"]) == job["job_name"], (target, seen)
            if job["job_name"] == "llmtrain":
                assert int(port) in in_range, f"llmtrain target {target} outside metrics ports {in_range}"
            else:
                assert int(port) not in in_range, (
                    f"scrape job {job['job_name']}: {target} collides with local rank {int(port) - base}'s metrics "
                    f"port ({base}..{base + nproc - 1} with train.metrics_port={base}, {nproc} processes per node)")
    assert {j for j in seen.values()} == {"llmtrain", "dcgm"}, seen
