"""The kopf handlers: thin. One daemon per KVTuningPolicy acts as its timer (the interval comes from the
policy's spec and may change while it runs, which a kopf timer's fixed interval cannot follow); each tick
runs `reconcile.run_once` in a worker thread. One Kubernetes client serves the whole process: made at
startup, kept in kopf's memo, closed at cleanup. The memo also holds the operator's own metrics
(`memo.operator_metrics`, served by `kvtune operator --metrics-port`): every tick records into them, a
failed one counts as an error, and a policy's series go when its daemon stops. The memo also holds the
highest mode a policy may run in (`memo.max_mode`, `--max-mode`); the kvtune.dev/undo annotation is read
live from the body at each tick. Progress and diff-base go to annotations, so kopf writes nothing into the
status the CRD schema owns."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import kopf
import pydantic

from kvtune.operator.decide.policy import UNDO_ANNOTATION, Mode
from kvtune.operator.io.http import close_shared_client
from kvtune.operator.io.own_metrics import (
    ERROR_EVALUATION,
    ERROR_INVALID_SPEC,
    ERROR_KUBERNETES,
    OperatorMetrics,
)
from kvtune.operator.k8s.crd import GROUP, PLURAL, VERSION, KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.informer import ObjectCache
from kvtune.operator.k8s.kube_api import (
    DEFAULT_BURST,
    DEFAULT_QPS,
    DEFAULT_WORKERS,
    KubeApi,
    KubeError,
    TokenBucket,
)
from kvtune.operator.k8s.reconcile import PolicyMemory, PolicyTick, run_once
from kvtune.operator.k8s.status_writes import refresh_seconds

INVALID_SPEC_RETRY_S = 60.0
CACHE_HANDLER_PREFIX = "cache_"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # kopf's own handler Events: only problems
    # No cluster scanning: the namespaces are named exactly (`--namespace`) and the chart installs the CRDs
    # before the operator starts, so kopf needs neither to list namespaces nor to watch CRDs, and the chart's
    # RBAC grants neither (tests/operator/k8s/test_rbac_proof.py proves it grants exactly the calls made).
    settings.scanning.disabled = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").addFilter(QuietCacheHandlers())
    limiter = TokenBucket(
        getattr(memo, "kube_api_qps", DEFAULT_QPS), getattr(memo, "kube_api_burst", DEFAULT_BURST)
    )
    # every policy's daemon gets a copy of this memo: one client, one cache, one pool of evaluation threads
    if getattr(memo, "operator_metrics", None) is None:  # run without `kvtune operator`: recorded, not served
        memo.operator_metrics = OperatorMetrics()
    memo.kube_api = KubeApi.from_environment(limiter, ObjectCache(), memo.operator_metrics)
    memo.tick_pool = ThreadPoolExecutor(
        getattr(memo, "workers", DEFAULT_WORKERS), thread_name_prefix="kvtune-tick"
    )
    memo.policies = set()  # the policies whose daemons run: how many share the status writes' budget


@kopf.on.cleanup()
def close_client(memo: kopf.Memo, **_: Any) -> None:
    memo.tick_pool.shutdown(wait=False, cancel_futures=True)
    memo.kube_api.close()
    close_shared_client()


def _cache(kind: str) -> Callable[..., None]:
    def keep(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "kube_api", None) is not None and memo.kube_api.cache is not None:
            memo.kube_api.cache.saw(kind, event.get("type"), event.get("object") or {})

    keep.__name__ = keep.__qualname__ = f"{CACHE_HANDLER_PREFIX}{kind.lower()}s"  # kopf's handler id
    return keep


class QuietCacheHandlers(logging.Filter):
    """kopf logs every handler's success at INFO: for the cache's handlers that is a line per watch event of
    every Deployment and EndpointSlice in the watched namespaces, thousands a minute in a fleet."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and CACHE_HANDLER_PREFIX in record.getMessage())


# The watches that keep `ObjectCache`: what the evaluations read of the workloads and their pods' slices.
kopf.on.event("apps", "v1", "deployments")(_cache("Deployment"))
kopf.on.event("apps", "v1", "statefulsets")(_cache("StatefulSet"))
kopf.on.event("discovery.k8s.io", "v1", "endpointslices")(_cache("EndpointSlice"))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The same credentials `KubeApi.from_environment` uses: the pod's service account, else kubeconfig."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def tick(
    api: KubeApi,
    at: PolicyTick,
    memory: PolicyMemory,
    metrics: OperatorMetrics,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """One evaluation, in a worker thread (its time taken there: the pool may have queued it); nothing it
    meets may stop the daemon (it is counted instead)."""
    ref = at.ref
    try:
        outcome = run_once(api, replace(at, now=time.time()), memory, metrics)
        logger.info("%s", outcome.status.note)
    except KubeError as err:
        logger.error("Kubernetes API: %s", err)
        metrics.record_error(ref.namespace, ref.name, ERROR_KUBERNETES)
    except Exception:
        logger.exception("evaluation failed")
        metrics.record_error(ref.namespace, ref.name, ERROR_EVALUATION)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def tune(
    body: kopf.Body,
    status: kopf.Status,
    name: str,
    namespace: str | None,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    ref = PolicyRef(namespace or "default", name, body.metadata.uid)  # the CRD is namespaced
    memory = PolicyMemory.resume(dict(status))
    memo.policies.add(ref)
    try:
        await _evaluate_until_stopped(body, ref, memory, stopped, memo, logger)
    finally:
        memo.policies.discard(ref)
        # deleted, or the operator stops: no stale series
        memo.operator_metrics.forget(ref.namespace, ref.name)


async def _evaluate_until_stopped(
    body: kopf.Body, ref: PolicyRef, memory: PolicyMemory, stopped: kopf.DaemonStopped, memo: kopf.Memo,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:  # fmt: skip
    while not stopped:
        try:
            spec = KVTuningPolicySpec.model_validate(dict(body.spec))  # live: follows spec edits
        except pydantic.ValidationError as err:
            logger.error("invalid spec: %s", err)
            memo.operator_metrics.record_error(ref.namespace, ref.name, ERROR_INVALID_SPEC)
            await stopped.wait(INVALID_SPEC_RETRY_S)
            continue
        at = PolicyTick(
            ref,
            spec,
            time.time(),
            generation=body.metadata.get("generation"),
            max_mode=getattr(memo, "max_mode", Mode.APPLY),  # `kvtune operator --max-mode`
            undo=body.metadata.annotations.get(UNDO_ANNOTATION) or None,  # live, like the spec
            status_refresh_s=refresh_seconds(
                len(memo.policies), memo.kube_api.limiter.qps, float(spec.interval_seconds)
            ),
        )
        # the operator's own pool (`--workers`): bounded, whatever the number of policies
        evaluate = functools.partial(tick, memo.kube_api, at, memory, memo.operator_metrics, logger)
        await asyncio.get_running_loop().run_in_executor(memo.tick_pool, evaluate)
        await stopped.wait(float(spec.interval_seconds))
