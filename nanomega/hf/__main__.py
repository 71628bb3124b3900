"""python -m nanomega.hf export RUN_OR_CHECKPOINT OUT [--shard-gb G] [--dtype D] (hf/transfer.py)."""
import sys

import torch

from nanomega.hf.transfer import main

torch.set_grad_enabled(False)
sys.exit(main(sys.argv[1:]))
