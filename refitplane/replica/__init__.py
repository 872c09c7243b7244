"""The replica controller: the member that drives one vLLM replica through refits. Neither
role owns it: the generator's `refit-sidecar` runs it next to a vLLM server (or an in-process
`LLM`), and the trainer's vLLM-API engine runs it on trainer rank 0 over vLLM's weight-sync
client (`WeightTransferTrainerFactory`, backend "refitplane").

    control        EngineControl (the verbs a controller drives), call_verb, wait_replica_ranks
    controller     SidecarMember (the controller's command handler)
    state          SidecarState: what the controller knows of its replica between commands
    ranks_verified RanksVerifiedWait: the replica's ranks and the wait for them to verify
    engine_steps   EngineSteps: the engine verbs around a transfer (wake, close, release,
                   the verbs after vLLM's finish) and the staging gauge
    told           StreamNews: RanksVerified / AbortRefit, told at once to a waiting StartTransfer
    vllm_backend   the backend name "refitplane" and its registration with vLLM's factories
    background     BackgroundCaller: the thread that makes the pre-armed update
"""

from refitplane.replica.control import EngineControl, call_verb, wait_replica_ranks
from refitplane.replica.controller import SidecarMember
from refitplane.replica.state import SidecarState

__all__ = ["EngineControl", "SidecarMember", "SidecarState", "call_verb", "wait_replica_ranks"]
