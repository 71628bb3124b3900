"""Gathering a unit again for its backward: after a reshard (Regather) or for a recomputation (RecomputedGather).

What a unit's backward needs of its gathered parameters (a matmul saves its weight to compute the input's
gradient) would keep every gathered unit alive from its forward to its backward: at the start of the backward,
the whole model. FSDP2 frees them after the forward (reshard_after_forward, its default) with module hooks; the
model here is functions, so `Regather` does it with torch.autograd.graph's saved-tensor hooks around the unit:

    pack    a saved tensor that views a gathered parameter (found by its storage: every view of one tensor,
            a transpose, a slice, a DTensor's local tensor, shares its storage, `_cdata`) is stored as
            (bucket, parameter, its view's size, stride and offset in it), not as the tensor;
    unpack  the first time the backward needs a view of a bucket, the bucket is gathered again (one
            collective, launched ahead by the prefetch where it could be), and each parameter is dropped
            when its last saved view has been used (a count per parameter, from the packs).

Held between forward and backward: the shards only. A parameter needed again after it was dropped (the
zero-bubble pipeline's backward in two passes over one graph: the input's gradient, later the weights') is
gathered once more and kept from then on.

Under activation recomputation the unit is not saved at all: its forward runs again in the backward and gathers
again there. That gather must be launched outside the recomputed region, ahead of it, as the forward's was:
selective recomputation replays the forward's saved ops by position (a float8 gather's amax all-reduce is one),
so the recomputation must run the same ops, and only unpack. `RecomputedGather` holds what the forward gathered
and the gathers launched for the recomputation; the per-unit gather (parallel/fsdp.py) tells the recomputation
from the forward by autograd's graph task (`torch._C._current_graph_task_id()` is -1 outside a backward).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from nanomega.parallel.deferred import local_of, storage_of
from nanomega.parallel.packing import Bucket


class Regather(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks under which a unit's gathered parameters are not kept for its backward but
    gathered again (module doc). `track(key, bucket, shards, gathered)` registers each bucket's gather;
    `prefetch` launches the gathers again ahead of the backward (parallel/fsdp.py's Prefetch)."""

    def __init__(self, launch):
        self.launch = launch                # (bucket, shards) -> pending
        self.forward_storages = {}          # storage -> (bucket, shards, i, gathered local), while the unit runs
        self.buckets = []                   # (bucket, shards) of each gather, in order
        self.pending, self.regathered, self.launched = {}, {}, {}
        self.gathered_again = set()         # the buckets the backward has gathered again
        super().__init__(self._pack, self._unpack)

    def track(self, key, bucket: Bucket, shards: list, gathered: tuple) -> None:
        """(key: unused here, the saved views name their bucket.)"""
        self.buckets.append((bucket, shards))
        for i, g in enumerate(gathered):
            if address := storage_of(g):
                self.forward_storages[address] = (bucket, shards, i, local_of(g))

    def _needed(self, bucket: Bucket) -> bool:
        return any(self.pending.get((bucket, i)) for i in range(len(bucket.names)))

    def __exit__(self, *exc):
        self.forward_storages = {}    # the forward is over: hold no gathered parameter
        # nor the shards of a bucket none of whose views was saved: the backward never gathers it again,
        # and this object is in a cycle with its hooks (freed by the garbage collector only, and so
        # possibly after the update that replaces those shards)
        self.buckets = [(b, s) for b, s in self.buckets if self._needed(b)]
        return super().__exit__(*exc)

    def prefetch(self):
        """Launch the gather of every bucket whose saved views the backward will need (FSDP2's
        backward prefetch), without waiting for it."""
        for bucket, shards in self.buckets:
            if self._needed(bucket) and bucket not in self.launched and bucket not in self.gathered_again:
                self.launched[bucket] = self.launch(bucket, shards)

    def _pack(self, t: torch.Tensor):
        local = local_of(t)
        found = self.forward_storages.get(storage_of(local))
        if found is None:
            return t
        bucket, shards, i, whole = found
        self.pending[bucket, i] = self.pending.get((bucket, i), 0) + 1
        spec = t._spec if isinstance(t, DTensor) else None
        return bucket, shards, i, spec, local.shape, local.stride(), local.storage_offset() - whole.storage_offset()

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        bucket, shards, i, spec, size, stride, offset = saved
        if (bucket, i) not in self.regathered:   # the first saved view of this unit: gather it all again
            # or a view needed again after its unit was freed (a backward in two passes: module doc)
            again = bucket in self.gathered_again
            self.gathered_again.add(bucket)
            # hold no shard past its use: the hooks refer to this object (a cycle that only the garbage
            # collector breaks), and it must not keep the step's parameters alive after their update
            self.buckets = [(b, s) for b, s in self.buckets if b is not bucket]
            pending = self.launched.pop(bucket, None)
            pending = self.launch(bucket, shards) if pending is None else pending
            with torch.no_grad():
                wholes = bucket.unpack_gather(pending, [s.to_local() for s in shards])
            for j, whole in enumerate(wholes):
                if again or self.pending.get((bucket, j)):
                    self.regathered[bucket, j] = whole
        whole = self.regathered[bucket, i]
        self.pending[bucket, i] -= 1
        if self.pending[bucket, i] == 0:     # its last saved view: free it
            del self.regathered[bucket, i]
        local = whole.as_strided(size, stride, whole.storage_offset() + offset)
        return local if spec is None else DTensor(local, spec, requires_grad=False)   # the saved DTensor again


class RecomputedGather:
    """A recomputed unit's gathers for its recomputation in the backward, launched ahead from outside the
    recomputed region (parallel/fsdp.py's Prefetch), where its forward's were launched too: the recomputed
    function only unpacks (module doc)."""

    def __init__(self, launch):
        self.launch = launch        # (bucket, shards) -> pending
        self.buckets = {}           # bucket key -> (bucket, shards), from the forward
        self.launched = {}          # bucket key -> pending gather

    def track(self, key, bucket: Bucket, shards: list, gathered: tuple) -> None:
        self.buckets[key] = bucket, shards

    def prefetch(self):
        for key, (bucket, shards) in self.buckets.items():
            if key not in self.launched:
                self.launched[key] = self.launch(bucket, shards)

    def take(self) -> dict:
        """The launched gathers, for the recomputation (which launches, inside itself, any not launched)."""
        launched, self.launched, self.buckets = self.launched, {}, {}   # hold no shard past its use
        return launched
