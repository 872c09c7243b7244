"""The CUDA IPC manifest (a link's chunks in the sender's memory) and completion: round trip,
and refusals naming the link, the chunk and the tensor instead of a copy from the wrong
place."""

from __future__ import annotations

import pytest

from refitplane.errors import TransferError
from refitplane.reshard.transport.ipc_manifest import (
    DONE_MISMATCH,
    MANIFEST_LIMIT,
    ChunkSource,
    IpcManifest,
    check_manifest_size,
    decode_completion,
    encode_completion,
    manifest_in,
)
from tests.unit.reshard.ipc_fixtures import storage_record

pytestmark = pytest.mark.unit

WHERE = "rank 1: CUDA IPC link from rank 0 to rank 1"


def _manifest(*chunks: ChunkSource) -> IpcManifest:
    return IpcManifest(7, (storage_record(0), storage_record(1, 4096)), chunks)


def test_round_trip() -> None:
    manifest = _manifest(
        ChunkSource(0, 0, 4096),
        ChunkSource(1, 64, 1024),
        ChunkSource(0, 8192, 32 * 2, (4, 8), (16, 1), 2),  # a strided box of a bf16 matrix
    )
    assert IpcManifest.decode(manifest.encode(), where=WHERE) == manifest
    assert decode_completion(encode_completion(DONE_MISMATCH), where=WHERE) == DONE_MISMATCH


@pytest.mark.parametrize(
    ("chunk", "words"),
    [
        (ChunkSource(2, 0, 16), "malformed"),  # no storage 2
        (ChunkSource(1, 4000, 1024), "points past its storage"),
        (ChunkSource(1, 0, 64, (4, 8), (4096, 1), 2), "points past its storage"),
        (ChunkSource(0, 0, 60, (4, 8), (8, 1), 2), "is not 60 bytes"),
    ],
)
def test_a_chunk_outside_its_storage_or_of_the_wrong_size_is_refused(
    chunk: ChunkSource, words: str
) -> None:
    with pytest.raises(TransferError, match=words) as err:
        IpcManifest.decode(_manifest(chunk).encode(), where=WHERE)
    assert WHERE in err.value.message


def test_truncated_or_foreign_bytes_are_refused() -> None:
    data = _manifest(ChunkSource(0, 0, 16)).encode()
    with pytest.raises(TransferError, match="header says"):
        IpcManifest.decode(data[:-8], where=WHERE)
    with pytest.raises(TransferError, match="not a CUDA IPC manifest"):
        IpcManifest.decode(b"XXXX" + data[4:], where=WHERE)
    with pytest.raises(TransferError, match="not a CUDA IPC completion"):
        decode_completion(b"RIPD" + (9).to_bytes(4, "little"), where=WHERE)


def test_a_manifest_for_other_chunks_names_the_tensor() -> None:
    manifest = _manifest(ChunkSource(0, 0, 4096), ChunkSource(1, 0, 1024))
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    with pytest.raises(TransferError, match="describes 2 chunk"):
        manifest.check_sizes([4096], where=WHERE, names=names[:1])
    with pytest.raises(TransferError, match=r"\('model.norm.weight'\) is 1024 bytes on the sender"):
        manifest.check_sizes([4096, 2048], where=WHERE, names=names)


def test_a_manifest_is_read_from_one_receive_of_the_protocols_bound() -> None:
    """One receive of `MANIFEST_LIMIT` bytes holds any manifest a sender may send; the
    manifest's header says where it ends (no length message before it)."""
    data = _manifest(ChunkSource(0, 0, 4096), ChunkSource(1, 64, 1024)).encode()
    received = memoryview(data + bytes(4096))  # what Gloo leaves past the message: ignored
    assert manifest_in(received, where=WHERE) == data
    # A header that claims more than arrived, or foreign bytes, are refused.
    with pytest.raises(TransferError, match="more than the"):
        manifest_in(memoryview(data[: len(data) - 8]), where=WHERE)
    with pytest.raises(TransferError, match="not a CUDA IPC manifest"):
        manifest_in(memoryview(b"XXXX" + data[4:]), where=WHERE)


def test_a_sender_never_sends_more_than_the_bound() -> None:
    """Gloo aborts a receiving process that gets more than it posted: the sender refuses
    first, naming the link (the receiver then times out instead of crashing vLLM)."""
    check_manifest_size(bytes(MANIFEST_LIMIT), where=WHERE)
    with pytest.raises(TransferError, match="more than the protocol's") as err:
        check_manifest_size(bytes(MANIFEST_LIMIT + 1), where=WHERE)
    assert WHERE in err.value.message
