"""`kvtune dashboards push`: upload the dashboards to an existing Grafana through grafana-client (the
maintained fork of the archived grafana-api; its 3.x line, on requests), creating or updating each one by uid
inside one folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import requests
from grafana_client.api import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

from kvtune.dashboards.grafana import dashboard_model, dashboard_uids
from kvtune.errors import KvtuneError


def folder_uid(title: str) -> str:
    """A stable folder uid from its title, so a second push finds the folder the first one made."""
    slug = re.sub(r"[^a-zA-Z0-9_-]+", "-", title).strip("-").lower()
    if not slug:
        raise KvtuneError(f"folder name {title!r} has no letter or digit to make a uid from")
    return slug[:40]


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as err:
        raise KvtuneError(f"cannot read the Grafana token file {path}: {err.strerror}") from err
    if not token:
        raise KvtuneError(f"the Grafana token file {path} is empty")
    return token


def _ensure_folder(api: GrafanaApi, title: str) -> str:
    uid = folder_uid(title)
    try:
        api.folder.get_folder(uid)
    except GrafanaClientError as err:
        if err.status_code != 404:
            raise
        api.folder.create_folder(title, uid=uid)
    return uid


def push(grafana_url: str, token: str, folder: str) -> list[dict[str, Any]]:
    """Uploads every dashboard; returns Grafana's answer for each. Errors become one clear line."""
    api = GrafanaApi.from_url(grafana_url.rstrip("/"), credential=token, timeout=10.0)
    try:
        uid = _ensure_folder(api, folder)
        answers = []
        for dashboard_uid in dashboard_uids():
            model = dashboard_model(dashboard_uid)
            model["id"] = None  # Grafana matches on uid; an id would have to be this Grafana's own
            answers.append(
                api.dashboard.update_dashboard({"dashboard": model, "folderUid": uid, "overwrite": True})
            )
        return answers
    except GrafanaUnauthorizedError as err:
        raise KvtuneError(f"Grafana at {grafana_url} refused the token (401): check --token-file") from err
    except GrafanaException as err:
        raise KvtuneError(f"Grafana at {grafana_url} answered {err.status_code}: {err.message}") from err
    except requests.exceptions.RequestException as err:
        raise KvtuneError(f"cannot reach Grafana at {grafana_url}: {_reason(err)}") from err


def _reason(err: Exception) -> str:
    """The socket's own words ("[Errno 111] Connection refused", "Failed to resolve ...") from the client's
    long retry message."""
    for pattern in (r"\[Errno -?\d+\][^'\")]*", r"Failed to resolve '[^']*'"):
        found = re.search(pattern, str(err))
        if found:
            return found.group(0).strip()
    return type(err).__name__
