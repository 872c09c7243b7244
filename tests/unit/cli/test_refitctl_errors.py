"""refitctl's failures: one line on stderr (JSON with --json), an exit status by class
(refitplane.cli.exits), never a traceback; nonsense flags refused at parse time; an
unreachable or malformed coordinator address named with the way to set it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from refitplane.cli import exits
from refitplane.cli.demo_cmd import missing_requirements
from refitplane.cli.refitctl import main
from refitplane.testing.child_processes import free_port
from refitplane.version import __version__
from tests.support.processes import run_to_end

pytestmark = pytest.mark.unit

LAYOUTS = Path(__file__).resolve().parents[3] / "examples" / "layouts"


@pytest.fixture(autouse=True)
def _no_refit_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("REFIT_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["trigger", "--job", "j", "--version", "-5"], "--version"),
        (["list", "--job", "j", "--limit", "-1"], "--limit"),
        (["list", "--job", "j", "--timeout", "-1"], "--timeout"),
        (["status", "r", "--watch-timeout", "0"], "--watch-timeout"),
        (["plan", "--source", "a", "--target", "b", "--top", "-3"], "--top"),
        (["demo", "--steps", "0"], "--steps"),
        (["list", "--job", "j", "--timeout", "nan"], "--timeout"),
    ],
)
def test_nonsense_flags_are_usage_errors(argv, flag, capsys):
    assert main(argv) == exits.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"refitctl: error (USAGE): refitctl {argv[0]}: argument {flag}")
    assert len(err.splitlines()) == 1


def test_usage_errors_are_json_with_json(capsys):
    assert main(["list", "--job", "j", "--limit", "-1", "--json"]) == exits.EXIT_USAGE
    doc = json.loads(capsys.readouterr().err)["error"]
    assert doc["reason"] == "USAGE"
    assert doc["exit_code"] == exits.EXIT_USAGE
    assert "--limit" in doc["message"]


def test_unreachable_coordinator_names_the_address_and_the_fix(capsys):
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["list", "--job", "j", "--coordinator", target]) == exits.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert f"cannot reach the coordinator at {target}" in err
    assert "--coordinator HOST:PORT or REFIT_COORDINATOR" in err


def test_unreachable_coordinator_from_the_environment_as_json(capsys, monkeypatch):
    target = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("REFIT_COORDINATOR", target)
    assert main(["topology", "--job", "j", "--json"]) == exits.EXIT_UNAVAILABLE
    doc = json.loads(capsys.readouterr().err)["error"]
    assert doc["reason"] == "UNAVAILABLE"
    assert target in doc["message"]


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("http://coordinator:50051", "without a scheme"),
        ("coordinator", "give HOST:PORT"),
        ("coordinator:port", "is not 1..65535"),
        ("coordinator:70000", "is not 1..65535"),
        ("::1:50051", "IPv6 address in brackets"),
    ],
)
def test_malformed_address_is_a_usage_error(target, problem, capsys):
    assert main(["list", "--job", "j", "--coordinator", target]) == exits.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"malformed coordinator address {target!r}" in err
    assert problem in err


def test_missing_layout_file_is_named(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    source = str(LAYOUTS / "trainer_tp2_dp2.json")
    assert main(["plan", "--source", source, "--target", str(missing)]) == exits.EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"refitctl: error (INVALID_ARGUMENT): cannot read --target {missing}: " + (
        "No such file or directory\n"
    )


def test_demo_names_what_to_install_when_something_is_missing(capsys, monkeypatch):
    # An environment without torch: the import system finds no such module.
    monkeypatch.setitem(sys.modules, "torch", None)
    assert any(m.startswith("torch (") for m in missing_requirements())
    assert main(["demo"]) == exits.EXIT_REJECTED
    err = capsys.readouterr().err
    assert "refitctl demo needs torch" in err
    assert "pip install 'refit-plane[agents]'" in err
    assert "Traceback" not in err


def test_version_and_the_console_script():
    result = run_to_end(["refitctl", "--version"])
    assert result.returncode == 0
    assert result.stdout.strip() == f"refitctl {__version__}"
    result = run_to_end(["refitctl", "list", "--job", "j", "--limit", "-1", "--json"])
    assert result.returncode == exits.EXIT_USAGE
    assert result.stdout == ""
    assert json.loads(result.stderr)["error"]["reason"] == "USAGE"


def test_exit_codes_by_class():
    from refitplane import errors

    cases = {
        errors.LayoutError("x"): exits.EXIT_USAGE,
        errors.NotFound("x"): exits.EXIT_NOT_FOUND,
        errors.Unavailable("x"): exits.EXIT_UNAVAILABLE,
        errors.Unauthenticated("x"): exits.EXIT_UNAUTHENTICATED,
        errors.RateLimited("x"): exits.EXIT_REJECTED,
        errors.PeerFailure("x"): exits.EXIT_REFIT_FAILED,
        errors.RefitError("x"): exits.EXIT_INTERNAL,
    }
    assert {type(e).__name__: exits.exit_code(e) for e in cases} == {
        type(e).__name__: code for e, code in cases.items()
    }
    assert len(set(cases.values())) == len(cases)
