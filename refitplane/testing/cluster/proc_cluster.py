"""A refit deployment made of real processes, for reliability tests and the soak benchmark:
`redis-server`, the coordinator (`python -m refitplane.coordinator`) and trainer / generator
ranks (`python -m refitplane.testing.cluster.agent_procs`), each of which a test may kill (SIGKILL),
freeze (SIGSTOP), restart or stop.

    with ProcCluster(workdir, coordinator_env={"REFIT_TRANSFER_TIMEOUT_S": "8"}) as cluster:
        cluster.add_trainers(2)
        cluster.add_replica("rep-0", tp=2)
        cluster.wait_ready()
        final = cluster.refit(1)          # trainers step to version 1, trigger, wait

The processes themselves are `processes.RedisProc`, `CoordinatorProc` and `AgentProc`.
Every process runs in its own session and is always stopped (SIGTERM, then SIGKILL) when the
cluster closes; ports are chosen once, so a restarted coordinator or Redis comes back at the
same address and the agents reconnect by themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from refitplane.client import RefitClient
from refitplane.errors import Unavailable
from refitplane.protocol import RefitState
from refitplane.protocol.models import Refit, Topology
from refitplane.testing.cluster.processes import (
    AGENT_START_TIMEOUT_S,
    AgentProc,
    CoordinatorProc,
    RedisProc,
    wait_for,
)

JOB = "rel-job"

# Short timeouts keep failure tests fast; a test overrides what it exercises.
FAST_COORDINATOR_ENV: dict[str, str] = {
    "REFIT_LEASE_TTL_S": "3",
    "REFIT_PREPARE_TIMEOUT_S": "10",
    "REFIT_TRANSFER_TIMEOUT_S": "10",
    "REFIT_GROUP_TIMEOUT_S": "10",
    "REFIT_VERIFY_TIMEOUT_S": "10",
    # Small buckets: a refit of the synthetic model is many messages in several groups, so
    # a fault can land between them.
    "REFIT_BUCKET_BYTES": str(16 * 1024),
    "REFIT_MAX_INFLIGHT_BYTES": str(256 * 1024),
    "REFIT_LOG_LEVEL": "INFO",
}


class ProcCluster:
    """Redis + coordinator + agent processes of one job, all under `workdir`."""

    def __init__(
        self,
        workdir: Path,
        *,
        coordinator_env: Mapping[str, str] | None = None,
        job: str = JOB,
        redis: bool = True,
        redis_password: str = "",
        token: str = "",
        scale: int = 1,
        agent_log_level: str = "WARNING",
    ) -> None:
        self.workdir = workdir
        self.agent_log_level = agent_log_level
        self.job = job
        self.scale = scale
        self.token = token
        self.redis: RedisProc | None = (
            RedisProc(workdir, password=redis_password) if redis else None
        )
        env = dict(FAST_COORDINATOR_ENV)
        if self.redis is not None:
            env["REFIT_REDIS_URL"] = self.redis.url
            if redis_password:
                env["REFIT_REDIS_PASSWORD"] = redis_password
        self.token_file: Path | None = None
        if token:
            self.token_file = workdir / "token"
            self.token_file.write_text(token)
            env["REFIT_AUTH_TOKEN_FILE"] = str(self.token_file)
        env.update(coordinator_env or {})
        self.coordinator = CoordinatorProc(workdir, env)
        self.tls_ca = env.get("REFIT_TLS_CERT_FILE", "")
        self.agents: dict[str, AgentProc] = {}
        self.trainer_world = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> ProcCluster:
        if self.redis is not None:
            self.redis.start()
        self.coordinator.start()
        return self

    def close(self) -> None:
        for agent in self.agents.values():
            agent.terminate()  # all at once: each takes about a second to deregister
        for agent in self.agents.values():
            agent.stop(timeout_s=10)
        self.coordinator.stop()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> ProcCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- agents ---------------------------------------------------------------------------------

    def _agent_args(self, rank: int, world: int, version: int) -> list[str]:
        args = [
            "--coordinator", self.coordinator.grpc_target, "--job", self.job,
            "--rank", str(rank), "--world", str(world), "--version", str(version),
            "--scale", str(self.scale), "--log-level", self.agent_log_level,
        ]  # fmt: skip
        if self.token_file is not None:
            args += ["--token-file", str(self.token_file)]
        if self.tls_ca:
            args += ["--tls-ca", self.tls_ca]
        return args

    def add_trainers(
        self, world: int, *, version: int = 0, checkpoint: str | Path = ""
    ) -> list[AgentProc]:
        """`world` trainer ranks holding `synthetic_state(version)`, or their share of a
        Hugging Face checkpoint directory."""
        self.trainer_world = world
        out = []
        extra = ["--checkpoint", str(checkpoint)] if checkpoint else []
        for rank in range(world):
            args = [*self._agent_args(rank, world, version), *extra]
            agent = AgentProc(f"trainer-{rank}", "trainer", args, self.workdir)
            self.agents[agent.name] = agent
            agent.spawn()
            out.append(agent)
        return out

    def add_replica(self, replica: str, tp: int = 1, *, version: int = 0) -> list[AgentProc]:
        out = []
        for rank in range(tp):
            agent = AgentProc(
                f"{replica}-{rank}",
                "generator",
                [*self._agent_args(rank, tp, version), "--replica", replica],
                self.workdir,
            )
            self.agents[agent.name] = agent
            agent.spawn()
            out.append(agent)
        return out

    @property
    def trainers(self) -> list[AgentProc]:
        return [a for a in self.agents.values() if a.role == "trainer"]

    @property
    def generators(self) -> list[AgentProc]:
        return [a for a in self.agents.values() if a.role == "generator"]

    def restart_agent(
        self, name: str, *, version: int | None = None, checkpoint: str | Path | None = None
    ) -> AgentProc:
        """Start a (killed) agent again, holding `version` (trainers: the current step) or
        another checkpoint."""
        (agent,) = self.restart_agents([name], version=version, checkpoint=checkpoint)
        return agent

    def restart_agents(
        self,
        names: Sequence[str],
        *,
        version: int | None = None,
        checkpoint: str | Path | None = None,
    ) -> list[AgentProc]:
        """`restart_agent` for several agents together: all stop, then all start at once
        (each start imports torch, seconds on a busy machine: one after the other, they
        added up)."""
        agents = [self.agents[name] for name in names]
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.stop(timeout_s=5)
            for flag, value in (("--version", version), ("--checkpoint", checkpoint)):
                if value is not None:
                    i = agent.argv.index(flag)
                    agent.argv[i + 1] = str(value)
            agent.spawn()
        for agent in agents:
            agent.wait_started()
        return agents

    def wait_ready(self, timeout_s: float = AGENT_START_TIMEOUT_S) -> None:
        """Every agent started, and every live member has published its layout."""
        for agent in self.agents.values():
            if agent.alive():
                agent.wait_started(timeout_s)
        expected = {a.status()["member_id"] for a in self.agents.values() if a.alive()}

        def published() -> bool:
            topo = self.topology()
            ready = {m.member_id for m in topo.members if m.layout_digest}
            return expected <= ready

        wait_for("every member to publish its layout", published, timeout_s)

    # -- refits ---------------------------------------------------------------------------------

    def client(self, timeout_s: float = 10.0) -> RefitClient:
        return RefitClient(
            self.coordinator.grpc_target,
            token=self.token or None,
            tls_ca=self.tls_ca or None,
            timeout_s=timeout_s,
        )

    def topology(self) -> Topology:
        with self.client() as client:
            return client.topology(self.job)

    def step_trainers(self, version: int, timeout_s: float = 30.0) -> None:
        for agent in self.trainers:
            response = agent.step(version, timeout_s)
            if response.status_code != 200:
                raise Unavailable(f"{agent.name} could not step to {version}: {response.text}")

    def trigger(self, version: int, **kwargs: Any) -> Refit:
        with self.client() as client:
            return client.trigger(self.job, version=version, **kwargs)

    def wait(self, refit_id: str, timeout_s: float = 60.0) -> Refit:
        with self.client() as client:
            return client.wait(refit_id, timeout_s=timeout_s)

    def refit(self, version: int, timeout_s: float = 60.0) -> Refit:
        """A training step to `version` on every trainer, then a refit to it, to the end."""
        self.step_trainers(version)
        return self.wait(self.trigger(version).refit_id, timeout_s)

    def wait_state(self, refit_id: str, state: RefitState, timeout_s: float = 30.0) -> Refit:
        def reached() -> Refit | None:
            with self.client() as client:
                record = client.get(refit_id)
            if record.state.terminal and record.state is not state:
                raise Unavailable(f"refit ended {record.state.value} ({record.message})")
            return record if record.state is state else None

        return wait_for(f"refit {refit_id} to be {state.value}", reached, timeout_s)

    def wait_outcome(self, agent: AgentProc, refit_id: str, timeout_s: float = 30.0) -> Any:
        """Wait until `agent`'s data plane ended `refit_id` (its transfer returned)."""
        return wait_for(
            f"{agent.name} to end refit {refit_id}", lambda: agent.outcome(refit_id), timeout_s
        )
