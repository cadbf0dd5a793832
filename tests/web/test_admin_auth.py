"""Who may use the operators' paths (the admin API, /metrics): the admin key only, once keys exist."""

from __future__ import annotations

import pytest

from web.app import create_app

PATHS = ["/v1/admin/workers", "/v1/admin/queues", "/v1/adapters", "/metrics"]


def client(redis_url, **settings):
    return create_app({"redis_url": redis_url, **settings}).test_client()


@pytest.mark.parametrize("path", PATHS)
def test_admin_key_only(redis_url, path):
    app = client(redis_url, api_keys="user-key", admin_key="admin-key")
    missing = app.get(path)
    assert missing.status_code == 401 and missing.get_json()["error"]["code"] == "invalid_api_key"
    user = app.get(path, headers={"Authorization": "Bearer user-key"})
    assert user.status_code == 403 and user.get_json()["error"]["code"] == "admin_only"
    assert app.get(path, headers={"Authorization": "Bearer admin-key"}).status_code == 200


@pytest.mark.parametrize("path", PATHS)
def test_closed_without_an_admin_key(redis_url, path):
    response = client(redis_url, api_keys="user-key").get(path, headers={"Authorization": "Bearer user-key"})
    assert response.status_code == 403 and response.get_json()["error"]["code"] == "admin_closed"


def test_admin_action_with_a_user_key_queues_nothing(redis_url, redis_conn):
    app = client(redis_url, api_keys="user-key", admin_key="admin-key")
    before = redis_conn.llen("rq:queue:interactive")
    response = app.post("/v1/admin/models/unload", json={"model": "smollm2-135m"},
                        headers={"Authorization": "Bearer user-key"})
    assert response.status_code == 403
    assert redis_conn.llen("rq:queue:interactive") == before


def test_open_server_opens_them(redis_url):
    app = client(redis_url)
    assert all(app.get(path).status_code == 200 for path in PATHS)
    body = app.get("/metrics").get_data(as_text=True)
    assert "mlxq_queue_depth" in body and "mlxq_http_requests_total" in body
