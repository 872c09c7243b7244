"""`EngineSteps`: the engine verbs a replica controller runs around a refit's transfer,
each with what it leaves the replica as: waking the weights of a sleeping engine before any
byte moves, closing an update of a refit that failed, releasing an engine no byte touched
(asleep again or resumed, as it was found), the verbs after vLLM's finish (waking the KV
cache, resuming: a failure is a reason the replica cannot serve), and the staging gauge
refreshed after a refit."""

from __future__ import annotations

import logging
from collections.abc import Callable

from refitplane.errors import FailedPrecondition, RefitError
from refitplane.replica.control import EngineControl, StatusSink, succeeded
from refitplane.replica.state import SidecarState

log = logging.getLogger("refitplane.sidecar")


class EngineSteps:
    """One controller's engine steps; they read and write its `SidecarState`."""

    def __init__(
        self,
        control: EngineControl,
        state: SidecarState,
        *,
        sleep_level: int,
        metrics: StatusSink | None,
        ranks_epoch: Callable[[], tuple[int, int]],
    ) -> None:
        """`sleep_level`: the level the caller puts the engine to sleep with between
        refits (0: never). `ranks_epoch`: what the controller's ranks were read for (the
        staging gauge is fixed per ranks, `export_staging`)."""
        self.control = control
        self.state = state
        self.sleep_level = sleep_level
        self.metrics = metrics
        self._ranks_epoch = ranks_epoch
        # The ranks' epoch whose staging gauge cannot change: every worker's status said it
        # stages nothing (`export_staging`).
        self._gauge_fixed_epoch: tuple[int, int] | None = None

    def wake_weights(self, refit_id: str) -> None:
        """An engine asleep at the refit's start (the caller put it to sleep while the
        trainer stepped) gets its weights back before any byte moves: the workers receive
        into the parameters' memory, which sleep unmapped. The KV cache stays asleep until
        the new weights verified (`SidecarMember.on_start_transfer`)."""
        self.state.woke = self.state.weights_lost = False
        if not self.control.is_sleeping():
            return
        status = self.control.wake_up(["weights"])
        # Level 2 dropped the weights: whatever woke holds no version, even if this failed.
        self.state.weights_lost = self.sleep_level >= 2
        if not succeeded(status):
            raise FailedPrecondition(
                f"vLLM answered HTTP {status} to /wake_up?tags=weights for refit {refit_id}: "
                "the weights cannot be received while asleep (is the trainer holding the "
                "memory they need?)"
            )
        self.state.woke = True

    def release(self) -> None:
        """A refit that failed before any byte landed: leave the engine as it was found —
        asleep again if it was asleep (level 1: its weights go back to host memory, intact),
        else resumed."""
        if self.state.woke:
            self.control.sleep(self.sleep_level)
            self.state.woke = False
        else:
            self.control.resume()
        self.state.paused = False

    def close_update(self, refit_id: str) -> None:
        """vLLM needs every started update finished: drop what was staged first, so this
        finish applies nothing of a refit that failed somewhere in the replica (and names no
        version: the replica keeps the one it fully holds)."""
        self.control.update({"refit_id": refit_id, "action": "discard"})
        self.control.finish(None)
        self.export_staging()
        # Last: once the update reads closed, this sidecar makes no more vLLM calls for it.
        self.state.update_open = False

    def after_finish(self, verb: str, call: Callable[[], int], refit_id: str) -> str:
        """Run `call`, an engine verb after vLLM's finish (waking the KV cache, resuming):
        empty when it succeeded, else why the engine cannot serve, naming `verb` and vLLM's
        answer. Either way a failure leaves the replica not ready; whether it also fails
        the refit depends on whether the report went first
        (`SidecarMember.on_start_transfer`)."""
        try:
            status = call()
        except RefitError as exc:
            return f"vLLM did not answer {verb} after refit {refit_id}: {exc.message}"
        if succeeded(status):
            return ""
        return f"vLLM answered HTTP {status} to {verb} after refit {refit_id}"

    def export_staging(self) -> bool:
        """Refresh the staging gauge after a refit (never fails one: metrics only); whether
        the engines were asked. Workers that stage no checkpoint tensors (live receive without
        fallback layers) report their staging ring alone, which their plan fixes for the
        group: once their statuses said so, later refits of the same ranks skip this round
        trip through vLLM (~1 ms between the last byte and COMMITTED, measured on vLLM 0.26)."""
        if self.metrics is None or self._gauge_fixed_epoch == self._ranks_epoch():
            return False
        try:
            statuses = self.control.engine_status()
        except Exception:  # a metric must not fail a refit
            log.debug("reading the engines' status for metrics failed", exc_info=True)
            return True
        if statuses:
            self.metrics.update(statuses)
            # `stages` absent (an older worker): assume it does, ask every time.
            if not any(s.get("stages", True) for s in statuses):
                self._gauge_fixed_epoch = self._ranks_epoch()
        return True
