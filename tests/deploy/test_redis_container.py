"""The bundled Redis container's start script and probes, run for real: the rendered
commands with the pod's paths moved into a temporary directory, against the local
redis-server. The password reaches Redis from the mounted file only, the probes pass with
it, and a client without it is refused."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy.chart_support import RELEASE, container, render
from tests.support.processes import run_to_end

pytestmark = pytest.mark.integration

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not (REDIS_SERVER and REDIS_CLI), reason="redis-server/redis-cli not found")
def test_start_script_and_probes_use_the_mounted_password(tmp_path: Path) -> None:
    rendered = render()
    name = f"{RELEASE}-redis"
    redis = container(rendered.one("StatefulSet", name), "redis")
    conf = rendered.one("ConfigMap", name)["data"]["redis.conf"]
    port = _free_port()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "password").write_text("s3cret-pw")
    (tmp_path / "data").mkdir()
    moves = {
        "/var/run/secrets/refit/redis": str(tmp_path / "secret"),
        "/etc/redis/redis.conf": str(tmp_path / "redis.conf"),
        "/tmp/": f"{tmp_path}/",
        "dir /data": f"dir {tmp_path / 'data'}",
        "port 6379": f"port {port}",
        "-p 6379": f"-p {port}",
        "bind * -::*": "bind 127.0.0.1",
    }

    pattern = re.compile("|".join(re.escape(k) for k in moves))

    def local(text: str) -> str:  # one pass: a moved path is never moved again
        return pattern.sub(lambda m: moves[m.group(0)], text)

    (tmp_path / "redis.conf").write_text(local(conf))
    assert redis["command"] == ["sh", "-c"]
    server = subprocess.Popen(
        ["sh", "-c", local(redis["args"][0])], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        probe = local(redis["readinessProbe"]["exec"]["command"][2])
        deadline = time.monotonic() + 20
        while run_to_end(["sh", "-c", probe], timeout_s=10).returncode != 0:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "the readiness probe never passed"
            time.sleep(0.1)
        for kind in ("startupProbe", "livenessProbe"):
            assert (
                run_to_end(["sh", "-c", local(redis[kind]["exec"]["command"][2])]).returncode == 0
            )
        anonymous = run_to_end([REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), "ping"])
        assert "NOAUTH" in anonymous.stdout + anonymous.stderr
        assert "s3cret-pw" not in str(redis["args"]) + conf
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stderr is not None:
            server.stderr.close()
