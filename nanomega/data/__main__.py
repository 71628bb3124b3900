"""python -m nanomega.data prepare INPUT... --tokenizer=SPEC --out=DIR (data/prepare.py)."""
import sys

from nanomega.data.prepare import main

sys.exit(main(sys.argv[1:]))
