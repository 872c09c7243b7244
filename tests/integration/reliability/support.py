"""What the reliability tests check after every fault, on a `ProcCluster` of real processes.

`World` keeps the job's version counter (every trigger uses a fresh explicit version) and
checks the promises of issue 7:

* `check_holds(v)` — after a commit: every generator rank is ready, reports version v and
  holds its share of v byte for byte; `/serve` (what a generation reads, under the engine's
  serving lock) returns exactly those bytes; the coordinator shows every replica at v.
* `policies(refit)` — after a failure: each generator rank either kept its previous
  weights intact (ready, old version, exactly the old bytes), or completed and verified its
  own share of the new version (ready, new version, exactly the new bytes), or is not ready
  (it refuses to serve, and reports its old version); never a ready rank with bytes of two
  versions, never a replica whose ready ranks disagree, never the coordinator showing a
  replica at the failed version.
* `check_released(refit)` — every surviving rank's agent thread returned: its transfer
  outcome is recorded, trainers take a training step at once (the weights guard is free),
  generators answer `/serve` at once (200 or 409, never a timeout).
* `transports()` / `check_rebuilt(before)` — after the recovery refit every rank that
  lived through the failure built exactly one new communicator set and holds only that
  one: the failed epoch's was aborted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from refitplane.protocol import MemberState, RefitState
from refitplane.protocol.models import Refit
from refitplane.testing.cluster.proc_cluster import ProcCluster
from refitplane.testing.cluster.processes import AgentProc, wait_for
from refitplane.testing.cluster.synthetic_state import expected_digests

INTACT = "intact"
COMPLETE = "complete"
NOT_READY = "not-ready"

# A released agent answers its control API at once; this is generous for a loaded CI VM.
RELEASE_S = 5.0


def note(test: str, **facts: Any) -> None:
    """One line per fault test with what it measured (`pytest -s` shows them; RELIABILITY.md
    quotes them)."""
    shown = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in facts.items()
    )
    print(f"[reliability] {test}: {shown}")


@dataclass
class World:
    cluster: ProcCluster
    version: int = 0
    committed: int = 0
    # What the trainers currently hold (the weights a refit moves).
    trainer_weights: int = 0
    # Version label → the trainer weights (version) a refit to it moved.
    weights_of: dict[int, int] = field(default_factory=dict)
    _digests: dict[tuple[int, int, int], dict[str, str]] = field(default_factory=dict)

    # -- versions and expected bytes ----------------------------------------------------------

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def step(self, version: int) -> None:
        self.cluster.step_trainers(version)
        self.trainer_weights = version

    def expected(self, status: dict[str, Any], version: int) -> dict[str, str]:
        key = (version, status["rank"], status["world"])
        if key not in self._digests:
            self._digests[key] = expected_digests(
                version, status["rank"], status["world"], scale=status["scale"]
            )
        return self._digests[key]

    # -- refits ---------------------------------------------------------------------------------

    def commit(self) -> Refit:
        """Step the trainers to a new version, refit to it, check every generator holds it."""
        version = self.next_version()
        self.step(version)
        final = self.cluster.wait(self.trigger(version).refit_id, timeout_s=60)
        assert final.state is RefitState.COMMITTED, (final.reason, final.message)
        self.check_holds(version)
        return final

    def check_holds(self, version: int, *, weights: int | None = None) -> None:
        """Every generator serves `version`, whose bytes are the trainers' `weights`."""
        weights = version if weights is None else weights
        self.weights_of[version] = weights
        for agent in self.cluster.generators:
            status = agent.status()
            assert status["ready"], f"{agent.name} is not ready after a commit"
            assert status["version"] == version, (agent.name, status["version"])
            want = self.expected(status, weights)
            assert status["digests"] == want, f"{agent.name} does not hold version {weights}"
            served = agent.serve()
            assert served.status_code == 200, (agent.name, served.text)
            assert served.json()["digests"] == want, f"{agent.name} serves other bytes"
        topo = self.cluster.topology()
        for replica in topo.replicas:
            assert replica.version == version, (replica.replica_id, replica.version)
            assert replica.state is MemberState.READY, (replica.replica_id, replica.state)
        self.committed = version

    # -- after a failure --------------------------------------------------------------------------

    def live_agents(self) -> list[AgentProc]:
        return [a for a in self.cluster.agents.values() if a.alive()]

    def trigger(self, version: int, **kwargs: Any) -> Refit:
        """Trigger a refit to `version` of what the trainers hold now."""
        self.weights_of[version] = self.trainer_weights
        return self.cluster.trigger(version, **kwargs)

    def held(self, status: dict[str, Any]) -> dict[str, str]:
        """The digests of the version a generator rank reports."""
        version = status["version"]
        return self.expected(status, self.weights_of.get(version, version))

    def policies(self, refit: Refit) -> dict[str, str]:
        """Which promise each live generator rank kept after `refit` failed (see module)."""
        out: dict[str, str] = {}
        versions: dict[str, set[int]] = {}
        for agent in self.cluster.generators:
            if not agent.alive():
                continue
            outcome = self.cluster.wait_outcome(agent, refit.refit_id, timeout_s=30)
            status = agent.status()
            served = agent.serve()
            if not status["ready"]:
                assert outcome["weights_modified"], f"{agent.name}: not ready, weights intact?"
                assert served.status_code == 409, (agent.name, served.text)
                assert status["version"] != refit.version, agent.name
                out[agent.name] = NOT_READY
                continue
            assert served.status_code == 200, (agent.name, served.text)
            if outcome["ok"]:
                # Its own share arrived and verified: it holds the new version fully.
                assert status["version"] == refit.version, agent.name
                out[agent.name] = COMPLETE
            else:
                assert not outcome["weights_modified"], agent.name
                assert status["version"] < refit.version, agent.name
                out[agent.name] = INTACT
            want = self.held(status)
            assert status["digests"] == want, f"{agent.name} is ready with bytes of two versions"
            assert served.json()["digests"] == want, f"{agent.name} serves bytes of two versions"
            versions.setdefault(status["replica"], set()).add(status["version"])
        for replica, held in versions.items():
            assert len(held) == 1, f"ready ranks of replica {replica} hold versions {held}"
        # The coordinator never shows a replica at the failed refit's version.
        for replica in self.cluster.topology().replicas:
            assert replica.version < refit.version, replica
        return out

    def check_released(self, refit: Refit) -> None:
        """Every surviving rank is free again (no agent thread still in the refit)."""
        for agent in self.live_agents():
            started = time.monotonic()
            if agent.role == "trainer":
                response = agent.step(self.trainer_weights, timeout_s=RELEASE_S)
                assert response.status_code == 200, (agent.name, response.text)
                assert not agent.status()["guard_held"], agent.name
            else:
                response = agent.serve(timeout_s=RELEASE_S)
                assert response.status_code in (200, 409), (agent.name, response.text)
            assert time.monotonic() - started < RELEASE_S + 1, agent.name

    def transports(self) -> dict[str, tuple[int, int]]:
        """{agent: (its process start count, communicator sets it created)}."""
        return {
            a.name: (a.starts, a.status()["faults"]["transports_created"])
            for a in self.live_agents()
        }

    def check_rebuilt(self, before: dict[str, tuple[int, int]]) -> None:
        """Ranks that lived through the failure rebuilt their communicators exactly once and
        hold only the new set (the failed epoch's was aborted)."""
        for agent in self.live_agents():
            faults = agent.status()["faults"]
            assert faults["transports_open"] == 1, (agent.name, faults)
            starts, created = before.get(agent.name, (-1, -1))
            if starts == agent.starts:
                assert faults["transports_created"] == created + 1, (agent.name, faults)

    def wait_stalled(self, agent: AgentProc, timeout_s: float = 30.0) -> None:
        wait_for(
            f"{agent.name} to stall",
            lambda: agent.status()["faults"]["stalled"],
            timeout_s,
        )
