"""Data: token sources (sources.py), token files in their published layouts (formats.py), tokenizers
(tokenizer.py), `python -m nanomega.data prepare` (prepare.py) and the batch sampler (sampler.py).

This package sits below the config (config/cli.py reads a prepared folder's tokenizer to size the
vocabulary), so it never imports it."""
