"""Burst pre-warming on Knative: raise a Service's min-scale before a training burst, lower it after.

Knative keeps at least ``autoscaling.knative.dev/min-scale`` replicas of a Service's latest
Revision. ``prewarm`` sets it on the Service template with a JSON merge patch (which creates a new
Revision; Knative keeps routing to the old one until the new one has its replicas ready), and
``release`` puts it back to 0 so the Service scales to zero after ``scale-down-delay``
(knative/base/service.yaml). Kubernetes client errors are converted once, here, to ``KnativeError``.
"""

from __future__ import annotations

from typing import Any, Final

import urllib3.exceptions
from kubernetes import client, config
from rollbox.runtime.errors import InvalidRequest, RollboxError

__all__ = ["MIN_SCALE_ANNOTATION", "KnativeError", "min_scale_patch", "prewarm", "release"]

MIN_SCALE_ANNOTATION: Final = "autoscaling.knative.dev/min-scale"
_GROUP: Final = "serving.knative.dev"
_VERSION: Final = "v1"
_PLURAL: Final = "services"
_MERGE_PATCH: Final = "application/merge-patch+json"


class KnativeError(RollboxError):
    """The Kubernetes API failed or refused a change to a Knative Service (``status``: HTTP status, or
    None when the API server could not be reached or configured)."""

    def __init__(self, message: str, *, namespace: str, service: str, status: int | None = None):
        super().__init__(message)
        self.namespace = namespace
        self.service = service
        self.status = status


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


def _patch(namespace: str, service: str, body: dict[str, Any], api_client: client.ApiClient | None) -> None:
    where = f"Knative Service {namespace}/{service}"
    try:
        api = client.CustomObjectsApi(api_client or _default_client())
        api.patch_namespaced_custom_object(
            _GROUP, _VERSION, namespace, _PLURAL, service, body, _content_type=_MERGE_PATCH
        )
    except client.ApiException as exc:
        hint = {
            401: "the credentials were refused",
            403: "the service account needs 'patch' on services.serving.knative.dev in this namespace",
            404: "no such Service (check the namespace and name; is Knative Serving installed?)",
        }.get(exc.status or 0, "the API server refused the patch")
        raise KnativeError(
            f"patching min-scale of {where} failed: HTTP {exc.status} {exc.reason}: {hint}",
            namespace=namespace,
            service=service,
            status=exc.status,
        ) from exc
    except (urllib3.exceptions.HTTPError, config.ConfigException) as exc:
        raise KnativeError(
            f"patching min-scale of {where} failed: cannot reach the Kubernetes API ({exc})",
            namespace=namespace,
            service=service,
        ) from exc


def _default_client() -> client.ApiClient:
    """In a pod: its service account; elsewhere: the current kubeconfig context."""
    loaders: Any = config  # kubernetes.config's loaders are untyped
    try:
        cfg = client.Configuration()
        loaders.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    except config.ConfigException:
        api_client: client.ApiClient = loaders.new_client_from_config()
        return api_client
