"""The Prometheus exposition of one rank, scraped over HTTP in-process (no training run).

    python -m pytest -q tests/train/test_prometheus.py
"""
from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import free_port
from llmtest import compose
from llmtrain.config import ConfigError, check_config
from llmtrain.train.prometheus import METRIC_NAMES, PrometheusExporter

TYPES = {
    "llmtrain_tokens": "counter",  # the parser names a counter family without _total
    "llmtrain_step_duration_seconds": "histogram",
    "llmtrain_info": "gauge",  # an Info metric is a gauge of value 1 in the text format
    "llmtrain_anomalies": "counter", "llmtrain_skipped_steps": "counter", "llmtrain_rewinds": "counter",
    "llmtrain_transient_faults": "counter", "llmtrain_loss_scale_overflows": "counter",
}


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def test_exposition_names_types_labels_values():
    exp = PrometheusExporter("runA", rank=3, node="n1", model="gpt-tiny", layout="dp2", version="0.1.0",
                             tokens_total=100, step=4, checkpoint_interval=50)
    port = exp.serve(free_port(), addr="127.0.0.1")
    try:
        exp.step_done(5, 0.2)
        exp.step_done(6, 3.0)
        exp.record({"tokens_total": 1234, "tokens_per_sec": 50.5, "mfu": None, "loss": 7.25, "grad_norm": 1.5,
                    "lr": 3e-4, "data_wait_time": 0.01, "loss_scale": 16384.0})
        exp.checkpoint_saved(2.5)
        exp.memory({"param_bytes": 10, "optimizer_bytes": 20, "grad_bytes": 30})
        kinds = {"nonfinite_loss": 0, "nonfinite_grad_norm": 1, "loss_spike": 2, "grad_norm_spike": 0,
                 "loss_scale_overflow": 1}
        counts = {"anomalies": 4, "skipped_steps": 1, "rewinds": 2, "transient_faults": 1, "loss_scale_overflows": 7}
        exp.guard_counts(counts, kinds)
        exp.guard_counts(counts, kinds)  # running totals: the second call adds nothing
        fams, text = _scrape(port)
    finally:
        exp.close()
    # every family the module promises, with its type; nothing else (no process/python collectors)
    served = {f"{n}_total" if f.type == "counter" else n for n, f in fams.items()}
    assert served == set(METRIC_NAMES)
    for name, fam in fams.items():
        assert fam.type == TYPES.get(name, "gauge"), name
        for s in fam.samples:
            assert {"job", "rank", "node"} <= set(s.labels), s
            assert (s.labels["job"], s.labels["rank"], s.labels["node"]) == ("runA", "3", "n1")
    # base units in the names and in the values (seconds, bytes, a 0..1 ratio)
    assert "# TYPE llmtrain_tokens_total counter" in text
    assert "llmtrain_step_duration_seconds_bucket" in text and "_milliseconds" not in text

    def value(name, **labels):
        fam = fams[name]
        (s,) = [s for s in fam.samples if s.name == (name + "_total" if fam.type == "counter" else name)
                and all(s.labels.get(k) == v for k, v in labels.items())]
        return s.value

    assert value("llmtrain_tokens") == 1234 and value("llmtrain_model_tokens") == 1234
    assert value("llmtrain_loss_scale") == 16384.0
    assert value("llmtrain_step") == 6
    assert value("llmtrain_loss") == 7.25 and value("llmtrain_grad_norm") == 1.5
    assert value("llmtrain_learning_rate") == pytest.approx(3e-4)
    assert value("llmtrain_tokens_per_second") == 50.5
    assert math.isnan(value("llmtrain_mfu_ratio"))  # unknown peak -> NaN, not 0
    assert value("llmtrain_data_wait_seconds") == 0.01
    assert value("llmtrain_checkpoint_save_duration_seconds") == 2.5
    assert value("llmtrain_checkpoint_last_success_timestamp_seconds") > 1.7e9
    assert value("llmtrain_last_step_timestamp_seconds") > 1.7e9
    assert value("llmtrain_checkpoint_interval_steps") == 50
    assert [value("llmtrain_memory_bytes", kind=k) for k in ("parameters", "optimizer", "gradients")] == [10, 20, 30]
    # divergence guard: the running totals, once (a repeated total adds nothing)
    assert [value("llmtrain_anomalies", kind=k) for k in kinds] == [0, 1, 2, 0, 1]
    assert (value("llmtrain_skipped_steps"), value("llmtrain_rewinds"), value("llmtrain_transient_faults"),
            value("llmtrain_loss_scale_overflows")) == (1, 2, 1, 7)
    hist = {s.name: s for s in fams["llmtrain_step_duration_seconds"].samples if "le" not in s.labels}
    assert hist["llmtrain_step_duration_seconds_count"].value == 2
    assert hist["llmtrain_step_duration_seconds_sum"].value == pytest.approx(3.2)
    info = [s for s in fams["llmtrain_info"].samples][0]
    assert (info.labels["model"], info.labels["layout"], info.labels["version"], info.value) == ("gpt-tiny", "dp2", "0.1.0", 1)


def _sample(exp, name: str, suffix: str = "") -> float:
    (s,) = [s for m in exp.registry.collect() if m.name == name for s in m.samples if s.name == name + suffix]
    return s.value


def test_token_counter_stays_monotonic_over_a_rewind_and_the_gauge_follows_the_model():
    """Starts at the restored total; a rewind takes the model's tokens (the gauge) back to the checkpoint's, the
    counter stays and rises again with the redone steps (it counts tokens trained on, redone ones included)."""
    exp = PrometheusExporter("r", rank=0, node="n", tokens_total=500)
    assert (_sample(exp, "llmtrain_tokens", "_total"), _sample(exp, "llmtrain_model_tokens")) == (500, 500)
    exp.record({"tokens_total": 900})
    exp.rewound(600)  # the divergence guard reloaded a checkpoint of 600 tokens
    assert (_sample(exp, "llmtrain_tokens", "_total"), _sample(exp, "llmtrain_model_tokens")) == (900, 600)
    exp.record({"tokens_total": 700})  # a redone step of 100 tokens
    assert (_sample(exp, "llmtrain_tokens", "_total"), _sample(exp, "llmtrain_model_tokens")) == (1000, 700)
    exp.model_tokens(650)  # a smaller value without a rewind adds nothing to the counter
    assert _sample(exp, "llmtrain_tokens", "_total") == 1000


def test_config_rejects_bad_port():
    cfg = compose(["train.metrics_port=70000", "train.metrics_linger_s=-1"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert "train.metrics_port=70000" in str(e.value) and "train.metrics_linger_s=-1" in str(e.value)


def test_busy_port_is_a_clear_error(monkeypatch):
    import socket

    from llmtrain.train.prometheus import exporter_for_run

    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = busy.getsockname()[1]
    monkeypatch.setenv("PADDLE_LOCAL_RANK", "0")
    cfg = compose([f"train.metrics_port={port}"])
    try:
        with pytest.raises(RuntimeError, match=f"train.metrics_port={port}: local rank 0 cannot serve"):
            exporter_for_run(cfg, type("L", (), {"name": "single"})(), 0, 0, 0)
    finally:
        busy.close()
