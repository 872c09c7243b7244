"""The sidecar's `/readyz` answers from vLLM's last answer, asked on a thread of its own
(`sidecar_readiness.WorkerCheck`): a vLLM whose `/collective_rpc` hangs never holds a probe
(not ready once the answer is older than REFIT_WORKER_CHECK_MAX_AGE_S, ready again once vLLM
answers), and a worker that reports incomplete weights (vLLM's sleep at level 2) makes it
not ready and drops the sidecar's version to the one the workers hold. The start reads the
workers' status too, while it waits for them to register: a failed engine ends it at once,
and a vLLM that stops answering cannot hold it past its registration deadline.

vLLM is a stand-in HTTP server with the dev-mode routes the sidecar calls here (`/health`,
`/init_weight_transfer_engine`, `/collective_rpc`), because a real vLLM cannot be made to
hang on demand; the sidecar, its HTTP control, the coordinator and the registrations are
real. The sidecar against a real vLLM: tests/integration/reliability/test_vllm_sidecar_policy.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from refitplane.errors import FailedPrecondition, Unavailable
from refitplane.protocol import Role
from refitplane.testing.child_processes import free_port
from tests.integration.conftest import row_layout, wait_until
from tests.support.controllers import failed_start

pytestmark = pytest.mark.integration


class _VllmStandIn:
    """vLLM's dev-mode routes the sidecar calls outside refits; `/collective_rpc` answers
    `statuses` (every worker's engine status), or hangs while `answering` is clear (from
    `/init_weight_transfer_engine` on, with `hang_from_init`)."""

    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.answering = threading.Event()
        self.answering.set()
        self.hang_from_init = False
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._json(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/collective_rpc":
                    stand_in.answering.wait(timeout=120)
                    self._json(200, {"results": stand_in.statuses})
                elif self.path == "/init_weight_transfer_engine":
                    if stand_in.hang_from_init:
                        stand_in.answering.clear()
                    self._json(200, {})
                else:
                    self._json(404, {})

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.answering.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def vllm() -> Iterator[_VllmStandIn]:
    stand_in = _VllmStandIn()
    yield stand_in
    stand_in.close()


def _readyz(url: str) -> tuple[int, dict[str, Any]]:
    # A probe that waited for vLLM would run into this timeout (its RPC allows 30 s).
    response = httpx.get(url, timeout=10)
    return response.status_code, response.json()


def _sidecar(coordinator: Any, vllm: _VllmStandIn, **settings: Any) -> Any:
    """A sidecar of replica "a" of job "job" in front of the stand-in vLLM."""
    from refitplane.generator.sidecar import Sidecar, SidecarSettings

    return Sidecar(
        SidecarSettings(
            coordinator=coordinator.grpc_target,
            job="job",
            replica_id="a",
            vllm_url=vllm.url,
            sidecar_host="127.0.0.1",
            **settings,
        )
    )


def test_readyz_answers_from_the_last_worker_answer(coordinator, sim_cluster, vllm) -> None:
    cluster = sim_cluster(coordinator)
    cluster.add(Role.GENERATOR, replica="a", layout=row_layout(0, 1))
    # A sidecar restarted next to a vLLM whose worker holds version 3.
    vllm.statuses = [{"rank": 0, "version": 3, "incomplete": False}]
    port = free_port()
    sidecar = _sidecar(
        coordinator,
        vllm,
        sidecar_port=port,
        worker_check_interval_s=0.2,
        worker_check_max_age_s=2.0,
    )
    readyz = f"http://127.0.0.1:{port}/readyz"
    try:
        sidecar.start()
        assert _readyz(readyz)[0] == 200
        assert sidecar.member.state.version == 3

        # vLLM stops answering: every probe is still answered, first from the last answer,
        # then not ready once that answer is too old, or once the ask (bounded by that age)
        # timed out; and not ready for as long as vLLM does not answer: a timed-out ask is
        # no "cannot be asked" (a vLLM without dev mode), which would read ready.
        vllm.answering.clear()
        wait_until(lambda: _readyz(readyz)[0] == 503, timeout_s=30, what="/readyz 503")
        not_answering = ("last answered", f"vLLM at {vllm.url} did not answer /collective_rpc")
        for _ in range(25):  # 5 s: two asks' timeouts and more
            status, body = _readyz(readyz)
            assert status == 503, body
            assert any(why in body["message"] for why in not_answering), body
            time.sleep(0.2)
        vllm.answering.set()
        wait_until(lambda: _readyz(readyz)[0] == 200, timeout_s=30, what="/readyz 200 again")

        # vLLM's sleep at level 2 (the RL loop's verb): the worker holds no version.
        vllm.statuses = [{"rank": 0, "version": 0, "incomplete": True}]
        wait_until(lambda: _readyz(readyz)[0] == 503, timeout_s=30, what="/readyz 503 (lost)")
        status, body = _readyz(readyz)
        assert status == 503, body
        assert "incomplete weights" in body["message"], body
        assert sidecar.member.state.version == 0
        assert body["version"] == 0
    finally:
        vllm.answering.set()
        sidecar.close()


def test_a_status_ask_vllm_does_not_answer_in_time_is_unavailable(vllm) -> None:
    """Not None ("no status channel", which reads as ready): the ask that timed out names
    vLLM, the route and the bound."""
    from refitplane.generator.vllm_http_control import VllmControl

    vllm.answering.clear()
    control = VllmControl(vllm.url)
    try:
        with pytest.raises(Unavailable) as caught:
            control.engine_status(timeout_s=0.5)
    finally:
        control.close()
    assert caught.value.message == (
        f"vLLM at {vllm.url} did not answer /collective_rpc (its workers' engine status) "
        "within 0.5 s"
    )


def test_a_worker_engine_that_failed_to_start_fails_the_start_at_once(coordinator, vllm) -> None:
    """vLLM 0.26 (no API guard) answers /init_weight_transfer_engine 200 even when a worker's
    refitplane engine failed its start-up check: the sidecar reads the workers' status while
    it waits for them to register and fails with their reason at once, not at its deadline
    (the real vLLM 0.32 path, where the guard answers 500:
    tests/integration/reliability/test_vllm_sidecar_policy.py)."""
    reason = "tensor 'model.layers.0.mlp.gate.weight_scale_inv': no fast path"
    vllm.statuses = [
        {"rank": 0, "initialized": True, "error": ""},
        {"rank": 1, "initialized": False, "error": reason},
    ]
    sidecar = _sidecar(coordinator, vllm, sidecar_port=free_port(), register_timeout_s=120.0)
    error, waited = failed_start(sidecar, FailedPrecondition)
    assert error.message == f"vLLM worker rank 1 could not start the refitplane engine: {reason}"
    assert waited < 30


def test_a_vllm_that_stops_answering_ends_the_start_at_the_registration_deadline(
    coordinator, vllm
) -> None:
    """vLLM answers /init_weight_transfer_engine, then never answers again; its workers never
    register. Each ask for their status while the sidecar waits is bounded by the time left,
    so the start fails at REFIT_REGISTER_TIMEOUT_S (here 3 s), not up to one ask's own 30 s
    later, naming what it waited for and that vLLM did not answer."""
    vllm.hang_from_init = True
    sidecar = _sidecar(coordinator, vllm, sidecar_port=free_port(), register_timeout_s=3.0)
    error, waited = failed_start(sidecar, Unavailable)
    # Unbounded, the first ask (0.5 s in) alone ends 30 s later; the margin is for a busy
    # machine.
    assert waited < 20, waited
    message = error.message
    assert "did not register with the coordinator as replica 'a' of job 'job' within 3 s" in (
        message
    ), message
    assert f"Nor did vLLM at {vllm.url} answer when last asked for its workers' status" in (
        message
    ), message
