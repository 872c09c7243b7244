"""The update sessions vLLM opens on one worker (start, then updates, then finish), as the
refitplane engine (`vllm_engine`) keeps them: what each update did (`UpdateRecord`), whether
the open session was discarded, which verified receive its finish would apply, how the last
session ended, and the version the worker fully holds since. Bookkeeping only: the engine
receives, stages and reloads, and reads here what a finish may do.

A version is held only after a finish that completes its session: every update verified,
none discarded. A failed, discarded or incomplete session leaves the version held before
(or none, when received bytes may have reached live weights: `incomplete`).
"""

from __future__ import annotations

from refitplane.generator.vllm_contract import RefitUpdateInfo, SessionResult, UpdateRecord


class UpdateSessions:
    def __init__(self) -> None:
        # A session vLLM opened (start) and will close (finish).
        self.open = False
        self.updates: list[UpdateRecord] = []
        self.discarded = False
        # The refit whose last staged bucket and attention post-processing the finish
        # applies, and the version its verified receive carries (held only once applied).
        self.pending_refit = ""
        self.pending_version = 0
        # The version this worker fully holds (0: none received since start). Read by the
        # agent session's lease thread.
        self.version = 0
        # How the last finished session ended, and what the weights are since.
        self.last: SessionResult = "none"
        self.last_message = ""
        self.incomplete = False
        self.applied_sessions = 0

    def start(self) -> None:
        self.open = True
        self.updates = []
        self.discarded = False
        self.pending_refit = ""
        self.pending_version = 0

    def record(
        self,
        info: RefitUpdateInfo,
        *,
        ok: bool,
        reason: str = "",
        message: str = "",
        modified: bool = False,
    ) -> None:
        """One update's outcome (`modified`: received bytes may have reached live weights)."""
        self.updates.append(
            UpdateRecord(
                refit_id=info.refit_id,
                action=info.action,
                ok=ok,
                reason=reason,
                message=message,
                modified=modified,
            )
        )

    def verified(self, refit_id: str, version: int) -> None:
        """Refit `refit_id` was received and verified: the finish applies it, at `version`
        (the coordinator's, not the caller's)."""
        self.pending_refit = refit_id
        self.pending_version = version

    def discard(self, why: str) -> bool:
        """Make the open session apply nothing; True when it was open and not discarded yet
        (the caller then drops what is staged)."""
        if not self.open or self.discarded:
            return False
        self.discarded = True
        self.last_message = why
        self.pending_refit = ""
        self.pending_version = 0
        return True

    def weights_gone(self, why: str) -> bool:
        """The weights were dropped (vLLM's sleep at level 2): no version is held from now
        on, and the open session applies nothing; as `discard`."""
        self.version = 0
        # Whatever memory wakes up holds no version: not serving, and vLLM's
        # /update_weight_version refused (as after a failed live receive), until an update
        # applies.
        self.incomplete = True
        self.last_message = why
        return self.discard(why)

    def take(self) -> tuple[list[UpdateRecord], str, int]:
        """For a finish: the session's updates, the refit it would apply and that refit's
        version; the session keeps none of them."""
        taken = self.updates, self.pending_refit, self.pending_version
        self.updates, self.pending_refit, self.pending_version = [], "", 0
        return taken

    def end(self, result: SessionResult, message: str, *, version: int = 0) -> None:
        """The finish's outcome; an "applied" one holds `version` from now on (0: keep)."""
        if result == "applied" and version:
            self.version = version
        self.last, self.last_message = result, message
        if result == "applied":
            self.incomplete = False
            self.applied_sessions += 1
        elif result == "incomplete":
            self.incomplete = True
        # Closed last, once version and outcome are settled: the lease thread reads no
        # closed session with the previous outcome (`serves_held`).
        self.open = False

    def serves_held(self) -> bool | None:
        """Whether the worker serves `version` (None while a session is open: the answer is
        about to change); False once an update left the weights incomplete."""
        return None if self.open else not self.incomplete
