"""`refitctl trigger | status | list | cancel | topology` against a real coordinator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from refitplane.agent.simulated import Behaviour
from refitplane.cli.exits import EXIT_NOT_FOUND, EXIT_REJECTED, EXIT_UNAUTHENTICATED
from refitplane.cli.refit_cmds import progress_line, table
from refitplane.cli.refitctl import main
from refitplane.protocol import RefitState
from refitplane.protocol.models import Refit

pytestmark = pytest.mark.integration


@pytest.fixture
def cli_env(coordinator, sim_cluster, monkeypatch):
    for key in list(os.environ):
        if key.startswith("REFIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("REFIT_COORDINATOR", coordinator.grpc_target)
    monkeypatch.setenv("REFIT_JOB", "job")
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.replica("a", sidecar=True)
    return cluster


def test_trigger_watch_list_status_topology(cli_env, capsys):
    assert main(["trigger", "--key", "k", "--watch", "--json"]) == 0
    out, err = capsys.readouterr()
    refit = json.loads(out)
    assert refit["state"] == "COMMITTED"
    assert refit["version"] == 1
    assert "100.0%" in err
    assert "COMMITTED" in err

    assert main(["list"]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[0].split()[:3] == ["REFIT", "VERSION", "STATE"]
    assert refit["refit_id"] in out
    assert "COMMITTED" in out

    assert main(["status", refit["refit_id"]]) == 0
    out, _ = capsys.readouterr()
    assert "state     COMMITTED" in out
    assert "timings   PENDING" in out

    assert main(["topology"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("job job: committed version 1, group epoch 1, 2 ranks, GLOO, healthy")
    assert "GENERATOR_SIDECAR" in out
    assert "REPLICA" in out


def test_failed_refit_exits_nonzero_and_errors_are_reported(cli_env, capsys):
    for m in cli_env.members:
        m.agent.behaviour = Behaviour(fail={"start_transfer": ("PEER_FAILED", "boom", False)})
    assert main(["trigger", "--watch"]) == 1
    out, _ = capsys.readouterr()
    assert "reason    PEER_FAILED" in out
    assert main(["status", "no-such-refit"]) == EXIT_NOT_FOUND
    _, err = capsys.readouterr()
    assert "error (NOT_FOUND)" in err
    assert main(["trigger", "--version", "1"]) == EXIT_REJECTED
    _, err = capsys.readouterr()
    assert "FAILED_PRECONDITION" in err


def test_an_unknown_job_is_not_found_for_list_as_for_topology(cli_env, capsys):
    for command in ("list", "topology"):
        assert main([command, "--job", "nosuchjob", "--json"]) == EXIT_NOT_FOUND
        out, err = capsys.readouterr()
        assert out == ""
        doc = json.loads(err)["error"]
        assert (doc["reason"], doc["field"]) == ("NOT_FOUND", "job")
        assert "nosuchjob" in doc["message"]
    # A known job without refits yet lists nothing, successfully.
    assert main(["list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_cancel(cli_env, capsys):
    for m in cli_env.members:
        m.agent.behaviour = Behaviour(hold_transfer_s=30)
    assert main(["trigger", "--json"]) == 0
    refit = json.loads(capsys.readouterr().out)
    assert main(["cancel", refit["refit_id"]]) == 0
    assert "CANCELLED" in capsys.readouterr().out


def test_console_script(cli_env):
    exe = shutil.which("refitctl")
    assert exe is not None
    result = subprocess.run(
        [exe, "trigger", "--json"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["state"] == "PENDING"


def test_progress_line_and_table():
    refit = Refit(
        refit_id="r",
        job="j",
        version=1,
        state=RefitState.TRANSFERRING,
        bytes_total=4 << 20,
        bytes_done=1 << 20,
    )
    assert progress_line(refit).startswith("[" + "#" * 8 + "." * 22 + "]  25.0%  1.0 MiB / 4.0 MiB")
    assert table(("A", "BB"), [(1, 2), (333, 4)]).splitlines() == [
        "A    BB",
        "---  --",
        "1    2",
        "333  4",
    ]


def test_a_missing_or_wrong_token_exits_unauthenticated(coordinator_factory, monkeypatch, capsys):
    for key in list(os.environ):
        if key.startswith("REFIT_"):
            monkeypatch.delenv(key)
    coord = coordinator_factory(auth_token="right-token")
    base = ["trigger", "--job", "job", "--coordinator", coord.grpc_target, "--json"]
    for extra in ([], ["--token", "wrong-token"]):
        assert main([*base, *extra]) == EXIT_UNAUTHENTICATED
        doc = json.loads(capsys.readouterr().err)["error"]
        assert doc["reason"] == "UNAUTHENTICATED"
        assert doc["exit_code"] == EXIT_UNAUTHENTICATED
