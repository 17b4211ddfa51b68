"""The operator's Kubernetes facade over the official `kubernetes` client: the few calls the operator makes,
each returning the API's own JSON (camelCase, as `kubectl get -o json` shows it) and raising `KubeError`
for every failure, so no caller meets the library's model classes or exceptions.

What the library gives: config loading (in-cluster service account, else kubeconfig), connection pooling,
and retries through urllib3 (`Configuration.retries`: connection errors, and 429/5xx on the idempotent GET
and merge PATCH; never a 4xx, never a POST, which could post an Event twice). What this adds: one ApiClient
per process, a timeout on every call, and one fresh login when the API server answers 401 Unauthorized (a
service-account token rotated on disk while the pod runs).

Synchronous on purpose: the Actuator protocol is synchronous, and the kopf handlers run a whole evaluation
in a worker thread so the event loop stays free.

Every request first takes a token (`TokenBucket`), the client-side rate limit client-go and
controller-runtime keep: a token bucket of `qps` tokens a second holding at most `burst`, one token a request. A fleet of policies
then meets the API server at a steady pace the chart states (`operator.kubeApi.qps` / `.burst`) instead of
in bursts of every policy's tick at once."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.util.retry import Retry

from kvtune.operator.k8s.bounded_patch import bounded_patch, workload_path
from kvtune.operator.k8s.crd import GROUP, PLURAL, VERSION
from kvtune.operator.k8s.informer import ObjectCache

# metadata only (no data travels), or the whole object from an API server that cannot answer that
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "kvtune-operator"
# the name its writes carry in managedFields, so `kubectl get -o yaml --show-managed-fields` (and another
# tool's conflict message) says kvtune changed the field
FIELD_MANAGER = "kvtune"
WorkloadKind = Literal["Deployment", "StatefulSet"]
WORKLOAD_KINDS: tuple[WorkloadKind, ...] = ("Deployment", "StatefulSet")
Json = dict[str, Any]
THROTTLE_LOG_S = 1.0  # a wait this long on the client-side limit is logged, as client-go does
logger = logging.getLogger(__name__)
Load = Callable[[], client.Configuration]


class RequestObserver(Protocol):
    def api_request(self, verb: str, code: int, waited_s: float) -> None: ...


@dataclass  # not frozen: raising sets __traceback__ on it
class KubeError(Exception):
    status: int  # 0: the API server could not be reached
    reason: str
    message: str

    def __str__(self) -> str:
        return f"HTTP {self.status} {self.reason}: {self.message}" if self.status else self.message


def retries() -> Retry:
    """A few attempts with backoff on connection errors and on 429/5xx answers to GET and merge PATCH
    (repeating a merge patch leaves the same object); a 4xx other than 429 is the caller's to handle."""
    return Retry(
        total=3,
        backoff_factor=0.2,
        status_forcelist=(429, 500, 502, 503, 504),
        allowed_methods=frozenset({"GET", "PATCH"}),
        raise_on_status=False,
        respect_retry_after_header=True,
    )


def environment_configuration() -> client.Configuration:
    """The pod's service account, else the kubeconfig ($KUBECONFIG or ~/.kube/config), as kubectl finds it."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            # $KUBECONFIG as it is now (the library reads it once, at import)
            config.load_kube_config(  # type: ignore[no-untyped-call]
                os.environ.get("KUBECONFIG") or None, client_configuration=configuration
            )
        except (config.ConfigException, OSError) as err:
            raise KubeError(
                0, "NoCredentials", f"no service account token and no usable kubeconfig: {err}"
            ) from None
    return configuration


def _error(what: str, err: ApiException) -> KubeError:
    """The API server's Status (reason, message) when it sent one, else the HTTP reason and body."""
    reason, message = str(err.reason or ""), str(err.body or "")[:200]
    try:
        status = json.loads(err.body) if err.body else {}
        if isinstance(status, dict):
            reason = str(status.get("reason") or reason)
            message = str(status.get("message") or message)
    except ValueError:
        pass
    return KubeError(int(err.status or 0), reason, f"{what}: {message}")


