"""A Gloo transport that runs the executor's device-ordered path on CPU.

On GPUs the executor queues unpacking and checksums "beside" a channel right after posting
a group, without any host wait: CUDA orders them after the transfer. Gloo cannot order
work that way, so the executor normally takes its other path there (post-processing after
a host wait). `OrderedGlooTransport` completes every group inside `issue`, which makes
anything queued after `issue` run after the transfer, exactly the guarantee CUDA streams
give: the device-ordered path then runs, byte for byte, on real multi-process Gloo.

Use it with one channel. Completing a group inside `issue` then cannot deadlock: a rank
posts its messages in the schedule's global order, so the smallest unfinished message always
has both ends posted (see `schedule.py`). With several channels a rank may still hold
another channel's batched ops unposted while it blocks, which real (asynchronous) transports
never do.
"""

from __future__ import annotations

from collections.abc import Sequence

from refitplane.reshard.transport.base import Handle, P2POp
from refitplane.reshard.transport.gloo import GlooTransport


class OrderedGlooTransport(GlooTransport):
    device_ordered = True
    # Groups complete inside `issue`, so staging can come back when they are posted, as it
    # does over NCCL (`order_after` has nothing left to wait for).
    device_reuse = True

    def issue(self, channel: int, ops: Sequence[P2POp], deadline: float) -> Handle:
        super().wait(super().issue(channel, ops, deadline), deadline)
        # Complete: nothing left to poll or wait for (a Gloo work is waited for once).
        return Handle(channel, [])
