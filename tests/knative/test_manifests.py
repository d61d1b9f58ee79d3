"""knative/ manifests: they parse, compose like kustomize, validate against the real Knative CRD schemas
(../shared/reference/knative), use documented autoscaling keys, and cover every request type."""

from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes.client
import pytest
import yaml
from rollbox.functions.config.options import resolve_options
from rollbox.functions.contract.models import (
    CONTRACT,
    EPISODE_ANNOTATE,
    ERROR,
    SANDBOX_CREATE,
    SANDBOX_DESTROY,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_RUN,
    SANDBOX_SNAPSHOT,
)
from rollbox.functions.service.server import OPTIONS as SERVE_OPTIONS

REPO = Path(__file__).resolve().parents[2]
KNATIVE = REPO / "knative"
REFERENCE = REPO.parent / "shared" / "reference" / "knative"
OVERLAYS = sorted(p.parent for p in (KNATIVE / "overlays").glob("*/kustomization.yaml"))
ALL_YAML = sorted(KNATIVE.rglob("*.yaml"))
CRDS = {
    ("serving.knative.dev/v1", "Service"): "serving/service.yaml",
    ("eventing.knative.dev/v1", "Broker"): "eventing/broker.yaml",
    ("eventing.knative.dev/v1", "Trigger"): "eventing/trigger.yaml",
    ("eventing.knative.dev/v1alpha1", "RequestReply"): "eventing/requestreply.yaml",
}
AUTOSCALING = "autoscaling.knative.dev/"
# Per-revision annotation -> the cluster-wide key in config-autoscaler that documents it.
ANNOTATION_TO_CONFIG = {
    "min-scale": "min-scale",
    "max-scale": "max-scale",
    "initial-scale": "initial-scale",
    "scale-down-delay": "scale-down-delay",
    "window": "stable-window",
    "target": "container-concurrency-target-default",
    "target-utilization-percentage": "container-concurrency-target-percentage",
    "target-burst-capacity": "target-burst-capacity",
    "panic-window-percentage": "panic-window-percentage",
    "panic-threshold-percentage": "panic-threshold-percentage",
    "class": "pod-autoscaler-class",
}
METRICS = {"concurrency", "rps", "cpu", "memory"}  # autoscaling.knative.dev/metric has no config key


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def merge(base: Any, patch: Any) -> Any:
    """Strategic-merge for the maps used in the overlays (maps merge, everything else replaces)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base.get(k), v) if k in base else v
        return out
    return copy.deepcopy(patch)


def build(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl apply -k directory` would apply (resources, then patches by kind and name)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out: list[dict[str, Any]] = []
    for res in kustomization.get("resources", []):
        target = (directory / res).resolve()
        out += build(target) if target.is_dir() else docs(target)
    for patch in kustomization.get("patches", []):
        for p in docs(directory / patch["path"]):
            idx = [i for i, d in enumerate(out) if key(d) == key(p)]
            assert len(idx) == 1, f"{directory}/{patch['path']}: patch targets {key(p)}, found {len(idx)} resources"
            out[idx[0]] = merge(out[idx[0]], p)
    for image in kustomization.get("images", []):  # kustomize's image override: new name and/or tag
        for d in out:
            for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                name, _, tag = c["image"].rpartition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return out


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected: the API server prunes them silently, so a typo in
    a manifest would be lost without an error; here it fails."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if k not in ("description",)}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator(rel: str, api_version: str = "v1") -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((REFERENCE / rel).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == api_version and v["served"]]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    schema.setdefault("properties", {}).update(
        apiVersion={"type": "string"}, kind={"type": "string"}, metadata={"type": "object"})
    return jsonschema.Draft7Validator(strict(schema))


def check_model(value: Any, type_name: str, where: str) -> None:
    """Validate against a core Kubernetes type through the OpenAPI models of the kubernetes client
    (RuntimeClass is a core type: it has no CRD)."""
    if type_name in ("str", "int", "bool"):
        assert isinstance(value, {"str": str, "int": int, "bool": bool}[type_name]), f"{where}: not {type_name}"
    elif m := re.fullmatch(r"Dict\[str, (.+)\]", type_name):
        assert isinstance(value, dict), f"{where}: not a map"
        for k, v in value.items():
            check_model(v, m.group(1), f"{where}.{k}")
    elif m := re.fullmatch(r"List\[(.+)\]", type_name):
        assert isinstance(value, list), f"{where}: not a list"
        for i, v in enumerate(value):
            check_model(v, m.group(1), f"{where}[{i}]")
    elif type_name != "object":
        model = getattr(kubernetes.client, type_name)
        fields = {json: attr for attr, json in model.attribute_map.items()}
        assert isinstance(value, dict), f"{where}: not an object"
        unknown = set(value) - set(fields)
        assert not unknown, f"{where}: unknown fields {sorted(unknown)} for {type_name}"
        for k, v in value.items():
            check_model(v, model.openapi_types[fields[k]], f"{where}.{k}")
        model(**{fields[k]: v for k, v in value.items()})  # required fields (raises ValueError)


def of_kind(resources: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in resources if d["kind"] == kind]


def rollbox_service(resources: list[dict[str, Any]]) -> dict[str, Any]:
    (svc,) = [d for d in of_kind(resources, "Service") if d["metadata"]["name"] == "rollbox"]
    return svc


def container_env(resources: list[dict[str, Any]]) -> dict[str, str]:
    """The environment `rollbox serve` starts with (Knative sets PORT; Secret values stand in)."""
    svc = rollbox_service(resources)
    spec = svc["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {"PORT": str(c["ports"][0]["containerPort"])}
    for src in c.get("envFrom", []):
        (cm,) = [d for d in of_kind(resources, "ConfigMap") if d["metadata"]["name"] == src["configMapRef"]["name"]]
        env.update(cm["data"])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", "<from secret>")
    return env


# --- parsing and composition -------------------------------------------------------------------

def test_knative_folder_has_the_manifests() -> None:
    names = {p.relative_to(KNATIVE).as_posix() for p in ALL_YAML}
    assert {"base/service.yaml", "base/runtimeclass-kata.yaml", "base/eventing.yaml", "base/kustomization.yaml",
            "overlays/local-store/kustomization.yaml", "overlays/s3/kustomization.yaml"} <= names
    assert [p.name for p in OVERLAYS] == ["kafka", "kata-clh", "languages", "local-store", "s3"]


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.relative_to(KNATIVE).as_posix())
def test_every_manifest_parses(path: Path) -> None:
    parsed = docs(path)
    assert parsed, f"{path}: empty"
    for d in parsed:
        assert isinstance(d, dict) and d.get("apiVersion") and d.get("kind"), f"{path}: not a Kubernetes object"
        if d["kind"] != "Kustomization":
            assert d["metadata"]["name"], f"{path}: {d['kind']} without a name"


@pytest.mark.parametrize("directory", [KNATIVE / "base", *OVERLAYS], ids=lambda p: p.name)
def test_kustomization_files_exist_and_compose(directory: Path) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization.get("resources", []) + [p["path"] for p in kustomization.get("patches", [])]
    assert listed
    for rel in listed:
        target = directory / rel
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{directory.name}: {rel} missing"
    resources = build(directory)
    keys = [key(d) for d in resources]
    assert len(keys) == len(set(keys)), f"duplicate resources: {keys}"


def test_base_lists_every_base_file() -> None:
    listed = set(yaml.safe_load((KNATIVE / "base/kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in (KNATIVE / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_build_rejects_a_patch_without_target(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        f"kind: Kustomization\nresources: [{KNATIVE / 'base'}]\npatches: [{{path: p.yaml}}]\n")
    (tmp_path / "p.yaml").write_text("kind: ConfigMap\nmetadata: {name: not-there}\n")
    with pytest.raises(AssertionError, match="not-there"):
        build(tmp_path)


# --- schemas -----------------------------------------------------------------------------------

@pytest.mark.parametrize("directory", [KNATIVE / "base", *OVERLAYS], ids=lambda p: p.name)
def test_resources_validate_against_the_knative_crds(directory: Path) -> None:
    resources = build(directory)
    checked = set()
    for d in resources:
        crd = CRDS.get((d["apiVersion"], d["kind"]))
        if crd is not None:
            validator = crd_validator(crd, d["apiVersion"].rsplit("/", 1)[1])
            errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(d)]
            assert not errors, f"{key(d)}: {errors}"
            checked.add(d["kind"])
        elif d["kind"] == "RuntimeClass":
            assert d["apiVersion"] == "node.k8s.io/v1"
            check_model(d, "V1RuntimeClass", "RuntimeClass")
            checked.add(d["kind"])
        else:
            assert (d["apiVersion"], d["kind"]) == ("v1", "ConfigMap"), f"unchecked resource {key(d)}"
            check_model(d, "V1ConfigMap", "ConfigMap")
    assert checked == {"Service", "Broker", "Trigger", "RuntimeClass"} | (
        {"RequestReply"} if directory.name == "kafka" else set())


def test_strict_schemas_reject_misspelled_and_mistyped_fields() -> None:
    svc = rollbox_service(build(KNATIVE / "base"))
    bad = copy.deepcopy(svc)
    bad["spec"]["template"]["spec"]["containerConcurency"] = 1
    assert not crd_validator(CRDS["serving.knative.dev/v1", "Service"]).is_valid(bad)
    bad = copy.deepcopy(svc)
    bad["spec"]["template"]["spec"]["timeoutSeconds"] = "300"
    assert not crd_validator(CRDS["serving.knative.dev/v1", "Service"]).is_valid(bad)
    with pytest.raises(AssertionError, match="handlr"):
        check_model({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "handlr": "kata"}, "V1RuntimeClass", "rc")
    with pytest.raises(ValueError, match="handler"):
        check_model({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass"}, "V1RuntimeClass", "rc")


# --- the Service -------------------------------------------------------------------------------

def documented_autoscaler_keys() -> dict[str, str]:
    cm = yaml.safe_load((REFERENCE / "serving/autoscaler.yaml").read_text())
    example: dict[str, str] = yaml.safe_load(cm["data"]["_example"])
    return example


def duration_s(raw: str) -> int:
    m = re.fullmatch(r"(\d+)(s|m|h)", raw)
    assert m, f"not a whole Go duration: {raw!r}"
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


@pytest.mark.parametrize("directory", [KNATIVE / "base", *OVERLAYS], ids=lambda p: p.name)
def test_autoscaling_annotations_are_documented_and_consistent(directory: Path) -> None:
    documented = documented_autoscaler_keys()
    resources = build(directory)
    for svc in of_kind(resources, "Service"):
        ann = {k.removeprefix(AUTOSCALING): v for k, v in svc["spec"]["template"]["metadata"]["annotations"].items()
               if k.startswith(AUTOSCALING)}
        for name, value in ann.items():
            if name == "metric":
                assert value in METRICS
                continue
            assert name in ANNOTATION_TO_CONFIG, f"{AUTOSCALING}{name} is not a Knative autoscaling annotation"
            default = documented[ANNOTATION_TO_CONFIG[name]]
            if name == "class":
                assert value in (default, "hpa.autoscaling.knative.dev")
            elif str(default).endswith("s"):
                duration_s(value)
            else:
                float(value)
        assert int(ann["min-scale"]) <= int(ann["max-scale"])
        if "window" in ann:
            assert 6 <= duration_s(ann["window"]) <= 3600
        if "scale-down-delay" in ann:
            assert 0 <= duration_s(ann["scale-down-delay"]) <= 3600
    svc = rollbox_service(resources)
    spec = svc["spec"]["template"]["spec"]
    ann = svc["spec"]["template"]["metadata"]["annotations"]
    assert int(ann[AUTOSCALING + "target"]) <= spec["containerConcurrency"]
    env = container_env(resources)
    # Events Knative lets through are admitted (not 429), and draining ends before Knative kills the pod.
    assert int(env["ROLLBOX_MAX_QUEUED"]) >= spec["containerConcurrency"]
    assert float(env["ROLLBOX_GRACE_S"]) < spec["timeoutSeconds"]


def test_base_scales_to_zero_and_runs_in_kata() -> None:
    resources = build(KNATIVE / "base")
    svc = rollbox_service(resources)
    tmpl = svc["spec"]["template"]
    assert tmpl["metadata"]["annotations"][AUTOSCALING + "min-scale"] == "0"
    assert tmpl["spec"]["runtimeClassName"] == "kata-qemu"  # the handler with VM templating
    # as kata-deploy declares them (handler, pod overhead, node label), so both can be applied
    classes = {d["metadata"]["name"]: d for d in of_kind(resources, "RuntimeClass")}
    assert set(classes) == {"kata-qemu", "kata-clh"}
    for name, memory in (("kata-qemu", "160Mi"), ("kata-clh", "130Mi")):
        rc = classes[name]
        assert rc["handler"] == name
        assert rc["overhead"]["podFixed"] == {"cpu": "250m", "memory": memory}
        assert rc["scheduling"]["nodeSelector"] == {"katacontainers.io/kata-runtime": "true"}
    (c,) = tmpl["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_feature_flags_the_service_needs_are_named() -> None:
    features = yaml.safe_load((REFERENCE / "serving/features.yaml").read_text())["data"]["_example"]
    text = (KNATIVE / "base/service.yaml").read_text()
    for flag in ("kubernetes.podspec-runtimeclassname", "kubernetes.containerspec-addcapabilities"):
        assert re.search(rf"^{re.escape(flag)}:", features, re.M), flag
        assert flag in text
    assert "Kata VM" in text and "PRIVILEGES" in text


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_rollbox_serve_accepts_the_environment(directory: Path) -> None:
    env = container_env(build(directory))
    known = {o.env for o in SERVE_OPTIONS} | {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert set(env) <= known, f"not read by rollbox serve: {sorted(set(env) - known)}"
    values = resolve_options(SERVE_OPTIONS, argparse.Namespace(), env)
    assert values["host"] == "0.0.0.0" and values["port"] == 8080
    if directory.name in ("s3", "kafka", "kata-clh", "languages"):  # the others: the s3 overlay and more
        assert str(values["store"]).startswith("s3://") and values["s3_endpoint_url"].startswith("https://")
        assert int(rollbox_service(build(directory))["spec"]["template"]["metadata"]["annotations"][
            AUTOSCALING + "max-scale"]) > 1
    else:
        assert str(values["store"]).startswith("/var/lib/rollbox/")
        ann = rollbox_service(build(directory))["spec"]["template"]["metadata"]["annotations"]
        assert ann[AUTOSCALING + "max-scale"] == "1"  # a local store is not shared between replicas


def test_the_languages_overlay_runs_the_image_with_the_languages_baked_in_and_builds_nothing() -> None:
    resources = build(KNATIVE / "overlays" / "languages")
    (c,) = rollbox_service(resources)["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/rollbox/rollbox:0.1.0-languages"
    (base,) = rollbox_service(build(KNATIVE / "overlays" / "s3"))["spec"]["template"]["spec"]["containers"]
    assert base["image"] == "ghcr.io/rollbox/rollbox:0.1.0"  # the override is the overlay's alone
    values = resolve_options(SERVE_OPTIONS, argparse.Namespace(), container_env(resources))
    assert values["language_builds"] == "off"
    assert "-languages" in (REPO / "scripts" / "image-languages").read_text()


def test_no_literal_secrets() -> None:
    for path in ALL_YAML:
        for d in docs(path):
            assert d["kind"] != "Secret", f"{path}: a Secret in the repository"
    resources = build(KNATIVE / "overlays/s3")
    (c,) = rollbox_service(resources)["spec"]["template"]["spec"]["containers"]
    secretish = re.compile(r"SECRET|ACCESS_KEY|TOKEN|PASSWORD", re.I)
    for e in c["env"]:
        if secretish.search(e["name"]):
            assert "value" not in e and e["valueFrom"]["secretKeyRef"]["name"] == "rollbox-s3-credentials", e
    assert {e["name"] for e in c["env"] if "valueFrom" in e} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for cm in of_kind(resources, "ConfigMap"):
        assert not [k for k in cm["data"] if secretish.search(k)], cm


# --- eventing ----------------------------------------------------------------------------------

def test_triggers_cover_every_request_type_and_no_reply_type() -> None:
    resources = build(KNATIVE / "base")
    triggers = of_kind(resources, "Trigger")
    filtered = [t["spec"]["filter"]["attributes"] for t in triggers]
    assert all(set(f) == {"type"} for f in filtered)
    types = sorted(f["type"] for f in filtered)
    assert types == sorted(spec.request_type for spec in CONTRACT)
    assert set(types) == {SANDBOX_CREATE, SANDBOX_EXEC, SANDBOX_RUN, SANDBOX_DESTROY, SANDBOX_SNAPSHOT, SANDBOX_FORK,
                          EPISODE_ANNOTATE}
    replies = {spec.reply_type for spec in CONTRACT} | {ERROR}
    assert not set(types) & replies  # replies go back into the Broker: they must not loop


def test_triggers_deliver_to_the_service_with_retries_and_dead_letters() -> None:
    resources = build(KNATIVE / "base")
    names = {key(d) for d in resources}
    (broker,) = of_kind(resources, "Broker")
    for owner in [broker, *of_kind(resources, "Trigger")]:
        delivery = owner["spec"]["delivery"]
        assert delivery["retry"] >= 1
        assert delivery["backoffPolicy"] in ("exponential", "linear")
        assert re.fullmatch(r"PT\d+(\.\d+)?S", delivery["backoffDelay"])
        sink = delivery["deadLetterSink"]["ref"]
        assert (sink["kind"], sink["name"]) in names and sink["name"] != "rollbox"
    for t in of_kind(resources, "Trigger"):
        assert t["spec"]["broker"] == broker["metadata"]["name"]
        ref = t["spec"]["subscriber"]["ref"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("serving.knative.dev/v1", "Service", "rollbox")


# --- ordered delivery through a Kafka Broker ---------------------------------------------------

def test_kafka_overlay_orders_every_trigger_and_replies_through_request_reply() -> None:
    """Kafka Broker (its config map in the overlay), every Trigger an ordered consumer, and a
    RequestReply whose attributes are the ones rollbox's replies carry (functions/contract/models.py)."""
    from rollbox.functions.contract.models import CORRELATION_ID, REPLY_CARRIES, REPLY_ID

    resources = {key(d): d for d in build(KNATIVE / "overlays" / "kafka")}
    broker = resources["Broker", "rollbox"]
    assert broker["metadata"]["annotations"]["eventing.knative.dev/broker.class"] == "Kafka"
    config = broker["spec"]["config"]
    assert (config["kind"], config["name"]) in {(k, n) for k, n in resources}
    assert resources[config["kind"], config["name"]]["data"]["bootstrap.servers"]
    assert broker["spec"]["delivery"]["deadLetterSink"]  # the base's retries and dead letters are kept
    triggers = [d for (k, _), d in resources.items() if k == "Trigger"]
    assert len(triggers) == 7
    for t in triggers:
        assert t["metadata"]["annotations"]["kafka.eventing.knative.dev/delivery.order"] == "ordered", t
        assert t["spec"]["broker"] == "rollbox" and t["spec"]["filter"]["attributes"]["type"]
    rr = resources["RequestReply", "rollbox"]
    assert rr["spec"]["brokerRef"] == {"apiVersion": "eventing.knative.dev/v1", "kind": "Broker", "name": "rollbox"}
    assert (rr["spec"]["correlationAttribute"], rr["spec"]["replyAttribute"]) == (CORRELATION_ID, REPLY_ID)
    assert (CORRELATION_ID, REPLY_ID) in REPLY_CARRIES
    # the base and the s3 overlay stay unordered (a plain MTChannelBasedBroker)
    base = {key(d): d for d in build(KNATIVE / "overlays" / "s3")}
    assert base["Broker", "rollbox"]["metadata"]["annotations"]["eventing.knative.dev/broker.class"] \
        == "MTChannelBasedBroker"


