"""Deferred gradients: a reduce-scatter's result handed on without waiting for it.

A functional collective (torch.distributed._functional_collectives) starts when it is called and is waited for
at the first op that reads its result (an AsyncCollectiveTensor), as FSDP2 runs its reduce-scatters on a side
stream. FSDP's backward reduce-scatters a unit's gradients as soon as autograd has them all (parallel/fsdp.py);
what it hands back must not be read there, or the backward waits for the collective with nothing to overlap it.
But a plain op on the result *is* a read: the cast back from train.reduce_dtype to the shard's dtype, or the sum
of a micro-batch's gradient with the earlier micro-batches', would wait at once. A `Deferred` is a tensor whose
value is such an op, computed at its first use by any op (the next unit's reduce-scatter, the next micro-batch's
sum, the gradient reducer, the optimizer), so handing it to autograd, into a DTensor or to a gradient hook runs
nothing.

    InFlight     one reduce-scatter is left in flight (FSDP2's): the next unit's backward computes the previous
                 one's Deferred gradients before it packs its own, so its input, the unit's whole gradients, is
                 freed then and no more than one unit's gradients wait in reduce_dtype;
    add_into     under gradient accumulation each micro-batch's reduced shard is added to the earlier
                 micro-batches' sum, in that sum's buffer, where its reduce-scatter is waited (the next unit's
                 launch, by InFlight; the embedding's at the next micro-batch's first): the shard is dropped there,
                 so the step holds one set of gradient shards and the one unit's in flight, not a micro-batch's
                 whole set beside the sum (2026-12-04: 10.5 GiB of Mixtral's FSDP 16 peak, docs/memory.md);
    divide_in_place, add_in_place, accumulate  the other sums of train/step.py's GradientSums (each says which);
    resolved, waited  the value computed: for code that may be compiled; of any pending tensor.

memory_tracker lets a Deferred compute itself (`unwraps_itself`), so its schedule sees the wait where it happens.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor


def waited(t: torch.Tensor) -> torch.Tensor:
    """t's value: a Deferred computed, a pending collective's result waited for; anything else as it is."""
    if isinstance(t, Deferred):
        return t.materialize()
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class Deferred(torch.Tensor):
    """A tensor computed at its first use by any op, `compute(source)`, where `source` is a pending
    collective's result (funcol's AsyncCollectiveTensor): a reduce-scatter's gradient shard cast to the shard's
    dtype (`cast_back`), a micro-batch's gradient added to the earlier ones' sum (`add_into`, `accumulate`)."""

    unwraps_itself = True

    @staticmethod
    def __new__(cls, compute, source: torch.Tensor, dtype: torch.dtype):
        r = torch.Tensor._make_wrapper_subclass(cls, source.shape, dtype=dtype, device=source.device)
        r.compute, r.source = compute, source
        return r

    def materialize(self) -> torch.Tensor:
        """The value (computed once; the pending result is dropped then)."""
        if self.compute is not None:
            self.source, self.compute = self.compute(self.source), None
        return self.source

    def __tensor_flatten__(self):
        return ["source"], None

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Deferred({self.materialize()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = torch.utils._pytree.tree_map_only(Deferred, Deferred.materialize, (args, kwargs or {}))
        return func(*args, **kwargs)


def cast_back(pending: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A reduce-scatter's result in the shard's dtype (a Deferred's `compute`; a view where the dtypes agree)."""
    return waited(pending).to(dtype)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _with_local(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return DTensor(local, t._spec, requires_grad=False) if isinstance(t, DTensor) else local


def resolved(t: torch.Tensor) -> torch.Tensor:
    """t with its value computed, if it is (a DTensor of) a Deferred: what to hand to code that may be
    compiled (the optimizer's update)."""
    return _with_local(t, local_of(t).materialize()) if isinstance(local_of(t), Deferred) else t


def accumulate(total: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """total + g: a micro-batch's gradient added to the earlier micro-batches' sum (nanomega/train/step.py).
    Where g is a reduce-scatter still in flight (FSDP's last unit of the micro-batch: InFlight has computed
    the others), the sum is deferred to its first use (the next micro-batch's sum, or the reducer): add_into's
    case where it cannot write in place (total not a Deferred's: a tied weight's, whose two gradients autograd
    added). The same elementwise sum of the same local tensors as DTensor's (placements equal), so the same numbers."""
    pending = local_of(g)
    if (not isinstance(pending, Deferred) or pending.compute is None or not isinstance(total, DTensor)
            or (total.placements, total.dtype) != (g.placements, g.dtype)):
        return total + g
    earlier = waited(total._local_tensor)   # computed by now: its micro-batch's collective is long done
    return _with_local(g, Deferred(lambda p: earlier + p, pending, g.dtype))


def add_into(total: torch.Tensor, g: torch.Tensor, n: int = 1) -> bool:
    """Make g, a micro-batch's gradient, the running sum total + g (divided by n: the last micro-batch's, the
    step's mean), written into total's buffer when g's reduce-scatter is waited (module doc), and say whether it
    did: it can where g is a reduce-scatter still in flight (a Deferred not computed yet: called from a gradient
    hook, as autograd hands the unit's gradients over) and total is a Deferred's value (an earlier micro-batch's
    shard, or such a sum), with the same placements, dtype and shape. Then g's value *is* the sum (total's
    buffer), and total must not be read as the earlier sum again. The same numbers as (total + g) / n: g cast
    to the shard's dtype (cast_back), added element by element (total's elements first), then divided."""
    pending, earlier = local_of(g), local_of(total)
    if (not isinstance(pending, Deferred) or pending.compute is None or not isinstance(earlier, Deferred)
            or not isinstance(total, DTensor) or not isinstance(g, DTensor)
            or (total.placements, total.dtype, total.shape) != (g.placements, g.dtype, g.shape)):
        return False
    pending.compute = functools.partial(_added_into, earlier, n=n)
    return True


def divide_in_place(g: torch.Tensor, n: int) -> bool:
    """Make g, a reduce-scatter still in flight (a Deferred not computed yet), its value divided by n in its own
    buffer where it is waited, and say whether it could: the step's gradient of a unit whose sum over the
    micro-batches was reduce-scattered once (parallel/fsdp.py OncePerStep), divided without a second copy."""
    pending = local_of(g)
    if not isinstance(pending, Deferred) or pending.compute is None:
        return False
    compute = pending.compute
    pending.compute = lambda p: compute(p).div_(n)
    return True


def storage_of(t: torch.Tensor) -> int:
    """Which storage t's values (a DTensor's local tensor's) live in: the same for every view of them (fake
    tensors have one too); 0 for an empty tensor or a tensor subclass with no storage of its own (a Deferred, an
    all-to-all's pending AsyncCollectiveTensor)."""
    local = local_of(t)
    if isinstance(local, Deferred) or not local.numel():
        return 0
    try:
        return local.untyped_storage()._cdata
    except RuntimeError:
        return 0


def add_in_place(total: torch.Tensor, g: torch.Tensor, n: int = 1) -> bool:
    """total += g, then total /= n, in total's own buffer, and say whether it could: both plain tensors, or
    DTensors of plain tensors with the same placements, the same dtype and shape, total dense (a gradient
    autograd made may be a broadcast's stride-0 view), g computed (not a reduce-scatter in flight: add_into's).
    The caller knows that no other tensor shares total's buffer (nanomega/train/step.py GradientSums). The same
    numbers as (total + g) / n out of place: the same elementwise operations."""
    a, b = local_of(total), local_of(g)
    if (isinstance(total, DTensor) != isinstance(g, DTensor) or isinstance(a, Deferred)
            or (isinstance(b, Deferred) and b.compute is not None)
            or (total.dtype, total.shape) != (g.dtype, g.shape) or not a.is_contiguous()
            or (isinstance(total, DTensor) and total.placements != g.placements)):
        return False
    a.add_(b)
    if n > 1:
        a.div_(n)
    return True


def _added_into(earlier: Deferred, pending: torch.Tensor, n: int) -> torch.Tensor:
    buffer = earlier.materialize().add_(cast_back(pending, earlier.dtype))
    return buffer.div_(n) if n > 1 else buffer


class InFlight:
    """The one reduce-scatter left in flight (module doc): `settle` computes its Deferred gradients, rather than
    their being held until the optimizer reads the shards; FSDP's backward settles the previous unit's before it
    packs its own, so the previous result is dropped (added into the sum) before the next buffers are made, with
    the same compute between its launch and its wait. Weak references: a gradient already read (and so
    computed) is not kept alive by it."""

    def __init__(self):
        self.last = []

    def settle(self) -> None:
        for ref in self.last:
            if (previous := ref()) is not None:
                previous.materialize()
        self.last = []

    def replace(self, results: list) -> None:
        self.settle()
        self.last = [weakref.ref(r) for r in results]
