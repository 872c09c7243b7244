"""A CUDA IPC storage record for tests that need one without a GPU (the handles are never
opened: the manifest's tests parse them, the link-copy tests read the storages in-process)."""

from __future__ import annotations

from refitplane.reshard.transport.ipc_records import IpcRecord


def storage_record(index: int, size: int = 1 << 20) -> IpcRecord:
    return IpcRecord(
        seq=index,
        nbytes=size,
        offset=0,
        storage_size=size,
        storage_offset=4096,
        ref_counter_offset=8,
        event_sync_required=True,
        handle=bytes(range(64)),
        ref_counter_handle=b"/torch_123_456_0",
        event_handle=bytes(64),
        device_uuid="GPU-7a1b2c3d-0000-1111-2222-333344445555",
        fresh=False,
    )
