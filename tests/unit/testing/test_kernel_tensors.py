"""The fresh-load oracle's walk of a worker's model (`refitplane.testing.kernel_tensors`):
it sees derived tensors modules hold as plain attributes, never reads the KV caches, and
both digests change exactly where the bytes do."""

from __future__ import annotations

import types

import pytest
import torch

from refitplane.testing.kernel_tensors import kernel_tensors


class _Mixer(torch.nn.Module):
    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__()
        self.conv = torch.nn.Linear(4, 6, bias=True)
        self.register_buffer("scale", torch.ones(3), persistent=False)
        # Derived at load time, as Mamba's conv_weights: a plain attribute, not a parameter.
        self.conv_weights = self.conv.weight.detach().t().contiguous()
        self.kv_cache = [cache[0], cache[1]]  # views of the cache manager's allocation


def _worker(model: torch.nn.Module, cache: torch.Tensor) -> object:
    runner = types.SimpleNamespace(get_model=lambda: model, kv_caches=[cache])
    return types.SimpleNamespace(model_runner=runner)


@pytest.mark.parametrize("digest", ["sha256", "sums"])
def test_digests_see_derived_tensors_and_skip_caches(digest: str) -> None:
    torch.manual_seed(0)
    cache = torch.zeros(2, 8, 4)
    model = torch.nn.Sequential(_Mixer(cache))
    worker = _worker(model, cache)
    before = kernel_tensors(worker, digest)
    assert sorted(before) == ["0.conv.bias", "0.conv.weight", "0.conv_weights", "0.scale"]

    cache.fill_(1.0)  # generation's state: never read, so nothing changes
    assert kernel_tensors(worker, digest) == before

    model[0].conv_weights[1, 2] += 1.0  # a stale or fresh derived copy: seen
    after = kernel_tensors(worker, digest)
    assert {n for n in before if before[n] != after[n]} == {"0.conv_weights"}
    assert after["0.conv_weights"].startswith("torch.float32 [4, 6] ")
