"""Export a PyTorch model with dynamic shapes, lower it, validate it at live shapes, track it."""

import logging

# torchao, imported by transformers and executorch, trips a deprecation notice in torch's pytree
# registry at import time, before Hydra configures logging; it says nothing about the user's job.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
