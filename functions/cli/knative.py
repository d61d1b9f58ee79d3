"""Burst pre-warming on Knative: raise a Service's min-scale before a training burst, lower it after.

Knative keeps at least ``autoscaling.knative.dev/min-scale`` replicas of a Service's latest
Revision. ``prewarm`` sets it on the Service template with a JSON merge patch (which creates a new
Revision; Knative keeps routing to the old one until the new one has its replicas ready), and
``release`` puts it back to 0 so the Service scales to zero after ``scale-down-delay``
(knative/base/service.yaml). ``wait_ready`` waits until the Service's newest Revision is ready with
that many replicas. Kubernetes client errors are converted once, here, to ``KnativeError``.

    rollbox knative prewarm --replicas 8 [--namespace rl] [--service rollbox] [--wait-s 300]
    rollbox knative release [--namespace rl] [--service rollbox]
    rollbox knative status  [--namespace rl] [--service rollbox] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from rollbox.runtime.errors import InvalidRequest, RollboxError

if TYPE_CHECKING:
    from kubernetes import client

__all__ = ["MIN_SCALE_ANNOTATION", "KnativeError", "KubernetesNotConfigured", "Scale", "add_parser", "min_scale_patch",
           "prewarm", "release", "scale", "wait_ready"]

MIN_SCALE_ANNOTATION: Final = "autoscaling.knative.dev/min-scale"
_GROUP: Final = "serving.knative.dev"
_VERSION: Final = "v1"
_PLURAL: Final = "services"
_MERGE_PATCH: Final = "application/merge-patch+json"
_POD_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KnativeError(RollboxError):
    """The Kubernetes API failed or refused a change to a Knative Service (``status``: HTTP status, or
    None when the API server could not be reached or configured)."""

    def __init__(self, message: str, *, namespace: str, service: str, status: int | None = None):
        super().__init__(message)
        self.namespace = namespace
        self.service = service
        self.status = status


class KubernetesNotConfigured(KnativeError):
    """No Kubernetes API to talk to: not in a pod (no service account) and no usable kubeconfig."""


def min_scale_patch(min_scale: int) -> dict[str, Any]:
    """The merge patch that sets the template's min-scale annotation (values are strings in Kubernetes)."""
    return {"spec": {"template": {"metadata": {"annotations": {MIN_SCALE_ANNOTATION: str(min_scale)}}}}}


def prewarm(namespace: str, service: str, min_scale: int, *, api_client: client.ApiClient | None = None) -> None:
    """Keep at least ``min_scale`` replicas of ``service`` running (before a burst)."""
    if isinstance(min_scale, bool) or not isinstance(min_scale, int) or min_scale < 0:
        raise InvalidRequest(f"min_scale must be an integer >= 0, got {min_scale!r}")
    _patch(namespace, service, min_scale_patch(min_scale), api_client)


def release(namespace: str, service: str, *, api_client: client.ApiClient | None = None) -> None:
    """Let ``service`` scale back to zero (after a burst)."""
    _patch(namespace, service, min_scale_patch(0), api_client)


@dataclass(frozen=True)
class Scale:
    """What a Service runs now: its template's min-scale, its newest Revision, whether that one is
    ready (serving), and its replicas (``actual``: running and ready; ``desired``: the autoscaler's)."""

    namespace: str
    service: str
    min_scale: int
    revision: str | None
    ready: bool
    actual: int
    desired: int | None


def scale(namespace: str, service: str, *, api_client: client.ApiClient | None = None) -> Scale:
    """Read the Service and its newest Revision."""
    api_client = api_client or _default_client(namespace, service)
    svc = _call(namespace, service, "reading", lambda api: api.get_namespaced_custom_object(
        _GROUP, _VERSION, namespace, _PLURAL, service), api_client)
    annotations = svc.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}
    try:
        min_scale = int(annotations.get(MIN_SCALE_ANNOTATION, "0"))
    except ValueError:
        min_scale = 0
    status = svc.get("status") or {}
    created, ready_rev = status.get("latestCreatedRevisionName"), status.get("latestReadyRevisionName")
    if not created:
        return Scale(namespace, service, min_scale, None, False, 0, None)
    rev = _call(namespace, created, "reading", lambda api: api.get_namespaced_custom_object(
        _GROUP, _VERSION, namespace, "revisions", created), api_client)
    rs = rev.get("status") or {}
    return Scale(namespace, service, min_scale, created, created == ready_rev,
                 int(rs.get("actualReplicas") or 0), rs.get("desiredReplicas"))


