"""knative/loadtest/: the distributed Locust of the 100k run. Its resources validate against the core
Kubernetes types (the kubernetes client's OpenAPI models), compose as kustomize would (the locustfile
ConfigMap generated from loadtest/locustfile.py), wire workers to the master, name only settings
Locust and the locustfile read, and are sized for 100,000 users. No cluster here: nothing is applied."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.knative.test_manifests import check_model, docs

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "knative" / "loadtest"
USERS_TARGET = 100_000
# a Locust worker's resident memory per user, baseline included, measured (docs/capacity.md: 20,000
# users, 414 MiB RSS): the workers' memory requests must hold their users at twice this rate
RSS_PER_USER_BYTES = 21 * 1024
MODELS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
          ("v1", "ConfigMap"): "V1ConfigMap"}


def build() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The resources `kubectl kustomize --load-restrictor LoadRestrictionsNone` makes, and the kustomization."""
    kz = yaml.safe_load((LOADTEST / "kustomization.yaml").read_text())
    out: list[dict[str, Any]] = []
    for res in kz["resources"]:
        out += docs(LOADTEST / res)
    for gen in kz.get("configMapGenerator", []):
        data = {}
        for f in gen["files"]:
            name, _, rel = f.partition("=")
            data[name] = (LOADTEST / rel).resolve().read_text()
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return out, kz


def by(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (d,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return d


def quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, mult in units.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * mult)
    return int(q)


def test_resources_are_valid_kubernetes_objects() -> None:
    resources, kz = build()
    assert kz["generatorOptions"]["disableNameSuffixHash"] is True  # the Deployments name it as is
    kinds = sorted((r["apiVersion"], r["kind"]) for r in resources)
    assert kinds == sorted([("v1", "ConfigMap"), ("v1", "ConfigMap"), ("apps/v1", "Deployment"),
                            ("apps/v1", "Deployment"), ("v1", "Service")]), kinds
    for r in resources:
        check_model(r, MODELS[r["apiVersion"], r["kind"]], f"{r['kind']}/{r['metadata']['name']}")
    for name in ("locust-master", "locust-worker"):
        dep = by(resources, "Deployment", name)
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_workers_reach_the_master_and_run_the_repositorys_locustfile() -> None:
    resources, _ = build()
    settings = by(resources, "ConfigMap", "rollbox-locust-settings")["data"]
    locustfile = by(resources, "ConfigMap", "rollbox-locustfile")["data"]
    assert locustfile == {"locustfile.py": (REPO / "loadtest" / "locustfile.py").read_text()}
    svc = by(resources, "Service", "locust-master")
    master = by(resources, "Deployment", "locust-master")["spec"]["template"]
    worker = by(resources, "Deployment", "locust-worker")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= master["metadata"]["labels"].items()
    (mc,), (wc,) = master["spec"]["containers"], worker["spec"]["containers"]
    assert "--master" in mc["args"] and "--worker" in wc["args"]
    assert wc["args"][wc["args"].index("--master-host") + 1] == svc["metadata"]["name"]
    assert 5557 in {p["port"] for p in svc["spec"]["ports"]} and 5557 in {p["containerPort"] for p in mc["ports"]}
    for pod, c in ((master, mc), (worker, wc)):
        assert c["envFrom"] == [{"configMapRef": {"name": "rollbox-locust-settings"}}]
        (mount,) = c["volumeMounts"]
        (vol,) = pod["spec"]["volumes"]
        assert vol["name"] == mount["name"] and vol["configMap"]["name"] == "rollbox-locustfile"
        assert settings["LOCUST_LOCUSTFILE"] == mount["mountPath"] + "/locustfile.py"
    assert mc["image"] == wc["image"] and mc["image"].endswith(":" + _locust_version())


def test_sized_for_100k_users() -> None:
    resources, _ = build()
    settings = by(resources, "ConfigMap", "rollbox-locust-settings")["data"]
    workers = by(resources, "Deployment", "locust-worker")
    replicas = workers["spec"]["replicas"]
    users = int(settings["LOCUST_USERS"])
    assert users >= USERS_TARGET and int(settings["LOCUST_EXPECT_WORKERS"]) == replicas
    assert int(settings["LOCUST_SPAWN_RATE"]) >= 100  # the issue's ramp: at least 100 users/s
    (c,) = workers["spec"]["template"]["spec"]["containers"]
    per_worker = users / replicas
    assert quantity_bytes(c["resources"]["requests"]["memory"]) >= 2 * per_worker * RSS_PER_USER_BYTES
    assert quantity_bytes(c["resources"]["limits"]["memory"]) >= quantity_bytes(c["resources"]["requests"]["memory"])
    assert float(c["resources"]["requests"]["cpu"]) >= 1  # gevent: one core per worker process
    # users share their worker's connections: the sockets to the service are few, not 100k
    assert 0 < int(settings["ROLLBOX_LOCUST_CONNECTIONS"]) * replicas <= 1000
    assert float(settings["ROLLBOX_LOCUST_THINK_MIN_S"]) >= 60 and settings["ROLLBOX_LOCUST_SHAPE"] == "none"


def _locust_version() -> str:
    import importlib.metadata
    return importlib.metadata.version("locust")


def test_every_setting_is_one_locust_or_the_locustfile_reads() -> None:
    # Locust patches the standard library with gevent when imported: ask a process of its own
    probe = (
        "import json, sys; sys.argv = ['locust']\n"
        "import locust.argument_parser as ap\n"
        f"sys.path.insert(0, {str(REPO / 'loadtest')!r})\n"
        "import locustfile\n"
        "p = ap.get_parser()  # with the locustfile's flags: it registered them on import\n"
        "print(json.dumps(sorted(a.env_var for a in p._actions if getattr(a, 'env_var', None))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    known = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "LOCUST_USERS" in known and "ROLLBOX_LOCUST_CONNECTIONS" in known, sorted(known)
    resources, _ = build()
    settings = by(resources, "ConfigMap", "rollbox-locust-settings")["data"]
    unknown = set(settings) - known - {"ROLLBOX_LOCUST_SHAPE"}  # (read at import: see the locustfile)
    assert not unknown, unknown
