"""Evaluation and generation: validation loss and multiple-choice tasks (evaluate.py;
`python -m nanomega.eval --run R --tasks a.jsonl`), sampling with a KV cache (generate.py), and the
lm-evaluation-harness adapter (lm_eval_adapter.py)."""
