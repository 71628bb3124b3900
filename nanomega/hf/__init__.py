"""Hugging Face interop: our parameter tree to and from `transformers` state dicts and configs (convert.py),
and whole checkpoints out to a folder `from_pretrained` loads, or a folder in as a run's starting weights
(transfer.py; `python -m nanomega.hf export RUN OUT`)."""
