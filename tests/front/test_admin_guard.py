"""Both fronts' admin API (`GET`/`PATCH /admin/config`): it needs exactly one `Authorization: Bearer <token>`
header with the right token (401 without it, 400 for two of them, on every admin route), and a bad patch of
the cap is a 400 that names the problem and changes nothing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.front.fronts import ADMIN_TOKEN, AUTH, Front

BEARER = f"Bearer {ADMIN_TOKEN}"


def test_the_admin_api_needs_the_token(front: Front, client: httpx.Client) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        for response in (
            client.get("/admin/config", headers=headers),
            client.patch("/admin/config", json={"max_tokens_cap": 1}, headers=headers),
        ):
            assert response.status_code == 401, response.text
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["type"] == "authentication_error"
    assert client.get("/admin/config", headers=AUTH).json() == front.config(None, "clamp")


@pytest.mark.parametrize("second", [BEARER, "Bearer wrong"], ids=["same-twice", "right-then-wrong"])
def test_two_authorization_headers_are_refused_on_every_admin_route(
    front: Front, client: httpx.Client, second: str
) -> None:
    doubled = [("Authorization", BEARER), ("Authorization", second)]
    for response in (
        client.get("/admin/config", headers=doubled),
        client.patch("/admin/config", json={"max_tokens_cap": 5}, headers=doubled),
    ):
        assert response.status_code == 400, response.text
        assert "2 Authorization headers" in response.json()["error"]["message"]
    assert client.get("/admin/config", headers=AUTH).json() == front.config(None, "clamp")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"max_tokens_cap": 0}, "greater than or equal to 1"),
        ({"max_tokens_cap": "10"}, "valid integer"),
        ({"max_tokens_cap": "none"}, "valid integer"),
        ({"cap_mode": "truncate"}, "'clamp' or 'reject'"),
        ({"cap_mode": "drop"}, "'clamp' or 'reject'"),
        ({"cap_mode": 1}, "'clamp' or 'reject'"),
        ({"cap_mode": None}, "cap_mode cannot be null"),
        ({"max_batch": 4}, "Extra inputs are not permitted"),
        ([1], "valid dictionary"),
    ],
)
def test_a_bad_patch_is_refused_and_changes_nothing(
    front: Front, client: httpx.Client, patch: Any, message: str
) -> None:
    assert client.patch("/admin/config", json={"max_tokens_cap": 7}, headers=AUTH).status_code == 200
    response = client.patch("/admin/config", json=patch, headers=AUTH)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert client.get("/admin/config", headers=AUTH).json() == front.config(7, "clamp")
