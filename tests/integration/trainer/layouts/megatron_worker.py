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
- Multi-latent attention: its RotaryEmbedding and the router's expert-bias buffers ask
  `torch.cuda.current_device()` for a device (answered "cpu" while building); the MLA
  module takes `HAVE_TE` from an import that succeeds with placeholder classes without
  Transformer Engine (set False); and the local `DotProductAttention` does not accept
  MLA's `k_channels`, so core attention (no parameters) is a stub.
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
    import megatron.core.transformer.multi_latent_attention as mla

    saved_cuda, saved_check = torch.Tensor.cuda, gg.assert_grouped_gemm_is_available
    saved_device, saved_te = torch.cuda.current_device, mla.HAVE_TE
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    gg.assert_grouped_gemm_is_available = lambda: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    mla.HAVE_TE = False
    try:
        yield
    finally:
        torch.Tensor.cuda = saved_cuda  # type: ignore[method-assign]
        gg.assert_grouped_gemm_is_available = saved_check
        torch.cuda.current_device = saved_device
        mla.HAVE_TE = saved_te


class NoCoreAttention(torch.nn.Module):
    """Stands in for core attention (parameterless) where the local one cannot be built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


def is_mla(hf: Any) -> bool:
    return getattr(hf, "kv_lora_rank", None) is not None


def dense_layers(hf: Any) -> set[int]:
    """Qwen3-MoE lists them (mlp_only_layers); DeepSeek has the first k dense."""
    first_k = getattr(hf, "first_k_dense_replace", 0) or 0
    return set(getattr(hf, "mlp_only_layers", None) or []) | set(range(first_k))


def experts_of(hf: Any) -> int:
    return getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None) or 0


def build_chunks(hf: Any, sc: dict[str, Any]) -> list[torch.nn.Module]:
    """This rank's model: one GPTModel, or one per virtual-pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    experts = experts_of(hf)
    moe: dict[str, Any] = {}
    if experts:
        dense = dense_layers(hf)
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
        if getattr(hf, "n_shared_experts", None):  # DeepSeek: shared experts, biased router
            moe |= {
                "moe_shared_expert_intermediate_size": hf.moe_intermediate_size
                * hf.n_shared_experts,
                "moe_router_enable_expert_bias": True,
                "moe_router_score_function": "sigmoid",
            }
    attention: dict[str, Any] = {"kv_channels": hf.head_dim}
    config_class: Any = TransformerConfig
    if is_mla(hf):
        config_class = MLATransformerConfig
        attention = {
            "q_lora_rank": hf.q_lora_rank,
            "kv_lora_rank": hf.kv_lora_rank,
            "qk_head_dim": hf.qk_nope_head_dim,
            "qk_pos_emb_head_dim": hf.qk_rope_head_dim,
            "v_head_dim": hf.v_head_dim,
            "rope_type": "rope",
            "rotary_base": hf.rope_parameters["rope_theta"],
            "layernorm_epsilon": hf.rms_norm_eps,
        }
    cfg = config_class(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
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
        **attention,
        **moe,
    )
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(sc["vpp"] or 1) if sc["vpp"] else [None]:
        # The block spec honours moe_layer_freq (dense and MoE layers) and picks this
        # (virtual) stage's layers.
        spec = get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
        if is_mla(hf):
            for layer_spec in spec.layer_specs:
                layer_spec.submodules.self_attention.submodules.core_attention = NoCoreAttention
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

        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        # The router's expert bias is a buffer but a checkpoint weight all the same.
        self.params |= {
            n: b for n, b in model.named_buffers() if n.endswith("mlp.router.expert_bias")
        }
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

    def mla(self, m: str, src: str) -> None:
        """Every MLA projection is the checkpoint's tensor; the local spec's linears are all
        ColumnParallelLinear (output rows split, heads contiguous) but linear_proj, which
        is RowParallelLinear (input columns split)."""
        a, sa = src + "self_attn.", m + "self_attention."
        column = [
            ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
            ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
        ]
        whole = [("kv_layernorm.weight", "kv_a_layernorm.weight")]
        if self.hf.q_lora_rank is None:
            column.append(("linear_q_proj.weight", "q_proj.weight"))
        else:
            column += [
                ("linear_q_down_proj.weight", "q_a_proj.weight"),
                ("linear_q_up_proj.weight", "q_b_proj.weight"),
            ]
            whole.append(("q_layernorm.weight", "q_a_layernorm.weight"))
        for mine, theirs in column:
            self.put(sa + mine, self.tp_chunk(self.sd[a + theirs], 0, self.tp, self.tp_rank))
        for mine, theirs in whole:
            self.put(sa + mine, self.sd[a + theirs])
        o = self.sd[a + "o_proj.weight"]
        self.put(sa + "linear_proj.weight", self.tp_chunk(o, 1, self.tp, self.tp_rank))

    def layer(self, i: int, number: int) -> None:
        hf, src, m = self.hf, f"model.layers.{number}.", f"decoder.layers.{i}."
        for mine, theirs in (
            ("input_layernorm.weight", "input_layernorm.weight"),
            ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        ):
            self.put(m + mine, self.sd[src + theirs])
        if is_mla(hf):
            self.mla(m, src)
        else:
            self.gqa(m, src)
        if m + "mlp.router.weight" in self.params:
            self.experts(m, src)
        else:
            gate, up = self.sd[src + "mlp.gate_proj.weight"], self.sd[src + "mlp.up_proj.weight"]
            self.put(m + "mlp.linear_fc1.weight", self.fc1(gate, up, self.tp, self.tp_rank))
            down = self.sd[src + "mlp.down_proj.weight"]
            self.put(m + "mlp.linear_fc2.weight", self.tp_chunk(down, 1, self.tp, self.tp_rank))

    def gqa(self, m: str, src: str) -> None:
        hf = self.hf
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
            ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ):
            self.put(m + mine, self.sd[src + theirs])

    def experts(self, m: str, src: str) -> None:
        self.put(m + "mlp.router.weight", self.sd[src + "mlp.gate.weight"])
        if m + "mlp.router.expert_bias" in self.params:
            self.put(
                m + "mlp.router.expert_bias", self.sd[src + "mlp.gate.e_score_correction_bias"]
            )
        if m + "mlp.shared_experts.linear_fc1.weight" in self.params:
            s = src + "mlp.shared_experts."
            gate, up = self.sd[s + "gate_proj.weight"], self.sd[s + "up_proj.weight"]
            fc1 = self.fc1(gate, up, self.tp, self.tp_rank)  # dense TP, not expert TP
            self.put(m + "mlp.shared_experts.linear_fc1.weight", fc1)
            down = self.tp_chunk(self.sd[s + "down_proj.weight"], 1, self.tp, self.tp_rank)
            self.put(m + "mlp.shared_experts.linear_fc2.weight", down)
        per_rank = experts_of(self.hf) // self.ep
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
    if dims.kv_lora_rank is not None:
        wrong += [
            ("kv_lora_rank", replace(dims, kv_lora_rank=dims.kv_lora_rank * 2), par),
            ("q_lora_rank", replace(dims, q_lora_rank=(dims.q_lora_rank or 4) * 2), par),
            (  # one more dense layer than the model has: its layer 1 has experts
                "first_k_dense_replace",
                replace(dims, first_k_dense_replace=dims.first_k_dense_replace + 1),
                par,
            ),
        ]
    if dims.shared_expert_intermediate_size is not None:
        wrong.append(
            (
                "shared_expert_intermediate_size",
                replace(
                    dims, shared_expert_intermediate_size=dims.shared_expert_intermediate_size * 2
                ),
                par,
            )
        )
    for field, bad_dims, bad_par in wrong:
        try:
            megatron_shards(model, bad_dims, bad_par)
            refused: str | None = "nothing (accepted)"
        except LayoutError as exc:
            refused = exc.field
        if refused != field:
            raise AssertionError(f"a wrong {field} was refused for {refused}")


