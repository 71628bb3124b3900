"""The parity harness: the same tiny model, data and seed, trained serially and on a mesh.

    run(argv)                                   # in-process: one layout on this process group (or serially)
    torchrun --nproc-per-node N tests/parity.py OUT CASES_JSON
        runs each case {"name", "args", "kind"} on one process group and writes OUT/<name>.pt on rank 0:
        {"losses": [...], "grad_norms": [...], "params": {name: whole tensor}} or {"error": traceback}
    kind "train" (default): forward, backward and update, as train.py runs them (train.compile and
        train.dtype as the args say); grad_norms: the global gradient norm of every step, before clipping;
    kind "optimizer": the update alone on seeded gradients ("losses" are then the gradient norms).

tests/test_parallel.py launches it and compares every case with the serial run of the same args.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanomega import optim                                     # noqa: E402
from nanomega.config import parse_args                      # noqa: E402
from nanomega.train.step import make_step_fns, step_options                       # noqa: E402
from nanomega.tree import named_leaves, tree_flatten, tree_leaves, tree_unflatten   # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor       # noqa: E402
import train                                                  # noqa: E402

# GQA (4 heads, 2 kv heads), a vocabulary (251) that tp=2 must pad, two micro-batches per step.
BASE = ["--model.vocab_size=251", "--model.vocab_multiple=1", "--model.d_model=32", "--model.n_layers=2",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.max_seq_len=16",
        "--train.batch_size=4", "--train.seq_len=16", "--train.grad_accum=2", "--train.steps=3",
        "--train.compile=false", "--train.device=cpu", "--optim.warmup_steps=1", "--optim.lr=0.003",
        # each optimizer's own settings, read when it is chosen (--optim.NAME.KEY: nanomega/optim/registry.py)
        "--optim.muon.ns_dtype=float32", "--optim.shampoo.precondition_frequency=1",
        "--optim.shampoo.start_preconditioning_step=1", "--optim.soap.precondition_frequency=1"]


def batches(cfg, step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    t = cfg.train
    x = torch.randint(0, cfg.model.vocab_size, (t.grad_accum, t.batch_size, t.seq_len + 1), generator=gen)
    return [(m[:, :-1], m[:, 1:]) for m in x]


def halves(micro: list) -> list:
    """Each micro-batch as two of half the size: the same tokens and the same mean loss, summed in
    another order (the serial run's own rounding, to size a tolerance against)."""
    return [(x[i:i + len(x) // 2], y[i:i + len(x) // 2]) for x, y in micro for i in (0, len(x) // 2)]


def run(argv: list[str], split: bool = False, jitter: int = 0) -> dict:
    """Train BASE + argv for train.steps steps; the losses, the gradient norms and the whole final
    parameters. split: every micro-batch halved (one process only; see `halves`). jitter: every initial
    parameter entry moved by about one ulp up or down (times 1 +- 2^-23), drawn from generator seed `jitter`
    (one process only; see `jittered`)."""
    cfg = parse_args(BASE + argv)
    torch.manual_seed(cfg.train.seed)
    model_cfg, params, opt, par = train.setup(cfg, torch.device("cpu"))
    if jitter:
        params = jittered(params, jitter)
    state = opt.init(params)
    fns = make_step_fns(model_cfg, opt, par=par, **step_options(cfg.train))
    losses, norms = [], []
    for step in range(cfg.train.steps):
        micro = batches(cfg, step)
        loss, grads, stats = fns.grads(params, halves(micro) if split else micro)
        params, state = fns.update(grads, state, params, stats)
        losses.append(loss.item())
        # every step's: a gradient off by a constant factor (a missing 1 / dp) leaves AdamW's and Muon's
        # updates, hence losses and parameters, almost unchanged (both are scale-invariant), not the norm
        norms.append(optim.grad_norm(state).item())
    # what the most loaded rank holds between steps: parameters, gradients as the optimizer receives them, state
    held = torch.tensor([local_bytes(params), local_bytes(grads), local_bytes(state)], dtype=torch.float64)
    if par is not None:
        torch.distributed.all_reduce(held, op=torch.distributed.ReduceOp.MAX)
    transfers = None
    from nanomega.parallel.pipeline import Pipeline
    if isinstance(par, Pipeline):   # what each rank posted in the last step, matched to the program by the test
        transfers = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(transfers, [[tuple(t) for t in batch] for batch in par.transfers])
    if isinstance(par, Pipeline):   # every parameter whole on rank 0, the rank that saves the results
        whole = par.full_on_main(params) or {}
    else:
        whole = params if par is None else par.full(params)
    vocab = cfg.model.vocab_size   # tensor parallel may have padded the vocabulary: compare the real rows
    out = {n: (p[:vocab] if n in ("tok_embed.weight", "lm_head.weight") else p).detach().clone()
           for n, p in named_leaves(whole).items()}
    return {"losses": losses, "grad_norms": norms, "params": out, "bytes": held.tolist(), "transfers": transfers}


def jittered(params, seed: int):
    """Each entry times 1 +- 2^-23 (an ulp of fp32) at random: the last-bit differences a layout's partial sums
    leave in what it computes, put into the serial run (to size a tolerance against what they do downstream)."""
    gen = torch.Generator().manual_seed(seed)
    leaves, spec = tree_flatten(params)
    signs = [2 * torch.randint(0, 2, p.shape, generator=gen) - 1 for p in leaves]
    moved = [(p.detach() * (1 + 2.0 ** -23 * s)).requires_grad_(True) for p, s in zip(leaves, signs)]
    return tree_unflatten(moved, spec)


def local_bytes(tree) -> int:
    return sum((x.to_local() if isinstance(x, DTensor) else x).nbytes for x in tree_leaves(tree))


def run_optimizer(argv: list[str]) -> dict:
    """The optimizer alone, fed the same seeded gradients in every layout (as if already reduced):
    no forward or backward rounding differs, so any difference is the parallel optimizer's own."""
    cfg = parse_args(BASE + argv)
    torch.manual_seed(cfg.train.seed)
    model_cfg, params, opt, par = train.setup(cfg, torch.device("cpu"))
    state = opt.init(params)
    fns = make_step_fns(model_cfg, opt, par=par)
    vocab, norms = cfg.model.vocab_size, []
    for step in range(cfg.train.steps):
        gen = torch.Generator().manual_seed(2000 + step)
        grads = {}
        for n, p in named_leaves(params).items():
            if n in ("tok_embed.weight", "lm_head.weight"):   # padding rows get no gradient, as in training
                g = torch.randn(vocab, p.shape[1], generator=gen)
                g = torch.nn.functional.pad(g, (0, 0, 0, p.shape[0] - vocab))
            else:
                g = torch.randn(p.shape, generator=gen)
            grads[n] = g * 1e-2 if par is None else distribute_tensor(g * 1e-2, par.layouts[n].mesh,
                                                                       par.layouts[n].optimizer, src_data_rank=None)
        _, spec = tree_flatten(params)
        params, state = fns.update(tree_unflatten(list(grads.values()), spec), state, params)
        norms.append(optim.grad_norm(state).item())
    whole = params if par is None else par.full(params)
    out = {n: (p[:vocab] if n in ("tok_embed.weight", "lm_head.weight") else p).detach().clone()
           for n, p in named_leaves(whole).items()}
    return {"losses": norms, "params": out}


RUNNERS = {"train": run, "optimizer": run_optimizer}


def main(out_dir: str, cases_json: str) -> None:
    faulthandler.enable()       # a rank that dies in native code (SIGABRT, SIGSEGV) prints where it was
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for case in json.loads(cases_json):
        start = time.perf_counter()
        try:
            result = RUNNERS[case.get("kind", "train")](case["args"])
        except Exception:
            result = {"error": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - start     # what each case costs the launch (docs/testing.md)
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{case['name']}.pt")
    torch.distributed.barrier()     # no rank tears gloo down while another still works (aborts at exit)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