def test_the_kata_clh_overlay_runs_the_s3_deployment_in_cloud_hypervisor_vms() -> None:
    clh, s3 = build(KNATIVE / "overlays/kata-clh"), build(KNATIVE / "overlays/s3")
    spec = rollbox_service(clh)["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "kata-clh"
    assert "kata-clh" in {d["metadata"]["name"] for d in of_kind(clh, "RuntimeClass")}
    spec["runtimeClassName"] = "kata-qemu"
    assert clh == s3  # nothing else differs


def test_the_knative_readme_names_real_flags_and_the_template_settings() -> None:
    """The node and cluster set-up in knative/README.md: the feature flags it patches exist in Knative
    Serving's config-features, and both RuntimeClasses and the factory settings are described."""
    text = (KNATIVE / "README.md").read_text()
    features = yaml.safe_load((REFERENCE / "serving/features.yaml").read_text())["data"]["_example"]
    patched = json.loads(re.search(r"-p \\\n\s*'(\{.*\})'", text).group(1))["data"]
    assert set(patched) == {"kubernetes.podspec-runtimeclassname", "kubernetes.containerspec-addcapabilities"}
    for flag, value in patched.items():
        assert value == "enabled" and re.search(rf"^{re.escape(flag)}:", features, re.M), flag
    for needed in ("enable_template = true", "initrd =", "# image =", "kata-runtime factory init",
                   "kata-qemu", "kata-clh", "katacontainers.io/kata-runtime=true", "kubectl apply -k knative/overlays/s3"):
        assert needed in text, needed
    for overlay in OVERLAYS:
        assert f"`overlays/{overlay.name}`" in text, overlay.name
