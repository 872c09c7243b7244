"""One rank of a Megatron-core world: build real GPTModels, load a Hugging Face checkpoint
into them with a simple forward converter (HF → Megatron, written here independently of
the adapter), then describe the rank's holdings with `megatron_shards` and write them out.

Run by `world.run_world`: argv = out_dir, scenarios JSON. Each scenario builds its own
model-parallel state over the same Gloo world and tears it down afterwards.

CPU workarounds (megatron-core 0.16.1, torch CPU build):
- The alltoall MoE token dispatcher creates a CUDA stream in its constructor; the
  allgather dispatcher does not, so scenarios use it (layouts do not depend on it).
- GroupedMLP asserts that the CUDA-only `grouped_gemm` package is importable, though its
  parameters are plain tensors; the check is skipped here (the forward is never run).
- With pipeline parallelism and tied embeddings, `setup_embeddings_and_output_layer`
  moves the last stage's output weight to CUDA before all-reducing it over the embedding
  group; `Tensor.cuda` is made a no-op while the model is built so the Gloo all-reduce
  runs on CPU.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from reconstruct import save_pieces
from world import init_from_env


@contextlib.contextmanager
def cpu_model_building() -> Iterator[None]:
    import megatron.core.transformer.moe.grouped_gemm_util as gg

    saved_cuda, saved_check = torch.Tensor.cuda, gg.assert_grouped_gemm_is_available
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    gg.assert_grouped_gemm_is_available = lambda: None
    try:
        yield
    finally:
        torch.Tensor.cuda = saved_cuda  # type: ignore[method-assign]
        gg.assert_grouped_gemm_is_available = saved_check


def build_chunks(hf: Any, sc: dict[str, Any]) -> list[torch.nn.Module]:
    """This rank's model: one GPTModel, or one per virtual-pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    experts = getattr(hf, "num_experts", 0) or 0
    moe: dict[str, Any] = {}
    if experts:
        dense = set(hf.mlp_only_layers)
        moe = {
            "num_moe_experts": experts,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_router_topk": hf.num_experts_per_tok,
            "moe_grouped_gemm": sc["grouped"],
            "moe_token_dispatcher_type": "allgather",
            "moe_layer_freq": [0 if i in dense else 1 for i in range(hf.num_hidden_layers)],
            "expert_model_parallel_size": sc["ep"],
            "expert_tensor_parallel_size": sc["etp"],
        }
    cfg = TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.head_dim,
        ffn_hidden_size=hf.intermediate_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=sc["tp"],
        pipeline_model_parallel_size=sc["pp"],
        virtual_pipeline_model_parallel_size=sc["vpp"],
        **moe,
    )
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(sc["vpp"] or 1) if sc["vpp"] else [None]:
        # The block spec honours moe_layer_freq (dense and MoE layers) and picks this
        # (virtual) stage's layers.
        spec = get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
        with cpu_model_building():
            gpt = GPTModel(
                cfg,
                spec,
                vocab_size=sc["padded_vocab"],
                max_sequence_length=64,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=hf.tie_word_embeddings,
                position_embedding_type="rope",
                vp_stage=vp_stage,
            )
        # As in Megatron training: the bf16 wrapper casts every parameter (norms included).
        chunks.append(Float16Module(cfg, gpt))
    return chunks


