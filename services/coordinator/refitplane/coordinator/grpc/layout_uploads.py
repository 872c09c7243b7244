"""Layouts published in chunks (`PublishLayoutRequest.upload_id/chunk/more`): each chunk is
one message below the coordinator's receive limit, so no single message is large; the
chunks of one upload are put together here until the last one arrives.

At most one upload per member is held, and one upload's entries are capped at
`max_bytes` (the serialized size of its chunks), so a member cannot grow the coordinator
without bound by never sending its last chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refitplane._generated.refit.v1 import agent_pb2 as apb
from refitplane._generated.refit.v1 import common_pb2 as cpb
from refitplane.errors import InvalidArgument


@dataclass
class _Upload:
    upload_id: str
    next_chunk: int = 0
    nbytes: int = 0
    layout: cpb.RankLayout = field(default_factory=cpb.RankLayout)


class LayoutUploads:
    def __init__(self, *, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._uploads: dict[str, _Upload] = {}  # member id → its upload in progress

    def add(self, request: apb.PublishLayoutRequest) -> cpb.RankLayout | None:
        """The whole layout once `request` is the last chunk (or a single message), else
        None. Raises InvalidArgument naming the field for a chunk out of order or an upload
        over the cap (the upload is dropped: the member starts again at chunk 0)."""
        member_id = request.member_id
        if not request.upload_id:
            if request.chunk or request.more:
                raise InvalidArgument("a chunked layout needs an upload_id", field="upload_id")
            self._uploads.pop(member_id, None)
            return request.layout
        upload = self._uploads.get(member_id)
        if request.chunk == 0 or upload is None or upload.upload_id != request.upload_id:
            upload = self._uploads[member_id] = _Upload(request.upload_id)
        if request.chunk != upload.next_chunk:
            del self._uploads[member_id]
            raise InvalidArgument(
                f"chunk {request.chunk} of upload {request.upload_id[:40]!r} arrived, "
                f"expected chunk {upload.next_chunk}; start again at chunk 0",
                field="chunk",
            )
        upload.nbytes += request.layout.ByteSize()
        if upload.nbytes > self._max_bytes:
            del self._uploads[member_id]
            raise InvalidArgument(
                f"the layout's chunks exceed {self._max_bytes} bytes (REFIT_MAX_LAYOUT_BYTES)",
                field="layout",
            )
        upload.layout.tensors.extend(request.layout.tensors)
        upload.next_chunk += 1
        if request.more:
            return None
        del self._uploads[member_id]
        return upload.layout

    def received(self, member_id: str) -> int:
        """Tensor entries of the member's upload in progress (0: none)."""
        upload = self._uploads.get(member_id)
        return len(upload.layout.tensors) if upload is not None else 0

    def forget(self, member_id: str) -> None:
        self._uploads.pop(member_id, None)
