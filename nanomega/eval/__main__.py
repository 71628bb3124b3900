"""python -m nanomega.eval --run RUN --tasks a.jsonl,b.jsonl (eval/evaluate.py)."""
import sys

from nanomega.eval.evaluate import main

main(sys.argv[1:])
