"""The REST edge over a real uvicorn server: endpoints, error bodies, auth, health, metrics."""

from __future__ import annotations

import httpx
import pytest

from refitplane.protocol import RefitState

pytestmark = pytest.mark.integration

TOKEN = "rest-token"


def _cluster(sim_cluster, coord, **kw):
    cluster = sim_cluster(coord, **kw)
    cluster.trainers(world=1)
    cluster.replica("a", sidecar=True)
    return cluster


def test_trigger_get_list_cancel_topology(coordinator, sim_cluster):
    _cluster(sim_cluster, coordinator)
    with httpx.Client(base_url=coordinator.http_url, timeout=10) as http:
        resp = http.post("/v1/jobs/job/refits", json={"idempotency_key": "k1"})
        assert resp.status_code == 202
        refit = resp.json()
        assert refit["state"] == "PENDING"
        assert refit["version"] == 1
        again = http.post("/v1/jobs/job/refits", json={"idempotency_key": "k1"}).json()
        assert again["refit_id"] == refit["refit_id"]
        # No body at all is a plain "next version" trigger.
        assert http.post("/v1/jobs/job/refits").status_code == 202

        client = sim_cluster(coordinator).client()
        client.wait(refit["refit_id"], timeout_s=15)
        got = http.get(f"/v1/refits/{refit['refit_id']}").json()
        assert got["state"] == "COMMITTED"
        assert [t["phase"] for t in got["timings"]][-1] == "VERIFYING"
        listed = http.get("/v1/jobs/job/refits", params={"limit": 1}).json()["refits"]
        assert len(listed) == 1
        assert listed[0]["version"] == 2
        topo = http.get("/v1/jobs/job/topology").json()
        assert topo["committed_version"] >= 1
        assert {m["role"] for m in topo["members"]} == {"TRAINER", "GENERATOR", "GENERATOR_SIDECAR"}

        done = client.wait(listed[0]["refit_id"], timeout_s=15)
        assert done.state is RefitState.COMMITTED
        resp = http.post(f"/v1/refits/{listed[0]['refit_id']}/cancel")
        assert resp.status_code == 409
        assert resp.json()["error"]["reason"] == "FAILED_PRECONDITION"


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "reason", "field"),
    [
        ("get", "/v1/refits/nope", None, 404, "NOT_FOUND", "refit_id"),
        ("get", "/v1/jobs/nope/topology", None, 404, "NOT_FOUND", "job"),
        ("post", "/v1/jobs/nope/refits", {}, 404, "NOT_FOUND", "job"),
        ("post", "/v1/jobs/job/refits", {"version": -1}, 400, "INVALID_ARGUMENT", "version"),
        ("post", "/v1/jobs/job/refits", {"bogus": 1}, 400, "INVALID_ARGUMENT", "bogus"),
        (
            "post",
            "/v1/jobs/job/refits",
            {"target_replicas": ["bad name"]},
            400,
            "INVALID_ARGUMENT",
            "target_replicas.0",
        ),
        ("get", "/v1/jobs/job/refits?limit=0", None, 400, "INVALID_ARGUMENT", "limit"),
        ("get", "/v1/jobs/bad%20job/refits", None, 400, "INVALID_ARGUMENT", "job"),
    ],
)
def test_errors_name_reason_and_field(
    coordinator, sim_cluster, method, path, body, status, reason, field
):
    _cluster(sim_cluster, coordinator)
    with httpx.Client(base_url=coordinator.http_url, timeout=10) as http:
        resp = http.request(method.upper(), path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["reason"] == reason
    assert error["field"] == field


def test_stale_version_is_409(coordinator, sim_cluster):
    _cluster(sim_cluster, coordinator)
    with httpx.Client(base_url=coordinator.http_url, timeout=10) as http:
        assert http.post("/v1/jobs/job/refits", json={"version": 5}).status_code == 202
        resp = http.post("/v1/jobs/job/refits", json={"version": 5})
    assert resp.status_code == 409
    assert resp.json()["error"]["field"] == "version"


def test_auth_on_mutating_rest_calls(coordinator_factory, sim_cluster, tmp_path):
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    # The mounted secret file wins over the variable.
    coord = coordinator_factory(auth_token="ignored", auth_token_file=str(secret))
    _cluster(sim_cluster, coord, token=TOKEN)
    with httpx.Client(base_url=coord.http_url, timeout=10) as http:
        for headers in [{}, {"Authorization": "Bearer nope"}, {"Authorization": "ignored"}]:
            resp = http.post("/v1/jobs/job/refits", headers=headers)
            assert resp.status_code == 401
            assert resp.headers["www-authenticate"] == "Bearer"
            assert resp.json()["error"]["reason"] == "UNAUTHENTICATED"
            assert TOKEN not in resp.text
        ok = http.post("/v1/jobs/job/refits", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 202
        # Reads need no token.
        assert http.get(f"/v1/refits/{ok.json()['refit_id']}").status_code == 200
        cancel = http.post(f"/v1/refits/{ok.json()['refit_id']}/cancel")
        assert cancel.status_code == 401
        schema = http.get("/openapi.json").json()
        assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_health_ready_metrics(redis_factory, coordinator_factory, sim_cluster):
    redis = redis_factory()
    coord = coordinator_factory(redis.url)
    cluster = _cluster(sim_cluster, coord)
    client = cluster.client()
    client.wait(client.trigger("job").refit_id, timeout_s=15)
    with httpx.Client(base_url=coord.http_url, timeout=10) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").json() == {"status": "ready"}
        metrics = http.get("/metrics").text
        assert 'refit_refits_total{outcome="COMMITTED",refit_job="job"} 1.0' in metrics
        assert 'refit_phase_duration_seconds_count{phase="TRANSFERRING"} 1.0' in metrics
        assert 'refit_members{state="READY"} 3.0' in metrics
        assert "refit_bytes_total" in metrics
        assert "refit_throughput_bytes_per_second_count 1.0" in metrics
        assert 'refit_triggers_total{outcome="CREATED"} 1.0' in metrics
        redis.stop()
        ready = http.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["error"]["reason"] == "UNAVAILABLE"
        assert str(redis.port) not in ready.text  # no connection details leak
        assert http.get("/healthz").status_code == 200