def wait_ready(namespace: str, service: str, replicas: int, *, timeout_s: float, poll_s: float = 2.0,
               api_client: client.ApiClient | None = None, sleep: Callable[[float], None] = time.sleep) -> Scale:
    """Wait until the Service's newest Revision is ready with at least ``replicas`` running; raises
    ``KnativeError`` (status None) with what it last saw when ``timeout_s`` passes first."""
    api_client = api_client or _default_client(namespace, service)
    deadline = time.monotonic() + timeout_s
    while True:
        now = scale(namespace, service, api_client=api_client)
        if now.ready and now.actual >= replicas:
            return now
        if time.monotonic() >= deadline:
            raise KnativeError(
                f"Knative Service {namespace}/{service} has {now.actual} of {replicas} replicas ready after "
                f"{timeout_s:g} s (revision {now.revision}, ready: {now.ready}); check `kubectl get revisions` "
                "and the pods' events (image pulls, node capacity, the RuntimeClass)",
                namespace=namespace, service=service)
        sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


def _patch(namespace: str, service: str, body: dict[str, Any], api_client: client.ApiClient | None) -> None:
    _call(namespace, service, "patching min-scale of", lambda api: api.patch_namespaced_custom_object(
        _GROUP, _VERSION, namespace, _PLURAL, service, body, _content_type=_MERGE_PATCH), api_client)


def _kubernetes() -> Any:
    """The Kubernetes client (the ``knative`` extra), imported on first use: ``rollbox serve`` and the
    image need none of it; without it every entry point here fails with one clear RollboxError."""
    try:
        import kubernetes.client
        import kubernetes.config
    except ImportError as exc:
        raise RollboxError("the Kubernetes client is not installed: pip install 'rollbox[knative]'") from exc
    return kubernetes


def _call(namespace: str, service: str, doing: str, call: Callable[[client.CustomObjectsApi], Any],
          api_client: client.ApiClient | None) -> Any:
    import urllib3.exceptions  # botocore's dependency: always there

    k8s = _kubernetes()
    where = f"Knative Service {namespace}/{service}"
    api_client = api_client or _default_client(namespace, service)
    try:
        return call(k8s.client.CustomObjectsApi(api_client))
    except k8s.client.ApiException as exc:
        hint = {
            401: "the credentials were refused",
            403: "the service account needs get and patch on services and get on revisions of "
                 "serving.knative.dev in this namespace",
            404: "no such Service (check the namespace and name; is Knative Serving installed?)",
        }.get(exc.status or 0, "the API server refused the request")
        raise KnativeError(
            f"{doing} {where} failed: HTTP {exc.status} {exc.reason}: {hint}",
            namespace=namespace,
            service=service,
            status=exc.status,
        ) from exc
    except (urllib3.exceptions.HTTPError, k8s.config.ConfigException) as exc:
        raise KnativeError(
            f"{doing} {where} failed: cannot reach the Kubernetes API ({exc})",
            namespace=namespace,
            service=service,
        ) from exc


def _default_client(namespace: str, service: str) -> client.ApiClient:
    """In a pod: its service account; elsewhere: the current kubeconfig context. Raises
    ``KubernetesNotConfigured`` when there is neither."""
    k8s = _kubernetes()
    try:
        cfg = k8s.client.Configuration()
        k8s.config.load_incluster_config(client_configuration=cfg)
        return k8s.client.ApiClient(cfg)  # type: ignore[no-any-return]
    except k8s.config.ConfigException:
        pass
    try:
        return k8s.config.new_client_from_config()  # type: ignore[no-any-return]
    except (k8s.config.ConfigException, OSError, TypeError, ValueError) as exc:
        where = os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise KubernetesNotConfigured(
            f"no Kubernetes API to talk to for Knative Service {namespace}/{service}: not in a pod (no service "
            f"account) and no usable kubeconfig at {where} ({exc}); set KUBECONFIG or run `kubectl config "
            "use-context`", namespace=namespace, service=service) from exc


