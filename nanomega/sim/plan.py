"""The fastest layouts that fit: a search over parallel layouts, ranked by the step-time model. One idea in one file
of ~470 lines: the candidates, the rules that prune them before a simulation and the ranking are one search, each
rule's reason beside it.

    python -m nanomega.sim.plan --config=llama3_8b --gpus=8 --gpu=h100 [--seq_len=8192] [--global_batch_tokens=N]
        [--top=5] [--compiled] [--fp8] [--cp_methods=all_gather,ring] [--cp_from=16384] [--max_simulations=16]
        [--budget_s=420] [--model.X=...]

Candidates: every tp (within a node, dividing the heads: validate_layout decides), pp (up to the blocks; 1F1B,
and interleaved 1F1B with two virtual stages where the blocks allow), cp (dividing the GPUs left, with the
sequence in 2 x cp equal chunks as context.py's load balancing needs; each method of --cp_methods, both by
default: the model times each, so the better one ranks higher), for a mixture of experts every ep dividing the
experts (validate_layout keeps those that divide the ranks holding different tokens: data x context, x tensor
under sequence parallel), and the data-parallel ranks left, as FSDP (dp_shard), as DDP with the distributed
optimizer, or as HSDP (sharded within the node); recomputation none, selective or full; one or two sequences
per data-parallel rank per micro-batch, the rest as gradient accumulation up to the global batch.

How it finishes (a trillion-parameter MoE on 2,048 GPUs in under 10 minutes on 2 cores): a simulation costs
seconds to minutes (estimate's fake-tensor step of one rank), so the search counts before it simulates, and
simulates one representative rank of one stage: every rank of a stage runs the same step (balanced routing
makes the expert ranks alike too), so step_time.predict traces rank 0 with one and two blocks and composes every
pipeline stage from them (the first with the embedding, the last with the head), then replays the schedule.
Cuts, cheapest first, each with its reason:
0. Structure: tp within a node and dividing the heads, pp at most the blocks, ep dividing the experts and the
   ranks holding different tokens, the batch divisible by the data-parallel ranks (validate_layout): what the
   code refuses is not a layout. None left: the request is refused before any memory count or simulation,
   naming the nearest GPU counts that do divide (nearest_gpu_counts).
1. Context parallel only from --cp_from tokens (16,384): below it cp splits work that data parallel splits
   without K/V traffic (FSDP shards the state over dp_shard x cp either way), so at the same GPUs it cannot be
   faster in this model; the global batch (two sequences a GPU by default) always has the data-parallel ranks to
   take the GPUs.
2. Order, analytically (`analytic`): compute at the matmul rate stretched by the schedule's bubble, plus the
   traffic the code waits for (tp's activations, cp's K/V, ep's all-to-alls, none of which nanomega overlaps;
   FSDP's gathers only past the compute they hide behind; the distributed optimizer's once-a-step exchange).
   Layouts are simulated in that order, the best of each family (pipelined or not, tp or not, ep or not, cp or
   not) first: the estimate ranks by magnitude only (nanomega's eager kernels run slower than the matmul rate,
   and a family can share an error: the simulation decides the ranking).
3. Bound: the compute alone is a lower bound on the model's step (tests/test_plan_moe.py); a layout whose bound
   exceeds the `top`-th best simulated step cannot rank and is skipped.
4. Held bytes (parallel/memory.bytes_per_rank, as the preflight counts them: parameters, gradients, optimizer
   state) must leave room on the GPU, counted only for layouts about to be simulated (a second or two each
   at 671B: counting all ~200 of a 1,024-GPU search would cost minutes).
5. Two sequences a micro-batch not where one needed recomputation or fitted nowhere (when one was simulated
   first): two hold twice the activations, so they need at least as much recomputation.
6. Recomputation: the first tried is the lightest whose activation guess (activation_guess, x ACTIVATION_SLACK)
   fits beside the held bytes, then heavier ones until one fits; a layout whose simulated peak less its
   activations is already over the GPU is dropped at once (recomputation removes activations only).
7. Caps: --max_simulations (16) and --budget_s (420 s of searching; a simulation already started finishes):
   a simulation's cost is known only once it has run, so the search stops starting new ones and says why;
   the same failure on three layouts in a row is the code's, not the layouts': the search stops and says it.
8. FSDP gathered once a step: a fitting FSDP layout with several micro-batches is simulated once more with
   parallel.fsdp_gather=per_step where parallel/fsdp.py's rule (gather_once_default) says the stage's gathered
   parameters and unsharded gradients fit beside its per-micro-batch peak; both rank by their own step.
Pipeline stages: pp need not divide the blocks (stages as even as possible, the first ones one block more:
mesh.stages_layers; the step-time model replays the schedule over each stage's own blocks).
A simulation is composed (step_time.predict): one and two blocks extrapolated to the model's blocks (leading
dense blocks whose MLP does a MoE block's FLOPs, as DeepSeek-V3's and Kimi K2's, timed as MoE blocks; others
composed from a dense block simulated beside MoE ones), two and three micro-batches beyond four, the peak that of
three micro-batches; its peak must be within the GPU's memory less the preflight's margin.
"""
from __future__ import annotations

