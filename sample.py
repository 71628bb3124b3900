"""Sample text from a checkpoint.

    python sample.py                                   # latest checkpoint in runs/default
    python sample.py --out_dir=runs/x --prompt="class " --tokens=300 --temperature=0.7 --top_k=40
    python sample.py --ckpt=runs/x/ckpt-00000500
    python sample.py --out_dir=runs/chat --prompt="Hello" --stop="User:"    # also ends at the text "User:"

Generation ends at the run tokenizer's EOS and the end-of-turn ids its folder names (tokenizer.stop_ids: what
transformers' generate stops at), and at each --stop string; the text printed ends before them.
"""
from __future__ import annotations

import argparse
import sys

import torch

from nanomega import checkpoint
from nanomega.config import from_dict
from nanomega.data.tokenizer import load_run_tokenizer
from nanomega.eval.generate import finish, sample, stopper
from nanomega.models import init


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out_dir", default="runs/default", help="run directory; its latest checkpoint is used")
    ap.add_argument("--ckpt", default="", help="a specific checkpoint directory (overrides --out_dir)")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top_k", type=int, default=40)
    ap.add_argument("--num_samples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="end generation at this text (repeatable)")
    args = ap.parse_args()

    path = args.ckpt or checkpoint.latest(args.out_dir)
    if not path:
        ap.error(f"no checkpoint in {args.out_dir}; train first (python train.py) or pass --ckpt")
    cfg = from_dict(checkpoint.read_meta(path)["config"])
    if checkpoint.read_meta(path).get("world_size", 1) > 1:   # written by a torchrun job: one file per rank
        from nanomega.parallel.gather_checkpoint import whole_params
        params, meta = whole_params(path)
    else:
        params, _, meta = checkpoint.load(path, init(cfg.model, device="meta"))
    try:
        tok = load_run_tokenizer(path, meta.get("tokenizer"))   # <out_dir>/tokenizer, checked against the checkpoint
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    prompt = torch.tensor([tok.encode(args.prompt)] * args.num_samples)
    gen = torch.Generator().manual_seed(args.seed)
    stop = stopper(tok.stop_ids, args.stop, tok.decode)
    out = sample(params, cfg.model, prompt, args.tokens, args.temperature, args.top_k, gen, stop=stop)
    print(f"# {path} (step {meta['step']})")
    n = prompt.shape[1]
    for row in out.tolist():
        print(finish(row[:n], row[n:], tok.decode, tok.stop_ids, args.stop), end="\n" + "-" * 40 + "\n")


if __name__ == "__main__":
    main()
