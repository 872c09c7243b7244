"""`AgentSession`: one member's connection to the coordinator, for synchronous code
(training loops, vLLM workers).

Three daemon threads, every wait bounded:
  * lease — renews every `renew_interval` (ttl/3); a lost lease (NOT_FOUND: the coordinator
    does not know the member or its credential any more) re-registers, re-publishes the
    layout and moves the command stream to the new member id;
  * stream — holds the control lane open (`ControlLane`), else StreamCommands,
    reconnecting with backoff; AbortRefit and LeaveGroup also go to `handler.on_abort_now`
    at once, RanksVerified only there (to `handler.on_ranks_verified`);
  * worker — runs commands in order; a handler exception becomes a Failure report.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import agent_pb2_grpc
from refitplane.agent.handler import CommandHandler
from refitplane.agent.lane import ControlLane
from refitplane.agent.layout_upload import layout_requests
from refitplane.agent.report_stream import ReportStream
from refitplane.agent.report_verbs import ReportVerbs
from refitplane.errors import InvalidArgument, NotFound, RefitError, Unavailable
from refitplane.protocol import Reason, convert
from refitplane.protocol import messages as m
from refitplane.protocol.channel import (
    MEMBER_CREDENTIAL_KEY,
    Metadata,
    auth_metadata,
    from_rpc_error,
    member_metadata,
    status_code,
    sync_channel,
)
from refitplane.protocol.settings import ClientSettings
from refitplane.reshard.layout import Layout

log = logging.getLogger(__name__)

_RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_GROUP_COMMANDS = (m.CreateRendezvousCmd, m.JoinGroupCmd, m.LeaveGroupCmd)


class AgentSession(ReportVerbs):
    def __init__(
        self,
        coordinator: str,
        info: m.MemberInfo,
        handler: CommandHandler,
        *,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        timeout_s: float = 10.0,
        held_version: Callable[[], int] | None = None,
        serving: Callable[[], bool | None] | None = None,
        report_stream: bool | None = None,
        lane: bool | None = None,
        lane_target: str | None = None,
    ) -> None:
        """`coordinator`: gRPC host:port. `timeout_s` bounds every call (and, in `start`,
        how long to wait for the coordinator to answer at all). `held_version`: generators
        (and their sidecars), the version they fully hold now; every registration (a lost
        lease, a coordinator that lost its state) sends it instead of `info.version`, so
        the replica comes back at that version and the coordinator's next version goes
        above it. With `serving` (whether those weights are complete; None while an update
        is under way, when the answer is about to change), every lease renewal reports both
        (RenewLease.held): after a coordinator restart mid-refit the coordinator takes what
        the replica's ranks hold; and a registration while it is False sends 0 (no version
        fully held). `report_stream`: reports on a stream held open (None: REFIT_REPORT_STREAM,
        default on), else every one unary. `lane`: commands and reports on the coordinator's
        control lane when it has one (None: REFIT_LANE, default on), dialled at
        `lane_target` when given (None: REFIT_LANE_TARGET; empty: the gRPC target's host)."""
        self.info = info
        self._held_version = held_version
        self._serving = serving
        self._handler = handler
        self._timeout = timeout_s
        self._token = token
        self._metadata = auth_metadata(token)
        # (member id, the metadata that proves it: token and member credential), replaced
        # together on every registration so no call pairs an id with another's credential.
        self._who: tuple[str, Metadata] = ("", self._metadata)
        self._channel = sync_channel(coordinator, tls_ca=tls_ca)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        if report_stream is None or lane is None or lane_target is None:
            defaults = ClientSettings()  # REFIT_REPORT_STREAM, REFIT_LANE, REFIT_LANE_TARGET
            report_stream = defaults.report_stream if report_stream is None else report_stream
            lane = defaults.lane if lane is None else lane
            lane_target = defaults.lane_target if lane_target is None else lane_target
        self.reports = ReportStream(self._stub, timeout_s=timeout_s, enabled=report_stream)
        self.lane = ControlLane(
            coordinator,
            tls_ca=tls_ca,
            token=token,
            timeout_s=timeout_s,
            enabled=lane,
            lane_target=lane_target,
        )
        self._lock = threading.RLock()
        self._ttl = 0.0
        self._renew_interval = 1.0
        self._layout: Layout | None = None
        self._published = ""  # digest published for the current member id
        self._stop = threading.Event()
        self._reconnect = threading.Event()
        self._commands: queue.Queue[m.Command] = queue.Queue()
        self._call: Any = None
        self._threads: list[threading.Thread] = []
        self.registrations = 0
        self._grpc_streams = 0
        self.commands_received = 0

    @classmethod
    def from_env(
        cls,
        info: m.MemberInfo,
        handler: CommandHandler,
        *,
        settings: ClientSettings | None = None,
        timeout_s: float = 10.0,
    ) -> AgentSession:
        """Coordinator, token and CA from REFIT_COORDINATOR, REFIT_AUTH_TOKEN(_FILE) and
        REFIT_TLS_CA_FILE (what the Helm chart sets in agent pods)."""
        s = settings or ClientSettings()
        return cls(
            s.coordinator,
            info,
            handler,
            token=s.token(),
            tls_ca=s.tls_ca_file,
            timeout_s=timeout_s,
            report_stream=s.report_stream,
            lane=s.lane,
            lane_target=s.lane_target,
        )

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def member_id(self) -> str:
        return self._who[0]

    @property
    def _member_id(self) -> str:
        return self._who[0]

    @property
    def metadata(self) -> Metadata:
        """What this member's calls carry: the token and its own credential (for tools in
        the member's own process that call the coordinator as it)."""
        return self._who[1]

    @property
    def streams_opened(self) -> int:
        """Command streams opened so far (StreamCommands and lanes): a command the
        coordinator wrote to a stream that broke is lost, so a handler waiting for one reads
        instead once this moved."""
        return self._grpc_streams + self.lane.opened

    @property
    def lease_ttl_s(self) -> float:
        return self._ttl

    def start(self) -> None:
        """Register (retrying while the coordinator is unreachable, up to `timeout_s`) and
        start the lease, stream and worker threads."""
        deadline = time.monotonic() + self._timeout
        delay = _BACKOFF_MIN_S
        while True:
            try:
                self._register()
                break
            except Unavailable:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(_BACKOFF_MAX_S, delay * 2)
        for name, target in (
            ("lease", self._lease_loop),
            ("stream", self._stream_loop),
            ("worker", self._worker_loop),
        ):
            t = threading.Thread(target=target, name=f"refit-agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, *, deregister: bool = True) -> None:
        """Stop the threads and (by default) deregister. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._cancel_stream()
        self.reports.close()
        self.lane.shutdown()
        for t in self._threads:
            t.join(timeout=self._timeout)
        if deregister and self._member_id:
            try:
                member_id, metadata = self._who
                self._stub.Deregister(
                    apb.DeregisterRequest(member_id=member_id),
                    timeout=self._timeout,
                    metadata=metadata,
                )
            except grpc.RpcError as exc:
                log.debug("deregister failed: %s", status_code(exc))
        self._channel.close()

    def __enter__(self) -> AgentSession:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- calls ---------------------------------------------------------------------------

    def _call_unary(self, method: str, request: Any, metadata: Metadata) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _held_now(self) -> int:
        """The version to register with: the one fully held, or 0 (none) when the weights
        are incomplete (a failed receive overwrote some): never one the rank does not hold."""
        assert self._held_version is not None
        if self._serving is not None and self._serving() is False:
            return 0
        return self._held_version()

    def _register(self) -> None:
        with self._lock:
            info = self.info
            if self._held_version is not None:
                info = dataclasses.replace(info, version=self._held_now())
            resp = self._call_unary("Register", convert.register_to_proto(info), self._metadata)
            self._who = (
                str(resp.member_id),
                member_metadata(self._token, str(resp.member_credential)),
            )
            self._ttl = resp.lease_ttl_s
            self.lane.port = int(resp.lane_port)
            self._renew_interval = max(0.01, resp.renew_interval_s)
            self._published = ""
            self.registrations += 1
            log.info("registered as member %s (ttl %.1f s)", self._member_id, self._ttl)
            if self._layout is not None:
                self._publish(self._layout)
        self._reconnect.set()
        self._cancel_stream()

    def _reregister(self, stale_id: str) -> None:
        """The coordinator no longer knows `stale_id`: register again (once per stale id)."""
        with self._lock:
            if self._member_id != stale_id or self._stop.is_set():
                return
            log.warning("member %s is not known any more: registering again", stale_id)
            self._register()

    def publish_layout(self, layout: Layout) -> str:
        """Publish what this rank holds (trainer) or needs (generator); returns the digest.
        A no-op when the same layout was already published for this registration."""
        ranks = layout.ranks()
        if ranks and ranks != [self.info.rank]:
            raise InvalidArgument(
                f"the layout lists rank(s) {ranks[:8]}, but this member is rank {self.info.rank}",
                field="layout",
            )
        with self._lock:
            self._layout = layout
            if self._published == layout.digest:
                return layout.digest
            return self._publish(layout)

    def _publish(self, layout: Layout) -> str:
        member_id, metadata = self._who
        try:
            for request in layout_requests(member_id, layout, self.info.rank):
                resp = self._call_unary("PublishLayout", request, metadata)
        except NotFound:
            self._reregister(member_id)
            return self._published
        self._published = resp.layout_digest
        return str(resp.layout_digest)

    # --- reports -------------------------------------------------------------------------

    def _report(self, refit_id: str, body: m.ReportBody) -> bool:
        """Send a report (on the open report stream, else unary), retrying transient errors
        within `timeout_s`. Returns whether the coordinator accepted it (False: the refit or
        epoch is no longer current)."""
        deadline = time.monotonic() + self._timeout
        delay = _BACKOFF_MIN_S
        while True:
            member_id, metadata = self._who
            request = convert.report_to_proto(m.Report(member_id, refit_id, body))
            try:
                accepted = self.lane.send(member_id, request)
                if accepted is None:
                    accepted = self.reports.send(member_id, metadata, request)
                if accepted is None:
                    accepted = bool(self._call_unary("Report", request, metadata).accepted)
                return accepted
            except NotFound:
                self._reregister(member_id)
                return False
            except Unavailable:
                if time.monotonic() + delay > deadline or self._stop.is_set():
                    raise
                time.sleep(delay)
                delay = min(_BACKOFF_MAX_S, delay * 2)

    # --- threads -------------------------------------------------------------------------

    def _lease_loop(self) -> None:
        while not self._stop.wait(self._renew_interval):
            member_id, metadata = self._who
            request = apb.RenewLeaseRequest(member_id=member_id)
            serving = self._serving() if self._serving is not None else None
            if self._held_version is not None and serving is not None:
                request.held.version = self._held_version()
                request.held.serving = serving
            try:
                self._call_unary("RenewLease", request, metadata)
            except NotFound:
                self._safe(self._reregister, member_id)
            except RefitError as exc:
                log.warning("lease renewal failed: %s", exc.message)

    def _safe(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except RefitError as exc:
            log.warning("%s failed: %s", getattr(fn, "__name__", fn), exc.message)

    def _cancel_stream(self) -> None:
        self.lane.close()
        call = self._call
        if call is not None:
            call.cancel()

    def _decode_and_dispatch(self, raw: apb.Command) -> None:
        self.commands_received += 1
        try:
            command = convert.command_from_proto(raw)
        except RefitError as exc:
            # A command this agent does not know (a newer coordinator's) or a malformed one:
            # reopening the stream would not bring it back.
            log.error("skipped undecodable command %d: %s", raw.seq, exc.message)
            return
        self._dispatch(command)

    def _credential(self, metadata: Metadata) -> str:
        return dict(metadata).get(MEMBER_CREDENTIAL_KEY, "")

    def _hold_lane(self, member_id: str, metadata: Metadata) -> bool:
        """Hold the control lane open until it closes; False when it could not be opened
        (gRPC's stream then carries the commands)."""
        if not self.lane.open(member_id, self._credential(metadata), self._decode_and_dispatch):
            return False
        while not self.lane.closed.wait(1.0):
            if self._stop.is_set():
                self.lane.close()
        if isinstance(self.lane.refusal, NotFound):
            self._safe(self._reregister, member_id)
        return True

    def _stream_loop(self) -> None:
        delay = _BACKOFF_MIN_S
        while not self._stop.is_set():
            self._reconnect.clear()
            member_id, metadata = self._who
            received = self.commands_received
            lane = self.lane.usable() or self.lane.is_open(member_id)
            if lane and self._hold_lane(member_id, metadata):
                if self._member_id != member_id or self._reconnect.is_set():
                    continue  # a new registration: open the lane as the new member
                if self.commands_received > received:
                    delay = _BACKOFF_MIN_S  # it worked a while: reconnect at once
                if self._stop.wait(delay):
                    return
                delay = min(_BACKOFF_MAX_S, delay * 2)
                continue
            try:
                call = self._stub.StreamCommands(
                    apb.StreamCommandsRequest(member_id=member_id), metadata=metadata
                )
                self._call = call
                self._grpc_streams += 1
                if self.lane.offered:  # back to the lane when it opens
                    threading.Thread(
                        target=self.lane.reopen_while,
                        args=(member_id, self._credential(metadata), self._decode_and_dispatch),
                        kwargs={
                            "carrying": lambda call=call: self._call is call,
                            "stop": self._stop,
                        },
                        name="refit-agent-lane-probe",
                        daemon=True,
                    ).start()
                for raw in call:
                    delay = _BACKOFF_MIN_S
                    self._decode_and_dispatch(raw)
            except grpc.RpcError as exc:
                code = status_code(exc)
                if code == grpc.StatusCode.NOT_FOUND:
                    self._safe(self._reregister, member_id)
                    if self._member_id != member_id:
                        continue
                if code == grpc.StatusCode.CANCELLED and (
                    self._stop.is_set() or self._reconnect.is_set()
                ):
                    continue
                if code not in _RETRYABLE:
                    log.warning("command stream failed: %s", from_rpc_error(exc).message)
            finally:
                self._call = None
            # The server ended the stream (coordinator restarting) or it broke: back off.
            if self._stop.wait(delay):
                return
            delay = min(_BACKOFF_MAX_S, delay * 2)

    def _dispatch(self, command: m.Command) -> None:
        body = command.body
        if isinstance(body, m.RanksVerifiedCmd):
            try:
                self._handler.on_ranks_verified(body)
            except Exception:
                log.exception("on_ranks_verified failed")
            return  # nothing to run in order: the handler waiting for it is running
        if isinstance(body, m.AbortRefitCmd | m.LeaveGroupCmd):
            try:
                self._handler.on_abort_now(body)
            except Exception:
                log.exception("on_abort_now failed")
        self._commands.put(command)

    def _worker_loop(self) -> None:
        while not self._stop.is_set():
            try:
                command = self._commands.get(timeout=0.2)
            except queue.Empty:
                continue
            body = command.body
            try:
                self._run(body)
            except Exception as exc:
                log.exception("command %s failed", type(body).__name__)
                self._report_exception(body, exc)

    def _run(self, body: m.CommandBody) -> None:
        h = self._handler
        match body:
            case m.CreateRendezvousCmd():
                h.on_create_rendezvous(body)
            case m.JoinGroupCmd():
                h.on_join_group(body)
            case m.LeaveGroupCmd():
                h.on_leave_group(body)
            case m.PrepareRefitCmd():
                h.on_prepare_refit(body)
            case m.StartTransferCmd():
                h.on_start_transfer(body)
            case m.AbortRefitCmd():
                h.on_abort_refit(body)

    def _report_exception(self, body: m.CommandBody, exc: Exception) -> None:
        reason = exc.reason if isinstance(exc, RefitError) else Reason.AGENT_ERROR
        message = exc.message if isinstance(exc, RefitError) else f"{type(exc).__name__}: {exc}"
        if isinstance(body, m.AbortRefitCmd | m.LeaveGroupCmd):
            return  # nothing to report against: the refit/epoch is already over
        refit_id = "" if isinstance(body, _GROUP_COMMANDS) else getattr(body, "refit_id", "")
        epoch = getattr(body, "epoch", 0) if isinstance(body, _GROUP_COMMANDS) else 0
        try:
            self.report_failure(
                refit_id,
                reason,
                message,
                weights_modified=bool(getattr(exc, "weights_modified", False)),
                epoch=epoch,
            )
        except RefitError as report_exc:
            log.warning("could not report the failure: %s", report_exc.message)
