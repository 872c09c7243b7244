"""The CUDA IPC record: round trip, fixed size, and refusals naming the link."""

from __future__ import annotations

import pytest

from refitplane.errors import TransferError
from refitplane.reshard.transport.ipc_records import RECORD_BYTES, IpcRecord

pytestmark = pytest.mark.unit

WHERE = "rank 1: CUDA IPC message 3 from rank 0 to rank 1 on channel 0"


def _record(**changes):
    fields = {
        "seq": 3,
        "nbytes": 4096,
        "offset": 512,
        "storage_size": 1 << 20,
        "storage_offset": 256,
        "ref_counter_offset": 8,
        "event_sync_required": True,
        "handle": bytes(range(64)),
        "ref_counter_handle": b"/torch_123_456_0",
        "event_handle": bytes(64),
        "device_uuid": "GPU-7a1b2c3d-0000-1111-2222-333344445555",
    }
    fields.update(changes)
    return IpcRecord(**fields)


def test_round_trip_at_a_fixed_size():
    for record in (
        _record(),
        _record(event_handle=None, event_sync_required=False),
        _record(fresh=False),
    ):
        data = record.encode()
        assert len(data) == RECORD_BYTES
        assert IpcRecord.decode(data, where=WHERE) == record


def test_record_that_is_not_the_expected_message_is_refused():
    record = _record()
    record.check(seq=3, nbytes=4096, where=WHERE)
    with pytest.raises(TransferError, match="got the sender's message 3, expected 4"):
        record.check(seq=4, nbytes=4096, where=WHERE)
    with pytest.raises(TransferError, match="4096 bytes, the receiver's 2048"):
        record.check(seq=3, nbytes=2048, where=WHERE)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\0" * RECORD_BYTES, "not a CUDA IPC record"),
        (_record().encode()[:100], "not a CUDA IPC record"),
        (_record(handle=b"").encode(), "without a memory handle"),
        (_record(offset=(1 << 20) - 100).encode(), "points past its storage"),
    ],
)
def test_bad_records_name_the_link(data, match):
    with pytest.raises(TransferError, match=match) as err:
        IpcRecord.decode(data, where=WHERE)
    assert WHERE in err.value.message


def test_oversized_record_is_refused_when_encoded():
    with pytest.raises(TransferError, match="above 512"):
        _record(ref_counter_handle=b"x" * 600).encode()


def test_an_inline_record_carries_no_handle():
    record = IpcRecord.inline_message(5, 4096, "GPU-x")
    decoded = IpcRecord.decode(record.encode(), where=WHERE)
    assert decoded.inline
    assert decoded.handle == b""
    decoded.check(seq=5, nbytes=4096, where=WHERE)
