"""NCCL's contracts, checked without a GPU: every rank's real step on meta tensors over a fake process group.

    python -m nanomega.sim.contracts --config=tiny_mixtral --parallel.pp=2 --parallel.dp_shard=2 --parallel.ep=2

Every multi-process test runs on gloo, which forgives what NCCL does not (docs/testing.md, "gloo is not
NCCL"). This runs what train.py runs on each rank (setup, two steps, an evaluation, the gather of the model
and the end-of-run sample), one forked process per rank, every tensor a fake one (FakeTensorMode: shapes,
dtypes and devices are real, nothing is allocated) on the meta device, which stands for the rank's GPU: a
fake "cuda" tensor would do, but autograd aborts on one in a CPU-only build ("PyTorch is not linked with
support for cuda devices"), and a CPU tensor is as foreign to a meta one as to a GPU one. Collectives
complete at once on torch's fake process group. A dispatch mode that sees every op checks:

    device     every collective and point-to-point tensor is on the rank's device (NCCL takes nothing
               else; a CPU scalar made with torch.zeros(()) crashes there, gloo takes it)
    groups     every process group is created at setup, and every rank creates the same ones in the same
               order (creating a group is a collective over the whole job: one created by some ranks only,
               or inside a step that ranks reach at different times, hangs NCCL)
    transfers  the k-th send from rank a to rank b has the shape and dtype of the k-th receive of b from a
               (NCCL matches them in order, not by tag). That the order completes when a send blocks until
               its receive is posted is proven on the schedule itself (parallel/schedules.check_blocking).
    host syncs each step's reads of a tensor's value on the host (.item(), .tolist(): the queue of GPU work
               drains), counted per phase, within the layout's budget (`host_read_budget`): none, but for
               a mixture of experts' inherent reads (dropless expert parallel's split sizes, the per-expert
               loop of float8 matmuls), one per MoE layer and forward, and document masking's under context
               parallel (where the documents meet plans the attention blocks), one per forward.

What it cannot see: a kernel's speed, real NCCL timeouts, or anything that depends on values (fake tensors
have none: a mixture of experts routes as if balanced, as in nanomega/sim/estimate.py).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanomega.config import parse_args
from nanomega.eval.evaluate import sample_text, validation_loss
from nanomega.parallel.mesh import model_config, validate_layout
from nanomega.sim.estimate import _start_child
from nanomega.sim.fake_world import fake_world
from nanomega.train.step import make_step_fns, step_options

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
DEVICE = torch.device("meta")      # the rank's "GPU": autograd aborts on fake CUDA tensors in a CPU-only build


class Contracts(TorchDispatchMode):
    """Records, per phase, what NCCL would refuse or wait on (module doc)."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type, self.phase = device_type, "setup"
        self.off_device = []                         # (phase, op, device)
        self.syncs = collections.Counter()           # phase -> host reads of a value
        self.transfers = []                          # (op, peer, shape, dtype, phase), in posting order
        self.groups = []                             # (phase, ranks) of every group creation call

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        self.phase = phase
        yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.off_device += [(self.phase, str(func), str(t.device)) for t in tensors
                                if t.device.type != self.device_type]
            if func in (torch.ops.c10d.send.default, torch.ops.c10d.recv_.default):
                group = dist.ProcessGroup.unbox(args[1])       # the peer is a rank of this group: as a global rank
                peer = dist.get_global_rank(group, args[2]) if group is not dist.group.WORLD else args[2]
                op = "send" if func is torch.ops.c10d.send.default else "recv"
                self.transfers += [(op, peer, tuple(t.shape), str(t.dtype), self.phase) for t in args[0]]
        if func is torch.ops.aten._to_copy.default and args[0].device.type == self.device_type and \
                torch.device(kwargs.get("device") or args[0].device).type == "cpu":
            self.syncs[self.phase] += 1      # a copy to the host waits for the device (then .tolist() reads the copy)
        if func is torch.ops.aten._local_scalar_dense.default:
            # a value read from the rank's device drains its queue of work; one read from a CPU tensor does not
            self.syncs[self.phase] += args[0].device.type == self.device_type
            if args[0].device.type == "meta" or is_fake(args[0]):
                # no value to read: a stand-in that keeps the step going (a finite loss, a true flag)
                return {torch.bool: True}.get(args[0].dtype, 1 if not args[0].is_floating_point() else 1.0)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording_groups(contracts: Contracts):
    """Every process group creation (DeviceMesh's new_group / split_group, and dist.new_group) in `contracts`."""
    from torch.distributed import device_mesh, distributed_c10d
    patched = []

    def wrap(module, name, ranks_of):
        original = getattr(module, name)

        def creating(*args, **kwargs):
            contracts.groups.append((contracts.phase, ranks_of(*args, **kwargs)))
            return original(*args, **kwargs)
        setattr(module, name, creating)
        patched.append((module, name, original))

    def new_group_ranks(ranks=None, *args, **kwargs):
        return sorted(ranks) if ranks is not None else "world"

    def split_ranks(parent_pg=None, split_ranks=None, *args, **kwargs):
        return sorted(sorted(r) for r in split_ranks)

    for module in (device_mesh, distributed_c10d):
        wrap(module, "new_group", new_group_ranks)
        wrap(module, "split_group", split_ranks)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def check_rank(cfg, rank: int) -> dict:
    """One rank's train.py on the meta device: what Contracts recorded, per phase."""
    contracts = Contracts(DEVICE.type)
    device = DEVICE
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(cfg.parallel.world_size, rank, "cpu:fake,meta:fake"), recording_groups(contracts):
        from nanomega.parallel.setup import setup_parallel  # a mesh's runtime (registers the hints)
        model_cfg = model_config(cfg)
        with contracts:
            params, opt, par = setup_parallel(cfg, model_cfg, device, lambda: fake)
        with fake, contracts:
            state = opt.init(params)
            fns = make_step_fns(model_cfg, opt, par=par, **{**step_options(cfg.train), "compile": False})
            t = cfg.train
            gen = torch.Generator().manual_seed(t.seed)

            def micro_batch():
                tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen)
                return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
            with contracts.in_phase("step"):
                for _ in range(2):            # the second step: nothing may be made lazily on the first
                    loss, grads, stats = fns.grads(params, [micro_batch() for _ in range(t.grad_accum)])
                    params, state = fns.update(grads, state, params, stats)
                    del grads
            with contracts.in_phase("evaluate"):
                validation_loss(params, [micro_batch()], model_cfg, t, device, par)
            with contracts.in_phase("gather"):
                par.full_on_main(params)
            with contracts.in_phase("sample"):     # train.py's end-of-run sample, greedy (no generator on meta)
                prompt = torch.zeros(1, 4, dtype=torch.long, device=device)
                sample_text(params, model_cfg, dataclasses.replace(t, temperature=0.0), prompt, device, par, n_new=2)
    return {"rank": rank, "off_device": contracts.off_device, "syncs": dict(contracts.syncs),
            "transfers": contracts.transfers, "groups": contracts.groups}


