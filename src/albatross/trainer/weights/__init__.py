"""Weight transports: how the trainer's new weights reach the engines (``engine.weight_sync``).

``base.py`` (the protocol and the factory), ``filesystem.py`` (safetensors in a versioned directory, reloaded by
path; every engine), ``nccl.py`` (broadcast from the trainer's rank 0 into the vLLM / SGLang servers'
weight-update group; CUDA). Torch is imported only inside the senders.
"""

from albatross.trainer.weights.base import WeightSender, make_weight_sender

__all__ = ["WeightSender", "make_weight_sender"]
