"""Count the collectives of one train step per layout, with DTensor's CommDebugMode.

    torchrun --nproc-per-node N tests/comm_worker.py OUT CASES_JSON
        runs each case {"name", "args"} (args on top of tests/parity.py's BASE) on one process group and
        writes OUT/<name>.pt on rank 0: {phase: {"counts": {op: n}, "calls": [...]}} or {"error": traceback}

The phases of one step, each counted on its own:
    forward   one micro-batch's loss, as the step computes it (batch placed, parameters gathered for compute)
    grads_1   fns.grads over 1 micro-batch: forward + backward + what happens once per step
    grads     fns.grads over train.grad_accum micro-batches
    update    fns.update: the optimizer
`counts` is CommDebugMode.get_comm_counts() keyed by the op's short name (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, ...); `calls` lists every collective as
"op shape where" (where: the innermost nanomega line, or "backward" inside the autograd engine), for
failure messages. tests/test_comm_counts.py launches it and derives what each count must be.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parity import BASE, batches                              # noqa: E402
from nanomega.config import parse_args                      # noqa: E402
from nanomega.models import loss_fn                           # noqa: E402
from nanomega.models.transformer import units                  # noqa: E402
from nanomega.train.step import make_runner, make_step_fns, step_options   # noqa: E402
import train                                                  # noqa: E402


COMPUTE = {torch.ops.aten.mm.default: "mm", torch.ops.aten.embedding.default: "embedding"}


class CommLog(CommDebugMode):
    """CommDebugMode that also remembers each collective's input shape and the code that issued it,
    and the order in which collectives and the model's matmuls (and embedding lookups) are issued.
    It counts the in-place functional all-reduce (the step's gradient buckets) as an all-reduce."""

    def __init__(self):
        super().__init__()
        self.comm_registry.add(torch.ops._c10d_functional.all_reduce_)
        self.calls, self.order = [], []
        self.gathered = []     # (dtype, bytes sent) of every all-gather

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.get_comm_counts().values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.get_comm_counts().values()) > before:
            shape = next((tuple(a.shape) for a in args if isinstance(a, torch.Tensor)), ())
            where = self._where()
            self.calls.append(f"{func._overloadpacket.__name__} {list(shape)} {where}")
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if func._overloadpacket.__name__.startswith("all_gather") and first is not None:
                self.gathered.append((str(first.dtype), first.numel() * first.element_size()))
            self.order.append((func._overloadpacket.__name__.rstrip("_"), where == "backward"))
        elif out is not NotImplemented and func in COMPUTE:
            self.order.append((COMPUTE[func], torch._C._current_graph_task_id() != -1))
        return out

    @staticmethod
    def _where() -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        frames = [f for f in traceback.extract_stack() if f"{os.sep}nanomega{os.sep}" in f.filename]
        return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"

    def result(self) -> dict:
        counts = {}
        for op, n in self.get_comm_counts().items():
            name = str(op).split(".")[-1].rstrip("_")
            counts[name] = counts.get(name, 0) + n
        return {"counts": {op: n for op, n in counts.items() if n}, "calls": self.calls, "order": self.order,
                "gathered": self.gathered}


def measure(argv: list[str]) -> dict:
    cfg = parse_args(BASE + argv)
    torch.manual_seed(cfg.train.seed)
    model_cfg, params, opt, par = train.setup(cfg, torch.device("cpu"))
    state = opt.init(params)
    fns = make_step_fns(model_cfg, opt, par=par, **{**step_options(cfg.train), "compile": False})
    micro = batches(cfg, 0)
    out = {}
    with par.context(), par.prefetching(units(params, model_cfg)):
        with CommLog() as log:
            x, y = par.batch(*micro[0])
            loss_fn(params, x, y, model_cfg, make_runner(par=par))
    out["forward"] = log.result()
    with CommLog() as log:
        fns.grads(params, micro[:1])
    out["grads_1"] = log.result()
    with CommLog() as log:
        _, grads, _ = fns.grads(params, micro)
    out["grads"] = log.result()
    with CommLog() as log:
        fns.update(grads, state, params)
    out["update"] = log.result()
    return out


def main(out_dir: str, cases_json: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for case in json.loads(cases_json):
        try:
            result = measure(case["args"])
        except Exception:
            result = {"error": traceback.format_exc()}
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{case['name']}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