def moe_reads_per_forward(model_cfg, ep: int) -> int:
    """The host reads of one forward through the whole model, all of them a mixture of experts': per MoE layer,
    one for dropless expert parallel's all-to-all split sizes (parallel/experts.py: all_to_all_single takes
    host ints) and one for slicing rows per expert where the experts run in a loop (float8 matmuls:
    models/moe.expert_mlp; torch._scaled_grouped_mm, CUDA only, would take device offsets); each once per
    sub-batch (model.moe_sub_batches: parallel/wavefront.py)."""
    if not model_cfg.n_experts or model_cfg.capacity_factor:      # token dropping pads: static shapes
        return 0
    looped = model_cfg.fp8 != "none"
    layers = sum(model_cfg.is_moe_layer(i) for i in range(model_cfg.n_layers))
    return layers * model_cfg.moe_sub_batches * ((ep > 1) + looped)


def document_reads_per_forward(model_cfg, p) -> int:
    """The host reads of one micro-batch's forward on a rank for document masking (model.document_separator)
    under context parallel: the copy of where the rows' documents open to the host, from which every layer's
    attention plans its blocks (parallel/context.py, document_mask_on_mesh), once per forward of each of the
    rank's pipeline stages (parallel.pp_virtual) and each sub-batch (parallel/wavefront.py); a recomputed block
    plans from the same copy."""
    if model_cfg.document_separator < 0 or p.cp == 1:
        return 0
    return p.pp_virtual * model_cfg.moe_sub_batches


