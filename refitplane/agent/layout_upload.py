"""Publishing a rank's layout to the coordinator: one PublishLayout call, or, above what one
message may carry (`LAYOUT_CHUNK_BYTES`: the coordinator accepts only small messages), the
chunks of one upload (`upload_id`, `chunk`, `more`) that the coordinator puts together."""

from __future__ import annotations

import uuid

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane.protocol import convert
from refitplane.protocol.channel import LAYOUT_CHUNK_BYTES
from refitplane.reshard.layout import Layout


def layout_requests(member_id: str, layout: Layout, rank: int) -> list[apb.PublishLayoutRequest]:
    """The PublishLayout requests, in order, that publish `layout` as member `member_id`'s
    (rank `rank`); the answer to the last one carries the digest."""
    whole = convert.layout_to_proto(layout, rank)
    if whole.ByteSize() <= LAYOUT_CHUNK_BYTES:
        return [apb.PublishLayoutRequest(member_id=member_id, layout=whole)]
    chunks = convert.layout_chunks(whole, LAYOUT_CHUNK_BYTES)
    upload_id = uuid.uuid4().hex
    return [
        apb.PublishLayoutRequest(
            member_id=member_id,
            layout=part,
            upload_id=upload_id,
            chunk=i,
            more=i < len(chunks) - 1,
        )
        for i, part in enumerate(chunks)
    ]
