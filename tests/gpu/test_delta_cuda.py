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
    encoded_nbytes,
)

pytestmark = [pytest.mark.gpu(count=1)]


def _images(numel: int, fraction: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(numel, generator=g).to(dtype)
    current = base.clone()
    picked = torch.rand(numel, generator=g) < fraction
    current[picked] += 1.0
    return base.view(torch.uint8), current.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0005, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("encoding", list(Encoding))
def test_cuda_payload_equals_cpu_payload(
    dtype: torch.dtype, fraction: float, encoding: Encoding
) -> None:
    base, current = _images((1 << 22) + 3, fraction, dtype)
    word = torch.empty((), dtype=dtype).element_size()
    changed = int(changed_words(current, base, word))
    header = DeltaHeader(
        encoding, changed, encoded_nbytes(encoding, current.numel(), changed, word)
    )
    on_cpu = torch.empty(header.nbytes, dtype=torch.uint8)
    encode_into(current, base, header, word, on_cpu)
    base_gpu, current_gpu = base.cuda(), current.cuda()
    assert int(changed_words(current_gpu, base_gpu, word)) == changed
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