def host_read_budget(cfg, steps: int = 2) -> int:
    """The host reads `steps` train steps may make on a rank: MoE's inherent ones for every forward, a
    recomputed one included (an upper bound: a pipeline stage runs only its own layers), and document masking's
    under context parallel; otherwise none."""
    recomputed = cfg.train.activation_checkpointing != "none"
    micro_batches = steps * cfg.train.grad_accum
    model_cfg = model_config(cfg)
    return micro_batches * ((1 + recomputed) * moe_reads_per_forward(model_cfg, cfg.parallel.ep)
                            + document_reads_per_forward(model_cfg, cfg.parallel))


def violations(per_rank: dict[int, dict], budget: int = 0) -> list[str]:
    """What NCCL would refuse or hang on, over all ranks' records (module doc); [] when every contract holds."""
    found = []
    for r, res in per_rank.items():
        found += [f"rank {r}, {phase}: {op} on {where} (NCCL takes tensors on the rank's GPU only)"
                  for phase, op, where in res["off_device"]]
        found += [f"rank {r}, {phase}: creates a process group over ranks {ranks} after setup (a collective "
                  "over every rank, reached by some ranks only or at different times: NCCL hangs)"
                  for phase, ranks in res["groups"] if phase != "setup"]
        if res["syncs"].get("step", 0) > budget:
            found.append(f"rank {r}: {res['syncs']['step']} host syncs in two train steps (.item(), .tolist()), "
                         f"over the layout's budget of {budget}")
    setups = {r: [ranks for phase, ranks in res["groups"] if phase == "setup"] for r, res in per_rank.items()}
    first = min(setups)
    found += [f"rank {r} creates other process groups at setup than rank {first}, or in another order"
              for r in setups if setups[r] != setups[first]]
    channels = collections.defaultdict(lambda: ([], []))     # (src, dst) -> (sends, receives)
    for r, res in per_rank.items():
        for op, peer, shape, dtype, phase in res["transfers"]:
            channels[(r, peer) if op == "send" else (peer, r)][op == "recv"].append((shape, dtype, phase))
    for (src, dst), (sends, recvs) in sorted(channels.items()):
        if src not in per_rank or dst not in per_rank:
            continue                       # only some ranks were checked: their peers' halves are not here
        if len(sends) != len(recvs):
            found.append(f"rank {src} sends {len(sends)} tensors to rank {dst}, which receives {len(recvs)}")
        found += [f"transfer #{k} from rank {src} to rank {dst}: sent {s[:2]} in {s[2]}, received into {q[:2]} "
                  f"in {q[2]} (NCCL matches in order)" for k, (s, q) in enumerate(zip(sends, recvs)) if s[:2] != q[:2]]
    return found


def check(cfg, ranks: list[int] | None = None) -> dict:
    """Every rank (or `ranks`) of the layout checked: {"ranks": {rank: record}, "violations": [...]}."""
    validate_layout(cfg, cfg.parallel.world_size)
    if cfg.parallel.world_size == 1:
        raise ValueError("one process issues no collective; check a layout of several ranks (parallel.*)")
    if cfg.model.n_experts and cfg.model.capacity_factor:
        raise ValueError("token dropping sizes its tensors from routing values, which the checker's meta tensors "
                         "lack; check the dropless layout (--model.capacity_factor=0), which issues the same "
                         "collectives (the memory simulator, nanomega.sim.estimate, takes dropping's worst case)")
    chosen = range(cfg.parallel.world_size) if ranks is None else ranks
    pending = {r: _start_child(check_rank, cfg, r) for r in chosen}     # every rank at once: one process each
    per_rank = {r: result() for r, result in pending.items()}
    return {"ranks": per_rank, "violations": violations(per_rank, host_read_budget(cfg))}


def main(argv: list[str]) -> int:
    want_json = "--json" in argv
    try:
        result = check(parse_args([a for a in argv if a != "--json"]))
    except ValueError as err:
        sys.exit(f"error: {err}")
    if want_json:
        print(json.dumps({"violations": result["violations"],
                          "syncs": {r: res["syncs"] for r, res in result["ranks"].items()}}))
    else:
        print("\n".join(result["violations"]) or f"every NCCL contract holds on {len(result['ranks'])} ranks")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