class KubeApi:
    """One per process, shared by every evaluation: it logs in once, and again only when the API server
    answers 401 Unauthorized."""

    def __init__(self, load: Load, timeout: float = 10.0, limiter: TokenBucket | None = None,
                 cache: ObjectCache | None = None, observer: RequestObserver | None = None) -> None:  # fmt: skip
        self._load = load
        self._timeout = timeout
        self._lock = threading.Lock()
        self._client = self._new_client()
        self.limiter = limiter or TokenBucket(0.0)  # no limit unless given one (the operator gives it)
        self.cache = cache  # the watches' view of workloads and EndpointSlices, where the operator keeps one
        self.observer = observer  # told of every request (the operator's own metrics count them)

    @staticmethod
    def from_environment(limiter: TokenBucket | None = None, cache: ObjectCache | None = None,
                         observer: RequestObserver | None = None) -> KubeApi:  # fmt: skip
        return KubeApi(environment_configuration, limiter=limiter, cache=cache, observer=observer)

    def _new_client(self) -> client.ApiClient:
        configuration = self._load()
        configuration.retries = retries()
        api_client = client.ApiClient(configuration)
        api_client.user_agent = USER_AGENT
        return api_client

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _relogin(self, stale: client.ApiClient) -> None:
        """Log in again, once for every thread that met the stale credentials."""
        with self._lock:
            if self._client is stale:
                self._client = self._new_client()
                stale.close()  # type: ignore[no-untyped-call]

    def _call(self, what: str, call: Callable[[client.ApiClient, float], Any]) -> Any:
        """Run one library call (made with `_preload_content=False`), once the rate limit allows, and decode
        its JSON body."""
        waited = self.limiter.take()
        if waited >= THROTTLE_LOG_S:
            logger.warning("waited %.1f s for client-side rate limiting before %s", waited, what)
        api_client = self._client
        code = 0
        try:
            try:
                response = call(api_client, self._timeout)
            except ApiException as err:
                if err.status != 401:
                    raise
                self._relogin(api_client)
                response = call(self._client, self._timeout)
            code = int(getattr(response, "status", 200) or 200)
            body = response.data
        except ApiException as err:
            code = int(err.status or 0)
            raise _error(what, err) from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise KubeError(0, "Unreachable", f"{what}: {type(err).__name__}: {err}") from None
        finally:
            if self.observer is not None:
                self.observer.api_request(what.split(" ", 1)[0], code, waited)
        try:
            return json.loads(body)
        except ValueError:
            raise KubeError(200, "BadBody", f"{what}: not JSON") from None

    def _object(self, what: str, call: Callable[[client.ApiClient, float], Any]) -> Json:
        data = self._call(what, call)
        return data if isinstance(data, dict) else {}

    def read_workload(self, kind: WorkloadKind, namespace: str, name: str, fresh: bool = False) -> Json:
        """A Deployment or StatefulSet (apps/v1): as the watch last saw it, unless `fresh` (or not seen)."""
        if self.cache is not None and not fresh:
            seen = self.cache.workload(kind, namespace, name)
            if seen is not None:
                return seen
        read = {
            "Deployment": client.AppsV1Api.read_namespaced_deployment,
            "StatefulSet": client.AppsV1Api.read_namespaced_stateful_set,
        }[kind]
        found = self._object(
            f"GET {kind} {namespace}/{name}",
            lambda c, t: read(
                client.AppsV1Api(c), name, namespace, _preload_content=False, _request_timeout=t
            ),
        )
        if self.cache is not None:
            self.cache.read_through(kind, found)
        return found

    def patch_workload(
        self, kind: WorkloadKind, namespace: str, name: str, patch: Json, deadline: float | None = None
    ) -> Json:
        """A JSON merge patch of a Deployment or StatefulSet, as field manager `kvtune`; a stale
        metadata.resourceVersion in it gets 409 Conflict. With `deadline` (a time.time()), one the API server
        gives up on at that time and that is never retried (k8s/bounded_patch.py)."""
        if deadline is not None:
            path = workload_path(kind, namespace, name)
            return self._object(f"PATCH {kind} {namespace}/{name}",
                                lambda c, t: bounded_patch(c, path, patch, deadline, MERGE_PATCH, FIELD_MANAGER))  # fmt: skip
        send = {
            "Deployment": client.AppsV1Api.patch_namespaced_deployment,
            "StatefulSet": client.AppsV1Api.patch_namespaced_stateful_set,
        }[kind]
        return self._object(
            f"PATCH {kind} {namespace}/{name}",
            lambda c, t: send(
                client.AppsV1Api(c),
                name,
                namespace,
                patch,
                field_manager=FIELD_MANAGER,
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=t,
            ),
        )

    def read_secret(self, namespace: str, name: str) -> Json:
        return self._object(
            f"GET Secret {namespace}/{name}",
            lambda c, t: client.CoreV1Api(c).read_namespaced_secret(
                name, namespace, _preload_content=False, _request_timeout=t
            ),
        )

    def read_secret_metadata(self, namespace: str, name: str) -> Json:
        """A Secret's metadata alone: enough to see whether it changed since it was last read."""
        return self._object(
            f"GET Secret {namespace}/{name} (metadata)",
            lambda c, t: client.CoreV1Api(c).read_namespaced_secret(
                name,
                namespace,
                _headers={"Accept": METADATA_ONLY},
                _preload_content=False,
                _request_timeout=t,
            ),
        )

    def list_endpoint_slices(self, namespace: str, service: str) -> list[Json]:
        """The EndpointSlices (discovery.k8s.io/v1) of one Service, as the watch last saw them where it has."""
        if self.cache is not None:
            seen = self.cache.endpoint_slices(namespace, service)
            if seen is not None:
                return seen
        data = self._object(
            f"LIST EndpointSlices {namespace} service={service}",
            lambda c, t: client.DiscoveryV1Api(c).list_namespaced_endpoint_slice(
                namespace,
                label_selector=f"kubernetes.io/service-name={service}",
                _preload_content=False,
                _request_timeout=t,
            ),
        )
        slices = [item for item in data.get("items") or [] if isinstance(item, dict)]
        if self.cache is not None:
            self.cache.read_through_slices(namespace, service, slices)
        return slices

    def list_autoscalers(self, namespace: str) -> tuple[list[Json], list[Json]]:
        """The namespace's HorizontalPodAutoscalers (autoscaling/v2) and KEDA ScaledObjects (keda.sh/v1alpha1;
        none where KEDA's CRD is not installed)."""
        hpas = self._object(
            f"LIST HorizontalPodAutoscalers {namespace}",
            lambda c, t: client.AutoscalingV2Api(c).list_namespaced_horizontal_pod_autoscaler(
                namespace, _preload_content=False, _request_timeout=t
            ),
        )
        try:
            scaled = self._object(
                f"LIST ScaledObjects {namespace}",
                lambda c, t: client.CustomObjectsApi(c).list_namespaced_custom_object(
                    "keda.sh",
                    "v1alpha1",
                    namespace,
                    "scaledobjects",
                    _preload_content=False,
                    _request_timeout=t,
                ),
            )
        except KubeError as err:
            if err.status != 404:
                raise
            scaled = {}
        items = [item for item in hpas.get("items") or [] if isinstance(item, dict)]
        return items, [item for item in scaled.get("items") or [] if isinstance(item, dict)]

    def create_event(self, namespace: str, body: Json) -> Json:
        """POST one core/v1 Event."""
        event = client.CoreV1Event.from_dict(body)
        if event is None:
            raise KubeError(0, "BadEvent", f"not an Event: {body!r:.200}")
        return self._object(
            f"POST Event {namespace}",
            lambda c, t: client.CoreV1Api(c).create_namespaced_event(
                namespace, event, _preload_content=False, _request_timeout=t
            ),
        )

    def patch_policy_status(self, namespace: str, name: str, body: Json) -> Json:
        """A JSON merge patch of a KVTuningPolicy's status subresource."""
        return self._object(
            f"PATCH KVTuningPolicy {namespace}/{name}/status",
            lambda c, t: client.CustomObjectsApi(c).patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                body,
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=t,
            ),
        )


DEFAULT_QPS = 20.0  # controller-runtime's defaults (client-go's own are 5 and 10)
DEFAULT_BURST = 30
DEFAULT_WORKERS = 16  # evaluations at once (`--workers`): mostly waiting on scrapes and the API server


class TokenBucket:
    """Thread-safe: each caller takes one token, waiting (outside the lock) for its turn when none is left.
    A qps of 0 or less means no limit."""

    def __init__(self, qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        if qps > 0 and burst < 1:
            raise ValueError(f"burst must be at least 1 with a qps limit, got {burst}")
        self.qps = qps
        self.burst = burst
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._at = clock()

    def reserve(self) -> float:
        """Take the next token; the seconds until it is due (0 when one was there)."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
            self._at = now
            self._tokens -= 1.0  # may go below zero: the debt is the queue of callers waiting
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def take(self) -> float:
        """Wait for a token; the seconds waited."""
        delay = self.reserve()
        if delay > 0:
            self.sleep(delay)
        return delay
