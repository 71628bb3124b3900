"""Context-parallel attention on real ranks, for tests/test_context.py.

    torchrun --nproc-per-node N tests/context_worker.py OUT
        every rank makes the same seeded whole q, k, v and upstream gradient, takes its shard, runs
        nanomega.parallel.context.attention with each method and backward, and the cp group's first
        rank writes OUT/<layout>-<case>-<method>-<kernel>.pt: {"q", "k", "v", "grad_out" (whole inputs),
        "out", "dq", "dk", "dv" (whole, unsharded)} or {"error": traceback}. Kernels: "device" (the CPU's
        fused flash kernel per block, what a run takes) and "plain" (matmul and exp per block, the fallback
        for dtypes and devices without a fused kernel).

    torchrun --nproc-per-node N tests/context_worker.py OUT documents
        the same with packed documents (tests/test_document_mask_cp.py): for each of DOCUMENTS' layouts of the
        rows, OUT/<layout>-<case>-<method>-<kernel>-<documents>.pt, with "opens" [B, T] (where each row's
        documents open) beside the whole inputs and results, and "calls" [cp]: each cp rank's calls of the
        CPU's fused kernel in the forward (the blocks it ran).

Layouts (N = 4 in the tests: one launch covers both): cp=N over the world, and with 4 processes
cp=2 as the first dim of a (cp, dp) = (2, 2) mesh, whose groups {0, 2} and {1, 3} have group ranks
unlike their global ranks (each dp row computes the same thing; rank 0 writes).
"""
from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanomega.parallel.context import (attention, documents_of, kernels_of, load_balanced_order,  # noqa: E402
                                       shard_indices)

# B, H, Hkv, T, Dqk, Dv, softmax scale (None: Dqk ** -0.5), dtype
CASES = {
    "gqa": (2, 4, 2, 16, 8, 8, None, torch.float64),
    "mla": (2, 4, 4, 16, 12, 6, 0.3, torch.float64),        # value heads narrower than query/key heads
    "mqa_wide_v": (1, 4, 1, 16, 6, 10, None, torch.float64),  # one kv head, value heads wider
    "gqa_fp32": (2, 4, 2, 16, 8, 8, None, torch.float32),
    "gqa_bf16": (2, 4, 2, 16, 8, 8, None, torch.bfloat16),
}
METHODS = ("all_gather", "ring")
KERNELS = {"device": None, "plain": "plain"}   # name -> kernels_of's device (None: the tensors')


def opening(T: int, *rows) -> torch.Tensor:
    """[len(rows), T] bool: row i opens a document at each position rows[i] lists."""
    opens = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, at in enumerate(rows):
        opens[i, list(at)] = True
    return opens


# where the two rows' documents open (T = 16; cp 4: 8 chunks of 2 tokens, cp 2: 4 chunks of 4)
DOCUMENTS = {
    "spanning": opening(16, (0, 5, 11), (3,)),                  # documents across chunks and ranks
    "short": opening(16, range(0, 16, 2), range(1, 16, 3)),     # many short ones, cut elsewhere in each row
    "per_row": opening(16, (), (8,)),                           # a row that is one document, one that is two
    "one": opening(16, (0,), ()),                               # every row one document: the causal plan
    "singletons": torch.ones(2, 16, dtype=torch.bool),          # every token its own: the diagonal only
}
DOCUMENT_CASES = ("gqa", "mla", "gqa_bf16")          # B = 2 each


def document_runs(layouts) -> list[tuple]:
    """(layout, case, method, kernel, packing) of the packed documents' runs: every packing for GQA on the fused
    kernel; the plain kernel, MLA's narrower value heads and bfloat16 on two (a document across chunks and ranks,
    rows packed unlike each other), which cover their own code paths (the kernel, the padding, the rounding)."""
    return [(layout, case, method, kernel, packing) for layout in layouts for case in DOCUMENT_CASES
            for method in METHODS for kernel in KERNELS for packing in DOCUMENTS
            if (case, kernel) == ("gqa", "device") or packing in ("spanning", "per_row")]


def inputs(case: str) -> dict:
    B, H, Hkv, T, Dqk, Dv, _, dtype = CASES[case]
    gen = torch.Generator().manual_seed(sorted(CASES).index(case))
    shapes = {"q": (B, H, T, Dqk), "k": (B, Hkv, T, Dqk), "v": (B, Hkv, T, Dv), "grad_out": (B, H, T, Dv)}
    return {n: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for n, s in shapes.items()}


class KernelCalls(TorchDispatchMode):
    """Counts the calls of the CPU's fused attention kernel (forward) while it is active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        return func(*args, **(kwargs or {}))


def run(case: str, method: str, kernel: str, group, cp: int, rank: int, opens=None) -> dict:
    whole = inputs(case)
    held = shard_indices(whole["q"].shape[2], cp, rank)
    local = {n: x.index_select(2, held) for n, x in whole.items()}
    q, k, v = (local[n].clone().requires_grad_() for n in "qkv")
    documents, calls = None if opens is None else documents_of(opens), KernelCalls()
    with kernels_of(KERNELS[kernel]) if KERNELS[kernel] else contextlib.nullcontext():
        with calls:
            out = attention(q, k, v, load_balanced_order(whole["q"].shape[2], cp).view(cp, -1), group, method,
                            CASES[case][6], documents)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), local["grad_out"])
    result = dict(whole) if opens is None else {**whole, "opens": opens}
    if opens is not None:
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(cp)]
        dist.all_gather(counts, torch.tensor([calls.n]), group=group)
        result["calls"] = torch.cat(counts)
    for name, t in {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}.items():
        pieces = [torch.empty_like(t) for _ in range(cp)]
        dist.all_gather(pieces, t.contiguous(), group=group)
        in_rank_order = torch.cat(pieces, 2)          # every rank's positions, rank after rank: back to 0..T-1
        result[name] = in_rank_order.index_select(2, torch.argsort(load_balanced_order(in_rank_order.shape[2], cp)))
    return result


def main(out_dir: str, documents: bool = False) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    layouts = {f"cp{world}": (dist.group.WORLD, world, rank)}
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp"))
        layouts["cp2mesh"] = (mesh.get_group("cp"), 2, mesh.get_local_rank("cp"))
    runs = document_runs(layouts) if documents else [(layout, case, method, kernel, "") for layout in layouts
                                                     for case in CASES for method in METHODS for kernel in KERNELS]
    for layout, case, method, kernel, packing in runs:
        group, cp, cp_rank = layouts[layout]
        try:
            result = run(case, method, kernel, group, cp, cp_rank, DOCUMENTS[packing] if packing else None)
        except Exception:
            result = {"error": traceback.format_exc()}
        if rank == 0:
            name = f"{layout}-{case}-{method}-{kernel}" + (f"-{packing}" if packing else "")
            torch.save(result, Path(out_dir) / f"{name}.pt")
    dist.barrier()     # no rank tears gloo down while another still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["documents"])