# ---------------------------------------------------------------------------------------------- CLI
def add_parser(subparsers: Any, env: Mapping[str, str] = os.environ) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--namespace", default=env.get("ROLLBOX_KNATIVE_NAMESPACE") or None,
                        help="the Service's namespace (ROLLBOX_KNATIVE_NAMESPACE; default: the pod's own, "
                             "else the kubeconfig context's, else 'default')")
    common.add_argument("--service", default=env.get("ROLLBOX_KNATIVE_SERVICE") or "rollbox",
                        help="the Knative Service (ROLLBOX_KNATIVE_SERVICE; default rollbox)")
    p = subparsers.add_parser("knative", help="pre-warm a Knative Service before a training burst, release it after",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="knative_command", required=True)
    q = sub.add_parser("prewarm", parents=[common], help="keep at least N replicas running (min-scale N)")
    q.add_argument("--replicas", type=int, required=True, help="replicas to keep (>= 0)")
    q.add_argument("--wait-s", type=float, default=0.0,
                   help="then wait up to this long until that many replicas are ready (default 0: do not wait)")
    q.set_defaults(func=_cli(_prewarm))
    q = sub.add_parser("release", parents=[common], help="let the Service scale to zero again (min-scale 0)")
    q.set_defaults(func=_cli(_release))
    q = sub.add_parser("status", parents=[common], help="min-scale, the newest Revision and its replicas")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_cli(_status))


def _namespace(given: str | None) -> str:
    if given:
        return given
    try:
        return _POD_NAMESPACE.read_text().strip() or "default"
    except OSError:
        pass
    try:
        k8s = _kubernetes()
    except RollboxError:
        return "default"
    try:
        _, context = k8s.config.list_kube_config_contexts()
        return str(context.get("context", {}).get("namespace") or "default")
    except (k8s.config.ConfigException, OSError, TypeError):
        return "default"


def _cli(run: Callable[[argparse.Namespace, str], int]) -> Callable[[argparse.Namespace], int]:
    def main(args: argparse.Namespace) -> int:
        try:
            return run(args, _namespace(args.namespace))
        except RollboxError as exc:
            print(f"rollbox knative {args.knative_command}: {exc.message}", file=sys.stderr)
            return 2 if isinstance(exc, InvalidRequest | KubernetesNotConfigured) else 1
    return main


def _prewarm(args: argparse.Namespace, namespace: str) -> int:
    if not (args.wait_s >= 0 and args.wait_s < float("inf")):
        raise InvalidRequest(f"--wait-s must be a number >= 0, got {args.wait_s}")
    prewarm(namespace, args.service, args.replicas)
    print(f"{namespace}/{args.service}: min-scale {args.replicas}")
    if args.wait_s > 0 and args.replicas > 0:
        now = wait_ready(namespace, args.service, args.replicas, timeout_s=args.wait_s)
        print(f"{namespace}/{args.service}: {now.actual} replicas ready (revision {now.revision})")
    return 0


def _release(args: argparse.Namespace, namespace: str) -> int:
    release(namespace, args.service)
    print(f"{namespace}/{args.service}: min-scale 0 (scales to zero after its scale-down-delay)")
    return 0


def _status(args: argparse.Namespace, namespace: str) -> int:
    now = scale(namespace, args.service)
    if args.json:
        print(json.dumps(asdict(now)))
    else:
        print(f"{namespace}/{args.service}: min-scale {now.min_scale}, revision {now.revision or '-'} "
              f"({'ready' if now.ready else 'not ready'}), replicas {now.actual} running, "
              f"{'-' if now.desired is None else now.desired} desired")
    return 0