def check_mla_matches_checkpoint_model(model: torch.nn.Module, hf_dir: str) -> None:
    """TP1: the query, key and value Megatron's own MLA code computes (projections, norms,
    rotary embedding) from the converted weights equal those of the transformers model of
    the same checkpoint, bit for bit in float32. So the one-to-one conversion the adapter
    inverts is Megatron's real semantics (including the rotary rows' order)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    captured: dict[str, torch.Tensor] = {}

    def capture(
        module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any
    ) -> Any:
        captured.update(q=q, k=k, v=v)
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), None

    AttentionInterface.register("capture_qkv", capture)
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref.config._attn_implementation = "capture_qkv"
    torch.manual_seed(1)
    x = torch.randn(1, 7, ref.config.hidden_size)
    cos_sin = ref.model.rotary_emb(x, torch.arange(7)[None])
    with torch.no_grad():
        ref.model.layers[0].self_attn(
            hidden_states=x, position_embeddings=cos_sin, attention_mask=None
        )
        # In place (the scenario's pieces are saved by now; a deep copy would have to copy
        # process groups).
        attention = model.decoder.layers[0].self_attention.float()  # type: ignore[union-attr,index]
        with cpu_model_building():
            q, k, v, *_ = attention.get_query_key_value_tensors(x.transpose(0, 1).contiguous())
    for label, mine in (("query", q), ("key", k), ("value", v)):
        theirs = captured[label[0]].permute(2, 0, 1, 3)  # [b, n, s, d] -> Megatron's [s, b, n, d]
        if not torch.equal(mine, theirs):
            raise AssertionError(f"MLA {label} differs: {(mine - theirs).abs().max().item()}")


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
        storages = {
            t.untyped_storage().data_ptr() for c in chunks for t in [*c.parameters(), *c.buffers()]
        }
        for sv in shards:
            assert sv.tensor.untyped_storage().data_ptr() in storages, (
                f"{sv.spec.name} {sv.box} is not a view of a model parameter"
            )
        check_mismatches_are_refused(model, hf)
        target = out_dir / sc["name"]
        target.mkdir(parents=True, exist_ok=True)
        save_pieces(target / f"rank{rank}.pt", rank, shards)
        if sc.get("check_mla") and sc["tp"] == 1:
            check_mla_matches_checkpoint_model(chunks[0].module, sc["hf_dir"])  # type: ignore[arg-type]
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