class Loader:
    """HF checkpoint → this rank's Megatron parameters; every parameter must be written."""

    def __init__(self, model: torch.nn.Module, sd: dict[str, torch.Tensor], hf: Any) -> None:
        from megatron.core import parallel_state as ps

        self.params = dict(model.named_parameters())
        self.done: set[str] = set()
        self.sd, self.hf = sd, hf
        self.tp, self.tp_rank = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
        )
        self.ep, self.ep_rank = (
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
        )
        self.etp, self.etp_rank = (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
        )

    def put(self, name: str, value: torch.Tensor) -> None:
        param = self.params[name]
        assert tuple(param.shape) == tuple(value.shape), (name, param.shape, value.shape)
        with torch.no_grad():
            param.copy_(value)
        self.done.add(name)

    def tp_chunk(self, t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
        return t.chunk(parts, dim=dim)[index]

    def vocab(self, name: str, hf_name: str) -> None:
        full = self.sd[hf_name]
        padded = torch.full(
            (self.params[name].shape[0] * self.tp, full.shape[1]), 7.0, dtype=full.dtype
        )
        padded[: full.shape[0]] = full  # padding rows hold a sentinel the adapter must not publish
        self.put(name, self.tp_chunk(padded, 0, self.tp, self.tp_rank))

    def fc1(self, gate: torch.Tensor, up: torch.Tensor, parts: int, index: int) -> torch.Tensor:
        return torch.cat([gate.chunk(parts)[index], up.chunk(parts)[index]])

    def layer(self, i: int, number: int) -> None:
        hf, src, m = self.hf, f"model.layers.{number}.", f"decoder.layers.{i}."
        groups, hd = hf.num_key_value_heads, hf.head_dim
        q = self.sd[src + "self_attn.q_proj.weight"].reshape(groups, -1, hf.hidden_size)
        k = self.sd[src + "self_attn.k_proj.weight"].reshape(groups, hd, hf.hidden_size)
        v = self.sd[src + "self_attn.v_proj.weight"].reshape(groups, hd, hf.hidden_size)
        qkv = torch.cat([q, k, v], dim=1).reshape(-1, hf.hidden_size)
        self.put(
            m + "self_attention.linear_qkv.weight", self.tp_chunk(qkv, 0, self.tp, self.tp_rank)
        )
        o = self.sd[src + "self_attn.o_proj.weight"]
        self.put(
            m + "self_attention.linear_proj.weight", self.tp_chunk(o, 1, self.tp, self.tp_rank)
        )
        for mine, theirs in (
            ("input_layernorm.weight", "input_layernorm.weight"),
            ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
            ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ):
            self.put(m + mine, self.sd[src + theirs])
        if m + "mlp.router.weight" in self.params:
            self.experts(m, src)
        else:
            gate, up = self.sd[src + "mlp.gate_proj.weight"], self.sd[src + "mlp.up_proj.weight"]
            self.put(m + "mlp.linear_fc1.weight", self.fc1(gate, up, self.tp, self.tp_rank))
            down = self.sd[src + "mlp.down_proj.weight"]
            self.put(m + "mlp.linear_fc2.weight", self.tp_chunk(down, 1, self.tp, self.tp_rank))

    def experts(self, m: str, src: str) -> None:
        self.put(m + "mlp.router.weight", self.sd[src + "mlp.gate.weight"])
        per_rank = self.hf.num_experts // self.ep
        fc1s, fc2s = [], []
        for i in range(per_rank):
            e = f"{src}mlp.experts.{self.ep_rank * per_rank + i}."
            fc1s.append(
                self.fc1(
                    self.sd[e + "gate_proj.weight"],
                    self.sd[e + "up_proj.weight"],
                    self.etp,
                    self.etp_rank,
                )
            )
            fc2s.append(self.tp_chunk(self.sd[e + "down_proj.weight"], 1, self.etp, self.etp_rank))
        if m + "mlp.experts.weight1" in self.params:
            # GroupedMLP computes x @ weight1.view(n, H, -1)[i] and h @ weight2.view(n, -1, H)[i].
            w1 = torch.stack([w.t() for w in fc1s]).reshape(self.hf.hidden_size, -1)
            w2 = torch.stack([w.t() for w in fc2s]).reshape(-1, self.hf.hidden_size)
            self.put(m + "mlp.experts.weight1", w1)
            self.put(m + "mlp.experts.weight2", w2)
            return
        for i in range(per_rank):
            self.put(f"{m}mlp.experts.local_experts.{i}.linear_fc1.weight", fc1s[i])
            self.put(f"{m}mlp.experts.local_experts.{i}.linear_fc2.weight", fc2s[i])

    def load(self, model: torch.nn.Module) -> None:
        if "embedding.word_embeddings.weight" in self.params:
            self.vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight")
        for i, layer in enumerate(model.decoder.layers):  # type: ignore[union-attr,arg-type]
            self.layer(i, layer.layer_number - 1)
        if "decoder.final_layernorm.weight" in self.params:
            self.put("decoder.final_layernorm.weight", self.sd["model.norm.weight"])
        if "output_layer.weight" in self.params:
            tied = self.hf.tie_word_embeddings
            self.vocab(
                "output_layer.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"
            )
        left = sorted(set(self.params) - self.done)
        assert not left, f"converter left Megatron parameters unset: {left}"


def check_mismatches_are_refused(model: Any, hf: Any) -> None:
    """Dims or parallel coordinates that disagree with the model fail, naming the field."""
    from dataclasses import replace

    from refitplane.errors import LayoutError
    from refitplane.trainer.layouts import ModelDims, megatron_shards, parallel_from_model

    dims = ModelDims.from_hf_config(hf)
    par = parallel_from_model(model[0] if isinstance(model, list) else model)
    wrong: list[tuple[str, ModelDims, Any]] = [
        (
            "num_key_value_heads",
            replace(dims, num_key_value_heads=dims.num_key_value_heads // 2),
            par,
        ),
        (
            "tie_word_embeddings",
            replace(dims, tie_word_embeddings=not dims.tie_word_embeddings),
            par,
        ),
    ]
    if par.ep_size > 1:  # a wrong expert-parallel size would renumber the experts
        wrong.append(("ep_size", dims, replace(par, ep_rank=0, ep_size=1)))
    for field, bad_dims, bad_par in wrong:
        try:
            megatron_shards(model, bad_dims, bad_par)
            refused: str | None = "nothing (accepted)"
        except LayoutError as exc:
            refused = exc.field
        if refused != field:
            raise AssertionError(f"a wrong {field} was refused for {refused}")


def run_scenario(sc: dict[str, Any], rank: int, out_dir: Path) -> None:
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from refitplane.trainer.layouts import megatron_shards

    hf = AutoConfig.from_pretrained(sc["hf_dir"])
    sd = load_file(str(Path(sc["hf_dir"]) / "model.safetensors"))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sc["tp"],
        pipeline_model_parallel_size=sc["pp"],
        expert_model_parallel_size=sc["ep"],
        expert_tensor_parallel_size=sc["etp"],
        virtual_pipeline_model_parallel_size=sc["vpp"],
    )
    try:
        chunks = build_chunks(hf, sc)
        for chunk in chunks:
            Loader(chunk.module, sd, hf).load(chunk.module)  # type: ignore[arg-type]
        model: Any = chunks if sc["vpp"] else chunks[0]
        shards = megatron_shards(model, hf)
        storages = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        for sv in shards:
            assert sv.tensor.untyped_storage().data_ptr() in storages, (
                f"{sv.spec.name} {sv.box} is not a view of a model parameter"
            )
        check_mismatches_are_refused(model, hf)
        target = out_dir / sc["name"]
        target.mkdir(parents=True, exist_ok=True)
        save_pieces(target / f"rank{rank}.pt", rank, shards)
    finally:
        ps.destroy_model_parallel()


def main() -> None:
    out_dir, scenarios = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank, _ = init_from_env()
    for sc in scenarios:
        run_scenario(sc, rank, out_dir)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
