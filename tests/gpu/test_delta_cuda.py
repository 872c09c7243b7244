"""Delta encoding on CUDA (the Triton kernels of `delta_triton`): the same payload bytes
as the torch path on CPU, applied exactly."""

from __future__ import annotations

import pytest
import torch

from refitplane.reshard.delta import (
    DeltaHeader,
    Encoding,
    apply_delta,
    changed_words,
    choose_encoding,
    encode_into,
    encode_scanned,
    encoded_nbytes,
    scan,
)

pytestmark = [pytest.mark.gpu(count=1)]


def _images(numel: int, fraction: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(numel, generator=g).to(dtype)
    current = base.clone()
    picked = torch.rand(numel, generator=g) < fraction
    current[picked] += 1.0
    return base.view(torch.uint8), current.view(torch.uint8)


def _cpu_payload(
    numel: int, fraction: float, dtype: torch.dtype, encoding: Encoding
) -> tuple[torch.Tensor, torch.Tensor, DeltaHeader, int, torch.Tensor]:
    """Images of a base and its update, and the update's payload from the CPU (torch) path."""
    base, current = _images(numel, fraction, dtype)
    word = torch.empty((), dtype=dtype).element_size()
    changed = int(changed_words(current, base, word))
    header = DeltaHeader(
        encoding, changed, encoded_nbytes(encoding, current.numel(), changed, word)
    )
    on_cpu = torch.empty(header.nbytes, dtype=torch.uint8)
    encode_into(current, base, header, word, on_cpu)
    return base, current, header, word, on_cpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0005, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("encoding", list(Encoding))
def test_cuda_payload_equals_cpu_payload(
    dtype: torch.dtype, fraction: float, encoding: Encoding
) -> None:
    base, current, header, word, on_cpu = _cpu_payload((1 << 22) + 3, fraction, dtype, encoding)
    base_gpu, current_gpu = base.cuda(), current.cuda()
    assert int(changed_words(current_gpu, base_gpu, word)) == header.changed
    on_gpu = torch.empty(header.nbytes, dtype=torch.uint8, device="cuda")
    encode_into(current_gpu, base_gpu, header, word, on_gpu)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    received = base_gpu.clone()
    apply_delta(received, header, word, on_gpu)
    assert torch.equal(received, current_gpu)


def test_chosen_encoding_roundtrip_on_a_large_message() -> None:
    base, current = _images(1 << 28, 0.01, torch.bfloat16)  # 512 MiB
    base_gpu, current_gpu = base.cuda(), current.cuda()
    header = choose_encoding(current.numel(), int(changed_words(current_gpu, base_gpu, 2)), 2)
    assert header.encoding is Encoding.INDEX
    payload = torch.empty(header.nbytes, dtype=torch.uint8, device="cuda")
    encode_into(current_gpu, base_gpu, header, 2, payload)
    apply_delta(base_gpu, header, 2, payload)
    assert torch.equal(base_gpu, current_gpu)


def test_the_triton_path_is_the_one_that_ran() -> None:
    from refitplane.reshard import delta_triton

    assert delta_triton.available(torch.empty(1, device="cuda"))
    assert not delta_triton.available(torch.empty(1))


@pytest.mark.parametrize("word_dtype", [torch.uint8, torch.int64])
def test_one_and_eight_byte_words(word_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, generator=g)
    current = base.clone()
    current[torch.randperm(base.numel(), generator=g)[:300]] ^= 0x10
    word = torch.empty((), dtype=word_dtype).element_size()
    for encoding in (Encoding.INDEX, Encoding.BITMAP):
        changed = int(changed_words(current, base, word))
        header = DeltaHeader(
            encoding, changed, encoded_nbytes(encoding, base.numel(), changed, word)
        )
        on_cpu = torch.empty(header.nbytes, dtype=torch.uint8)
        encode_into(current, base, header, word, on_cpu)
        on_gpu = torch.empty(header.nbytes, dtype=torch.uint8, device="cuda")
        encode_into(current.cuda(), base.cuda(), header, word, on_gpu)
        assert int(changed_words(current.cuda(), base.cuda(), word)) == changed
        assert torch.equal(on_gpu.cpu(), on_cpu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0, 0.0005, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("encoding", [Encoding.INDEX, Encoding.BITMAP])
def test_fused_scan_payload_equals_cpu_payload_and_advances_the_base(
    dtype: torch.dtype, fraction: float, encoding: Encoding
) -> None:
    """One pass (`scan` with the base advanced in place) then `encode_scanned` on CUDA: the
    same payload bytes as the torch path on CPU, the base left holding the current bytes,
    and the Triton apply (`scatter_index` / `scatter_bitmap`) reproducing them."""
    base, current, header, word, on_cpu = _cpu_payload((1 << 22) + 5, fraction, dtype, encoding)
    base_gpu, current_gpu = base.cuda(), current.cuda()
    snapshot = base_gpu.clone()
    found = scan(current_gpu, snapshot, word, update_base=True)
    assert int(found.count) == header.changed
    assert torch.equal(snapshot, current_gpu)
    on_gpu = torch.full((header.nbytes,), 0xAA, dtype=torch.uint8, device="cuda")
    encode_scanned(current_gpu, found, header, word, on_gpu)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    received = base_gpu.clone()
    apply_delta(received, header, word, on_gpu)
    assert torch.equal(received, current_gpu)


def test_a_bad_index_writes_nothing_outside_the_message() -> None:
    """An index past the message's end (a corrupt payload) is dropped by the apply kernel;
    the bytes around the image stay as they were (the checksums then fail the message)."""
    arena = torch.zeros(4096, dtype=torch.int16, device="cuda")
    image = arena[1024:2048].view(torch.uint8)
    header = DeltaHeader(Encoding.INDEX, 2, encoded_nbytes(Encoding.INDEX, image.numel(), 2, 2))
    payload = torch.zeros(header.nbytes, dtype=torch.uint8, device="cuda")
    payload[:8].view(torch.int32).copy_(torch.tensor([3, 1500], dtype=torch.int32))
    payload[8:].view(torch.int16).fill_(7)
    apply_delta(image, header, 2, payload)
    assert int(arena[1024 + 3]) == 7
    assert int(arena.count_nonzero()) == 1


def test_batched_kernels_equal_the_torch_payloads() -> None:
    """One launch per pass for many messages (`delta_batch`), compiled: same bytes."""
    from tests.unit.reshard.test_delta_batch import check_batch

    check_batch("cuda")


def test_batched_kernels_with_the_scans_slots_equal_the_torch_payloads() -> None:
    """The same with the scan's compaction (REFIT_DELTA_PACK_CAP=64, read at import: in a
    child process): `pack` writes the blocks that fit their slots, the gather the rest."""
    import os
    import subprocess
    import sys

    code = "from tests.unit.reshard.test_delta_batch import check_batch; check_batch('cuda')"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "REFIT_DELTA_PACK_CAP": "64"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_applies_through_one_room() -> None:
    """A receiver's applies through one transfer's room (`delta_apply`), compiled: exact,
    several groups, both encodings, 2- and 4-byte words; a bad index writes nothing."""
    from tests.unit.reshard.test_delta_apply import check_apply

    check_apply("cuda")
