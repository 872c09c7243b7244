"""torch.distributed Gloo transport (CPU): CI, laptops, CPU-only generators.

Rendezvous is a TCPStore that group rank 0 hosts; its address `host:port` is the blob the
coordinator relays to the other ranks. Each channel is its own ProcessGroupGloo over a
prefixed view of that store. Gloo sends do not block on the receiver, and messages between
a pair of ranks match in posting order.

Gloo closes the connection to a peer whenever a wait on it times out ("Application timeout
caused pair closure"), so a wait is never polled with short timeouts: it waits once, up to
the deadline, on a helper thread while the caller watches the cancel event. The same
behaviour is what `abort` uses to cut every operation still in flight: received bytes land
in the destination buffers as they arrive, so an abort must guarantee none land later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from refitplane.errors import InvalidArgument, PeerFailure, TransferError, TransferTimeout
from refitplane.reshard.transport.base import Handle, P2POp, Transport

# How often a cancellable wait looks at the cancel event.
_POLL_S = 0.05
# A wait this short on a pending operation makes Gloo close its connection (see above).
_CUT = timedelta(milliseconds=1)


def create_gloo_rendezvous(host: str, world_size: int, timeout_s: float) -> tuple[TCPStore, bytes]:
    """Host the store for a new group (on group rank 0); returns it and the blob to relay."""
    store = TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, f"{host}:{store.port}".encode()


def parse_rendezvous(blob: bytes) -> tuple[str, int]:
    text = blob.decode(errors="replace")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(
            f"Gloo rendezvous must be b'host:port', got {text!r}", field="rendezvous"
        )
    return host, int(port)


class GlooTransport(Transport):
    device_ordered = False

    def __init__(
        self,
        rank: int,
        world_size: int,
        rendezvous: bytes,
        *,
        num_channels: int = 1,
        timeout_s: float = 120.0,
        local_host: str = "127.0.0.1",
        store: TCPStore | None = None,
        prefix: str = "refit",
    ) -> None:
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} outside group of {world_size}", field="group_rank")
        host, port = parse_rendezvous(rendezvous)
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.num_channels = num_channels
        self.timeout_s = timeout_s
        self.device = torch.device("cpu")
        # The stubs lack Gloo's send/recv, hence Any.
        self._groups: list[Any] = []
        for c in range(num_channels):
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
            sub = PrefixStore(f"{prefix}/ch{c}", store)
            self._groups.append(ProcessGroupGloo(sub, rank, world_size, opts))
        self._aborted = False
        # Posted operations not yet waited for (what `abort` must cut).
        self._pending: set[Any] = set()
        self._pending_lock = threading.Lock()

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        if self._aborted:
            raise TransferError("transport was aborted; a new group is needed")
        pg = self._groups[channel]
        works = []
        try:
            for op in ops:
                if op.send:
                    works.append(pg.send([op.buffer], op.peer, 0))
                else:
                    works.append(pg.recv([op.buffer], op.peer, 0))
        except RuntimeError as exc:
            raise PeerFailure(
                f"rank {self.rank}: posting on channel {channel} failed: {exc}"
            ) from exc
        finally:
            with self._pending_lock:
                self._pending.update(works)
        return Handle(channel, works)

    def poll(self, handle: Handle) -> bool:
        return all(work.is_completed() for work in handle.payload)

    def wait(self, handle: Handle, deadline: float, cancel: threading.Event | None = None) -> None:
        if cancel is None:
            self._wait_works(handle, deadline)
            return
        # Wait on a helper thread (see the module docstring); a cancel returns at once and
        # the caller's abort ends the helper's wait.
        done = threading.Event()
        lock = threading.Lock()
        failure: list[BaseException] = []
        # Under `lock`: whether the helper finished, whether the caller left without it.
        state = {"finished": False, "abandoned": False}

        def wait_all() -> None:
            error: BaseException | None = None
            try:
                self._wait_works(handle, deadline)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                error = exc
            finally:
                with lock:
                    state["finished"] = True
                    # Kept only for a caller still waiting: an exception parked in
                    # `failure` refers, through its traceback, to this frame and so to
                    # `failure` itself — a cycle that kept this transport's communicators
                    # (a Gloo loop thread and sockets each) alive until the cyclic GC ran.
                    if error is not None and not state["abandoned"]:
                        failure.append(error)
                error = None
                done.set()

        threading.Thread(target=wait_all, name=f"gloo-wait-r{self.rank}", daemon=True).start()
        while not done.wait(_POLL_S):
            if cancel.is_set():
                with lock:
                    state["abandoned"] = not state["finished"]
                if state["abandoned"]:
                    raise TransferError(f"rank {self.rank}: transfer cancelled")
        if failure:
            raise failure.pop()  # popped: the list must not hold it (see above)

    def _wait_works(self, handle: Handle, deadline: float) -> None:
        for work in handle.payload:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(
                    f"rank {self.rank}: a transfer on channel {handle.channel} did not complete in time"
                )
            try:
                completed = work.wait(timedelta(seconds=remaining))
            except RuntimeError as exc:
                text = str(exc)
                if self._aborted:
                    raise TransferError(f"rank {self.rank}: transport aborted") from exc
                if "timed out" in text.lower():
                    raise TransferTimeout(
                        f"rank {self.rank}: a transfer on channel {handle.channel} did not complete in time"
                    ) from exc
                raise PeerFailure(
                    f"rank {self.rank}: peer failure on channel {handle.channel}: {text}"
                ) from exc
            finally:
                with self._pending_lock:
                    self._pending.discard(work)
            if not completed:
                raise TransferTimeout(
                    f"rank {self.rank}: a transfer on channel {handle.channel} did not complete in time"
                )

    def all_agree(self, mine: bool, deadline: float) -> bool:
        """True when every rank of the group passes True (a MIN all-reduce on channel 0;
        every rank must call it, as part of the same transfer)."""
        from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.MIN)
        work = self._groups[0].allreduce([flag], opts)
        with self._pending_lock:
            self._pending.add(work)
        self._wait_works(Handle(0, [work]), deadline)
        return bool(flag.item())

    def abort(self) -> None:
        self._aborted = True
        with self._pending_lock:
            pending, self._pending = list(self._pending), set()
        for work in pending:
            # Cut the connection this operation uses: its peer fails at once, and no byte
            # can land in a destination buffer after the abort returns.
            try:
                work.wait(_CUT)
            except RuntimeError:
                pass
        for pg in self._groups:
            try:
                pg.abort()
            except RuntimeError:
                pass
        self._groups.clear()

    def close(self) -> None:
        for pg in self._groups:
            try:
                pg.shutdown()
            except RuntimeError:
                pass
        self._groups.clear()