import dataclasses
import sys
import time

from nanomega.config import parse_args
from nanomega.parallel.context import METHODS as CP_METHODS
from nanomega.parallel.mesh import divisors
from nanomega.sim.devices import Efficiency
from nanomega.sim.devices import device as device_named

RECOMPUTE = ("none", "selective", "full")
MARGIN = 0.10      # the preflight's PEAK_MARGIN: allocator rounding, fragmentation, CUDA context, NCCL buffers
LONG_SEQUENCE = 16384   # context parallel is searched from this sequence length on (module doc, cut 1)
# nanomega's eager step keeps ~3x the bf16 activations activation_guess counts (fp32 copies and casts, the MoE's
# permuted rows): mixtral_8x7b, tp 2 x ep 4 x pp 2 x FSDP 4, no recomputation, simulated on 2026-12-04, held ~65
# GiB of activations at its peak against a guess of 19. Only the first recomputation tried depends on it.
ACTIVATION_SLACK = 3.0


@dataclasses.dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    schedule: str
    virtual: int
    dp_replicate: int
    dp_shard: int
    micro: int          # sequences per data-parallel rank per micro-batch
    recompute: str
    cp: int = 1
    cp_method: str = ""
    ep: int = 1
    gather: str = ""    # FSDP's parallel.fsdp_gather: "" (per micro-batch, the default) or "per_step"

    def flags(self, seq_len: int, grad_accum: int) -> list[str]:
        dp = self.dp_replicate * self.dp_shard
        f = [f"--parallel.tp={self.tp}", f"--parallel.pp={self.pp}", f"--parallel.dp_replicate={self.dp_replicate}",
             f"--parallel.dp_shard={self.dp_shard}", f"--train.batch_size={self.micro * dp}",
             f"--train.seq_len={seq_len}", f"--train.grad_accum={grad_accum}",
             f"--train.activation_checkpointing={self.recompute}", "--train.param_dtype=bfloat16"]
        if self.tp > 1:
            f.append("--parallel.sequence_parallel=true")
        if self.pp > 1:
            f += [f"--parallel.pp_schedule={self.schedule}", f"--parallel.pp_virtual={self.virtual}"]
        if self.dp_replicate > 1:
            f.append("--parallel.distributed_optimizer=true")
        if self.cp > 1:
            f += [f"--parallel.cp={self.cp}", f"--parallel.cp_method={self.cp_method}"]
        if self.ep > 1:
            f.append(f"--parallel.ep={self.ep}")
        if self.gather:
            f.append(f"--parallel.fsdp_gather={self.gather}")
        return f

    def describe(self) -> str:
        parts = [f"tp {self.tp}"] if self.tp > 1 else []
        if self.cp > 1:
            parts.append(f"cp {self.cp} {self.cp_method}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.pp > 1:
            parts.append(f"pp {self.pp} {self.schedule}" + (f" v{self.virtual}" if self.virtual > 1 else ""))
        if self.dp_shard > 1:
            parts.append(f"fsdp {self.dp_shard}" + (" gathered once a step" if self.gather == "per_step" else ""))
        if self.dp_replicate > 1:
            parts.append(f"ddp {self.dp_replicate}" + (" + dist. optimizer" if self.dp_shard == 1 else ""))
        return " x ".join(parts or ["1 GPU"]) + f", micro-batch {self.micro}, recompute {self.recompute}"


def layouts(gpus: int, n_layers: int, gpus_per_node: int = 8, seq_len: int = 0, n_experts: int = 0,
            cp_methods: tuple[str, ...] = CP_METHODS) -> list[Candidate]:
    """Every structural layout of `gpus` (module doc), recomputation "none" (tried upwards later). cp: the sizes
    that leave 2 x cp equal chunks of the sequence (context.py's load balancing), each method; ep: every divisor
    of the experts (validate_layout later keeps those that divide the ranks holding different tokens)."""
    out = []
    for tp in divisors(gpus):
        if tp > gpus_per_node:
            continue
        for pp in divisors(gpus // tp):
            if pp > n_layers:
                continue     # stages as even as possible where pp does not divide the blocks (mesh.stages_layers)
            scheds = [("1f1b", 1)] if pp > 1 else [("", 1)]
            if pp > 1 and n_layers >= 2 * pp:
                scheds.append(("interleaved_1f1b", 2))
            for cp in divisors(gpus // (tp * pp)):
                if cp > 1 and (not seq_len or seq_len % (2 * cp)):
                    continue
                dp = gpus // (tp * pp * cp)
                node_shard = max(1, gpus_per_node // (tp * cp))
                splits = {(1, dp), (dp, 1)} | ({(dp // node_shard, node_shard)} if dp > node_shard and
                                               dp % node_shard == 0 else set())
                eps = [e for e in divisors(n_experts) if e <= gpus // pp] if n_experts else [1]
                for schedule, v in scheds:
                    for method in (cp_methods if cp > 1 else ("",)):
                        for rep, shard in sorted(splits):
                            for ep in eps:
                                for micro in (1, 2):
                                    out.append(Candidate(tp, pp, schedule, v, rep, shard, micro, "none", cp,
                                                         method, ep))
    return out


def _experts_params(m) -> int:
    """The routed experts' parameters (gate, up and down of every expert of every MoE layer)."""
    return m.n_moe_layers * m.n_experts * 3 * m.d_model * m.expert_ffn_dim if m.n_experts else 0


def analytic(c: Candidate, m, seq_len: int, sequences: int, gpus: int, flops_per_token: float, dev,
             eff: Efficiency, fp8: bool, n_params: int, bubble: float, gpus_per_node: int = 8) -> dict:
    """A layout's step without simulating it, from the model's shapes and the layout alone (module doc, cuts 2, 3):
    {"bound": compute alone (a lower bound on the model's step), "step_s": the bound plus the traffic the
    code waits for}. Tokens per GPU T; each term per GPU and per step:
      compute      flops_per_token x T at the matmul rate, stretched by the schedule's theoretical bubble
      tp           sequence parallel's all-gather and reduce-scatter of [tokens, d] bf16 around attention and
                   the MLP, forward and backward: 8 per block and micro-batch, waited at once, on NVLink
      cp           each block gathers the other ranks' K and V (bf16) and reduce-scatters their gradients (the
                   ring once more), waited at once
      ep           4 all-to-alls of every token's top_k copies per MoE layer (dispatch and combine, forward and
                   backward), waited at once (nanomega overlaps none), the off-node slices over the network
      fsdp         per micro-batch (once a step when gathered per step): the bf16 all-gathers forward and backward
                   and the fp32 reduce-scatter of the parameters sharded over dp_shard x cp (experts over their
                   own data-parallel ranks); prefetched one unit ahead, so only what the compute cannot cover is
                   exposed
      replicate    once a step: the distributed optimizer's fp32 reduce-scatter and bf16 all-gather, exposed"""
    tokens = sequences * seq_len / gpus
    peak = dev.fp8_flops if fp8 and dev.fp8_flops else dev.bf16_flops
    compute = flops_per_token * tokens / (peak * eff.matmul)
    bound = compute / (1 - bubble)
    grad_accum = sequences // (c.micro * c.dp_replicate * c.dp_shard)
    bw = eff.bus

    def link(ranks_inner: int) -> float:
        return dev.nvlink_bandwidth if ranks_inner <= gpus_per_node else dev.network_bandwidth
    # a tp rank's stage sees tokens x tp x pp tokens a step (its data-parallel rank's), over n_layers / pp blocks
    tp_s = 8 * m.n_layers * (c.tp - 1) * tokens * m.d_model * 2 / (dev.nvlink_bandwidth * bw)
    kv = (m.kv_heads * m.dim_head if m.attention != "mla"
          else m.n_heads * (m.qk_nope_dim + m.qk_rope_dim + m.v_head_dim) / 2)
    cp_s = ((2 + (c.cp_method == "ring")) * m.n_layers * (c.cp - 1) * tokens * 2 * kv * 2
            / (link(c.tp * c.cp) * bw))
    ep_s = 0.0
    if c.ep > 1:
        nodes = max(1, -(-c.ep * (1 if c.tp > 1 else c.tp) // gpus_per_node))   # ep folds onto tp under SP
        off = (c.ep - c.ep / nodes) / (c.ep - 1)
        a2a = 4 * m.n_moe_layers * (c.ep - 1) / c.ep * tokens * m.top_k * m.d_model * 2
        ep_s = max(a2a * off / dev.network_bandwidth, a2a * (1 - off) / dev.nvlink_bandwidth) / bw
    experts = _experts_params(m)
    dense_local = (n_params - experts) / (c.pp * c.tp)
    expert_local = experts / (c.pp * c.ep)
    token_ranks = c.dp_replicate * c.dp_shard * c.cp * c.tp
    expert_shard = max(1, token_ranks // c.ep // c.dp_replicate)
    shard = c.dp_shard * c.cp if c.dp_shard > 1 else 1      # FSDP shards over dp_shard x cp (parallel/plan.py)
    share = dense_local * (shard - 1) / shard + expert_local * (expert_shard - 1) / expert_shard
    dp_link = link(c.tp * c.cp * c.dp_shard)
    gathers = 1 if c.gather == "per_step" else grad_accum
    fsdp_s = gathers * 8 * share / (dp_link * bw) if c.dp_shard > 1 else 0.0
    rep_share = (dense_local / shard + expert_local / expert_shard) * (c.dp_replicate - 1) / c.dp_replicate
    replicate_s = 6 * rep_share / (dev.network_bandwidth * bw) if c.dp_replicate > 1 else 0.0
    step = bound + tp_s + cp_s + ep_s + max(0.0, fsdp_s - compute) + replicate_s
    return {"bound": bound, "step_s": step, "compute_s": compute, "tp_s": tp_s, "cp_s": cp_s, "ep_s": ep_s,
            "fsdp_s": fsdp_s, "replicate_s": replicate_s}


def activation_guess(c: Candidate, m, seq_len: int, recompute: str) -> float:
    """Bytes of activations a rank keeps at its peak, roughly (bf16; per token and block: the attention's
    inputs and outputs ~10 d, the MLP's (top_k rows of 2 d + 3 expert_ffn for a mixture of experts, and its
    shared or dense MLP's 3 ffn), a sixth less under selective recomputation; the block inputs alone under full
    recomputation, plus one block recomputed), over tp (sequence parallel) and cp, times the micro-batches a
    pipeline's first stage keeps in flight. Only picks the first recomputation to simulate (module doc)."""
    d = m.d_model
    mlp = (m.top_k * (2 * d + 3 * m.expert_ffn_dim) + 3 * m.shared_ffn_dim) if m.n_experts else 3 * m.ffn_dim
    block = 2 * (10 * d + mlp)
    tokens = c.micro * seq_len / (c.tp * c.cp)
    blocks = m.n_layers / c.pp
    per_micro = {"none": block * blocks, "selective": block * blocks * 5 / 6,
                 "full": 2 * d * blocks + block}[recompute] * tokens
    return per_micro * (c.pp if c.pp > 1 else 1)


def nearest_gpu_counts(gpus: int, fits) -> list[int]:
    """The nearest GPU counts below and above `gpus` for which fits(n) holds (at most 16 tried each way)."""
    below = next((n for n in range(gpus - 1, max(0, gpus - 17), -1) if fits(n)), None)
    above = next((n for n in range(gpus + 1, gpus + 17) if fits(n)), None)
    return [n for n in (below, above) if n]


def one_block_fits(base, dev, budget: float) -> None:
    """Refuse a model no GPU count holds: one block, gathered in bf16 for compute (FSDP gathers whole blocks) over
    the widest tensor parallel (a node), must fit on one GPU. Checked first: it counts parameters only."""
    from nanomega.parallel.mesh import model_config
    from nanomega.sim.counting import count_params
    m = model_config(base)
    block = count_params(dataclasses.replace(m, n_layers=2, first_dense_layers=0)) - count_params(
        dataclasses.replace(m, n_layers=1, first_dense_layers=0))
    if 2 * block / dev.gpus_per_node > budget:
        raise ValueError(f"no GPU count holds this model on {dev.name}: one block has {block / 1e9:.0f}B parameters, "
                         f"{2 * block / dev.gpus_per_node / 2**30:.0f} GiB in bf16 even split over tensor parallel "
                         f"{dev.gpus_per_node} (a node), beyond the {budget / 2**30:.0f} GiB budget; use a smaller "
                         f"model.d_model or a GPU with more memory")


def enough_gpus(base, gpus: int, dev, budget: float) -> None:
    """Refuse, before any layout's bytes are counted, a model that `gpus` GPUs cannot hold however it is split: its
    held bytes (parameters, gradients, optimizer state: bytes_per_rank on one rank) over every GPU, the best any
    sharding does, must fit the budget; the refusal names the least GPU count that could."""
    import math

    from nanomega.parallel.mesh import model_config
    from nanomega.sim.counting import count_params
    from nanomega.sim.rank_bytes import bytes_per_rank
    held = bytes_per_rank(base).total
    needed = math.ceil(held / budget)
    if gpus < needed:
        raise ValueError(f"{count_params(model_config(base)) / 1e9:.1f}B parameters, with their gradients and "
                         f"optimizer state, hold {held / 2**30:,.0f} GiB: more than {gpus} {dev.name} GPUs of "
                         f"{budget / 2**30:.0f} GiB hold even fully sharded; they need more GPUs or GPUs with more "
                         f"memory: plan for at least {needed} GPUs")


def structural_layouts(base_args: list[str], m, gpus: int, sequences: int, seq_len: int, gpus_per_node: int = 8,
                       cp_methods: tuple[str, ...] = CP_METHODS, cp_from: int = LONG_SEQUENCE,
                       refused: dict | None = None) -> list:
    """(layout, grad_accum, config) of every layout of `gpus` that the batch and validate_layout allow (module
    doc, cuts 0 and 1), recomputation "none"; no memory counted, nothing simulated."""
    from nanomega.parallel.mesh import validate_layout
    out = []
    for c in layouts(gpus, m.n_layers, gpus_per_node, seq_len, m.n_experts, cp_methods):
        dp = c.dp_replicate * c.dp_shard
        if sequences % (c.micro * dp):
            continue
        grad_accum = sequences // (c.micro * dp)
        if c.pp > 1 and (grad_accum < c.pp or (c.schedule == "interleaved_1f1b" and grad_accum % c.pp)):
            continue       # fewer micro-batches than stages: the pipeline never fills
        if c.cp > 1 and seq_len < cp_from:
            continue       # context parallel only for long sequences
        cfg = parse_args(base_args + c.flags(seq_len, grad_accum))
        try:
            validate_layout(cfg, gpus)
        except ValueError as err:
            if refused is not None and c.pp > 1:      # why no pipeline: said once (plan's notes)
                refused.setdefault(str(err), c)
            continue
        out.append((c, grad_accum, cfg))
    return out


def plan(base_args: list[str], gpus: int, gpu: str = "h100", seq_len: int | None = None,
         global_batch_tokens: int | None = None, top: int = 5, max_simulations: int = 16, compiled: bool = False,
         fp8: bool = False, cp_methods: tuple[str, ...] = CP_METHODS, budget_s: float = 420.0,
         cp_from: int = LONG_SEQUENCE,
         eff: Efficiency = Efficiency(), log=lambda s: None) -> dict:
    """The `top` fastest layouts that fit (module doc), with what was searched; clear errors for bad requests."""
    from nanomega.parallel import schedules
    from nanomega.parallel.fsdp import gather_once_default
    from nanomega.parallel.mesh import model_config
    from nanomega.sim.counting import count_params
    from nanomega.sim.counting import flops_per_token as count_flops
    from nanomega.sim.rank_bytes import bytes_per_rank
    from nanomega.sim.step_time import predict
    dev = device_named(gpu)           # an unknown GPU fails here, before any work
    if gpus < 1:
        raise ValueError(f"--gpus={gpus}: give a positive number of GPUs")
    if seq_len:
        base_args = base_args + [f"--train.seq_len={seq_len}"]
    base = parse_args(base_args)
    seq_len = base.train.seq_len
    m = base.model
    mc = model_config(base)
    n_params = count_params(mc)
    given_batch = bool(global_batch_tokens)
    global_batch_tokens = global_batch_tokens or gpus * seq_len * 2
    if global_batch_tokens % seq_len:
        raise ValueError(f"--global_batch_tokens={global_batch_tokens} is not a whole number of sequences of "
                         f"{seq_len} tokens; use a multiple of {seq_len}")
    sequences = global_batch_tokens // seq_len
    unknown = set(cp_methods) - set(CP_METHODS)
    if unknown or not cp_methods:
        raise ValueError(f"--cp_methods={','.join(cp_methods)}: choose among {','.join(CP_METHODS)}")
    flops = count_flops(mc, seq_len)
    budget = dev.hbm_bytes * (1 - MARGIN)
    one_block_fits(base, dev, budget)
    start = time.perf_counter()

    def structural(n: int, batch: int, refused=None) -> list:
        return structural_layouts(base_args, m, n, batch, seq_len, dev.gpus_per_node, tuple(cp_methods), cp_from,
                                  refused)
    refused_pipelines: dict = {}
    found_layouts = structural(gpus, sequences, refused_pipelines)
    notes = []
    if refused_pipelines and not any(c.pp > 1 for c, _, _ in found_layouts):
        notes.append("no pipelined layout searched: the code refuses them for this model: "
                     + "; ".join(sorted(refused_pipelines))[:400])
    if not found_layouts:
        # other GPU counts for the same global batch (given), or the same two sequences a GPU (the default)
        near = nearest_gpu_counts(gpus, lambda n: bool(structural(n, sequences)) if given_batch else
                                  bool(structural(n, 2 * n)))
        what = (f"ep must divide the {m.n_experts} experts and the ranks holding different tokens, " if m.n_experts
                else "")
        raise ValueError(f"no layout divides {gpus} GPUs for this model and batch: tp must divide the "
                         f"{m.n_heads} heads within a node of {dev.gpus_per_node}, pp at most the {m.n_layers} blocks, "
                         f"{what}and the data-parallel ranks the {sequences} sequences; choose a GPU count that "
                         f"they divide" + (f" (the nearest: {' or '.join(map(str, near))})" if near else ""))
    enough_gpus(base, gpus, dev, budget)
    tokens_gpu = sequences * seq_len / gpus
    # leading dense blocks whose MLP does a MoE block's FLOPs (DeepSeek-V3's and Kimi K2's 18,432 = 8 routed + 1
    # shared expert of 2,048) are timed as MoE blocks: one simulated block less per layout (their parameters
    # are in the held bytes exactly); otherwise predict composes them (a dense block simulated beside MoE ones)
    same = m.n_experts and m.ffn_dim == m.top_k * m.expert_ffn_dim + m.shared_ffn_dim
    stage = None
    candidates = []
    for c, grad_accum, cfg in found_layouts:
        bubble = float(schedules.theoretical_bubble(c.schedule, c.pp, grad_accum, c.virtual)) if c.pp > 1 else 0.0
        est = analytic(c, m, seq_len, sequences, gpus, flops, dev, eff, fp8, n_params, bubble, dev.gpus_per_node)
        candidates.append((est["step_s"] + (c.micro > 1) * 1e-9, est, c, grad_accum, cfg))
    candidates.sort(key=lambda x: x[0])
    # the estimate ranks by magnitude only: the best of each family (pipelined or not, with tp or not, with ep or
    # not) goes first, then the rest in the estimate's order, so an error common to one family does not spend the
    # simulations on it (mixtral_8x7b on 16 GPUs: the pipelined layouts' estimates led and none of them fitted)
    firsts, seen = [], set()
    for x in candidates:
        family = (x[2].pp > 1, x[2].tp > 1, x[2].ep > 1, x[2].cp > 1)
        if family not in seen:
            seen.add(family)
            firsts.append(x)
    candidates = firsts + [x for x in candidates if not any(x is f for f in firsts)]
    rejected = {"held memory": 0, "micro-batch 2 after recomputation": 0, "beyond recomputation": 0}
    held_by_layout: dict = {}
    found, simulated, failed = [], 0, []
    lowest_fit: dict = {}      # a layout's recomputation that fitted with one sequence per micro-batch
    never_fit: set = set()     # layouts that one sequence per micro-batch fitted with no recomputation
    streak: list = []          # the errors of the simulations since the last that ran
    stopped = ""
    for _, est, c, grad_accum, cfg in candidates:
        if len(found) >= top and est["bound"] > sorted(r["step_s"] for r in found)[top - 1]:
            continue     # cut 3: cannot rank
        stage = (-(-m.n_layers // c.pp), 0) if same and m.first_dense_layers else None    # the largest stage
        structure = dataclasses.replace(c, micro=0)
        if c.micro > 1 and (structure in never_fit or lowest_fit.get(structure, "none") != "none"):
            rejected["micro-batch 2 after recomputation"] += 1
            continue     # cut 5: two sequences not where one needed recomputation or fitted nowhere
        if structure not in held_by_layout:      # cut 4: the held bytes, only for layouts about to be simulated
            held_by_layout[structure] = bytes_per_rank(cfg).total
        held = held_by_layout[structure]
        if held > budget:
            rejected["held memory"] += 1
            continue
        if simulated >= max_simulations:
            stopped = f"--max_simulations={max_simulations}"
            break
        if time.perf_counter() - start > budget_s:
            stopped = f"--budget_s={budget_s:.0f}"
            break
        first = next((r for r in RECOMPUTE if held + ACTIVATION_SLACK * activation_guess(c, m, seq_len, r) <= budget),
                     "full")

        def simulate(recompute, gather=""):
            nonlocal simulated
            trial = dataclasses.replace(c, recompute=recompute, gather=gather)
            trial_cfg = parse_args(base_args + trial.flags(seq_len, grad_accum))
            simulated += 1
            try:
                r = predict(trial_cfg, gpu, eff, compiled, fp8,
                            layers=(1, 2) if trial_cfg.model.n_layers // c.pp > 2 else None,
                            micro=(2, 3) if grad_accum > 4 else None, stage=stage)
            except RuntimeError as err:      # the step itself failed on this layout: reported, not ranked
                failed.append((trial, str(err).strip().splitlines()[-1][:300]))
                log(f"{trial.describe()}: the simulated step failed: {failed[-1][1]}")
                streak.append(failed[-1][1])
                return None
            streak.clear()

            fits = r["peak_bytes"] <= budget
            log(f"{trial.describe()}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (estimate "
                f"{tokens_gpu / est['step_s']:,.0f}), peak {r['peak_bytes'] / 2**30:.1f} GiB"
                f"{'' if fits else ' (does not fit)'}, {time.perf_counter() - start:.0f} s")
            if not fits and r["peak_bytes"] - r["by_category"].get("activations", 0) > budget:
                return "never"   # cut 6: what the peak holds besides activations no recomputation removes
            return {**r, "layout": trial, "grad_accum": grad_accum, "flags": trial.flags(seq_len, grad_accum),
                    "estimate_s": est["step_s"]} if fits else None

        # cut 6: recomputation from the analytic guess upwards; the first that fits is kept
        for recompute in RECOMPUTE[RECOMPUTE.index(first):]:
            if recompute != first and (simulated >= max_simulations or time.perf_counter() - start > budget_s):
                break
            r = simulate(recompute)
            if r == "never":
                rejected["beyond recomputation"] += 1
                if c.micro == 1:
                    never_fit.add(structure)
                break
            if r is not None:
                found.append(r)
                if c.micro == 1:
                    lowest_fit.setdefault(structure, recompute)
                # cut 8: FSDP gathered once a step (parallel.fsdp_gather=per_step) where its rule says it fits:
                # the per-micro-batch peak plus the stage's gathered parameters and unsharded gradients
                if (gather_once_default(parse_args(base_args + r["flags"]), budget, r["peak_bytes"])
                        and simulated < max_simulations and time.perf_counter() - start <= budget_s):
                    once = simulate(recompute, "per_step")
                    if isinstance(once, dict):
                        found.append(once)
                break
        else:
            if c.micro == 1:
                never_fit.add(structure)
        if len(streak) >= 3 and len(set(streak[-3:])) == 1:
            # cut 7: the same failure on three layouts in a row is the code's, not a layout's: stop, and say it
            stopped = f"the same failure three times in a row ({failed[-1][1][:120]})"
            break
    if not found:
        if streak and len(streak) == simulated:
            raise ValueError(f"the simulated step failed on every layout tried ({simulated}), the last with: "
                             f"{streak[-1]}; that failure is the code's, not the layouts'")
        if rejected["held memory"] and not simulated:
            raise ValueError(f"no layout of {m.n_layers} blocks on {gpus} {dev.name} GPUs fits: {n_params / 1e9:.1f}B "
                             f"parameters, with their gradients and optimizer state, need more GPUs or GPUs with "
                             f"more memory")
        raise ValueError(f"no simulated layout of {m.n_layers} blocks on {gpus} {dev.name} GPUs fits "
                         f"in {budget / 2**30:.0f} GiB ({dev.hbm_bytes / 2**30:.0f} GiB less the {MARGIN:.0%} "
                         f"margin), even with full recomputation; use more GPUs or shorter sequences")
    found.sort(key=lambda r: r["step_s"])
    return {"gpu": dev.name, "gpus": gpus, "seq_len": seq_len, "global_batch_tokens": global_batch_tokens,
            "candidates": len(candidates), "rejected": rejected, "simulated": simulated, "stopped": stopped,
            "max_simulations": max_simulations, "failed": failed, "notes": notes,
            "seconds": time.perf_counter() - start, "best": found[:top]}


def describe(result: dict) -> str:
    from nanomega.sim.step_time import bottleneck
    lines = [f"{result['gpus']} x {result['gpu']}, sequence {result['seq_len']:,}, "
             f"{result['global_batch_tokens']:,} tokens a step: {result['candidates']} layouts left after the "
             f"analytic cuts, {result['simulated']} simulated in {result['seconds']:.0f} s"
             + (f" (stopped at {result['stopped']}: layouts later in the estimate's order were not simulated)"
                if result["stopped"] else ""),
             "rank | layout | tokens/s/GPU | MFU | step ms | peak GiB | bottleneck"]
    for i, r in enumerate(result["best"], 1):
        lines.append(f"{i} | {r['layout'].describe()} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['step_s'] * 1e3:,.0f} | {r['peak_bytes'] / 2**30:.1f} | {bottleneck(r)}")
    for layout, err in result.get("failed", []):
        lines.append(f"not ranked, the simulated step failed: {layout.describe()}: {err}")
    lines += [f"note: {n}" for n in result.get("notes", [])]
    lines.append("best: " + " ".join(result["best"][0]["flags"]))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    opts = {"gpus": None, "gpu": "h100", "seq_len": None, "global_batch_tokens": None, "top": 5, "max_simulations": 16,
            "cp_methods": None, "budget_s": 420, "cp_from": LONG_SEQUENCE}
    switches, rest = {"compiled": False, "fp8": False}, []
    for a in argv:
        key = a[2:].split("=", 1)[0] if a.startswith("--") else ""
        if key in opts and "=" in a:
            value = a.split("=", 1)[1]
            opts[key] = value if key == "gpu" else tuple(value.split(",")) if key == "cp_methods" else int(value)
        elif key in switches:
            switches[key] = True
        else:
            rest.append(a)
    if opts["gpus"] is None:
        sys.exit("error: give --gpus=N (the GPUs to plan for)")
    opts["cp_methods"] = opts["cp_methods"] or CP_METHODS
    try:
        print(describe(plan(rest, **opts, **switches, log=lambda s: print("  " + s, file=sys.stderr, flush=True))))
    except ValueError as err:
        sys.exit(f"error: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
