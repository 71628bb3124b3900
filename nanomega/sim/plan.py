"""The fastest layouts that fit: a search over parallel layouts, ranked by the step-time model.

    python -m nanomega.sim.plan --config=llama3_8b --gpus=8 --gpu=h100 [--seq_len=8192] [--global_batch_tokens=N]
        [--top=5] [--compiled] [--fp8] [--cp_methods=all_gather,ring] [--max_simulations=16] [--model.X=...]

Candidates: every tp (within a node, dividing the heads: validate_layout decides), pp (dividing the blocks; 1F1B,
and interleaved 1F1B with two virtual stages where the blocks allow), cp (dividing the GPUs left, with the
sequence in 2 x cp equal chunks as context.py's load balancing needs; each method of --cp_methods, both by
default: the model times each, so the better one ranks higher), for a mixture of experts every ep dividing the
experts (validate_layout keeps those that divide the ranks holding different tokens: data x context, x tensor
under sequence parallel), and the data-parallel ranks left, as FSDP (dp_shard), as DDP with the distributed
optimizer, or as HSDP (sharded within the node); recomputation none, selective or full; one or two sequences
per data-parallel rank per micro-batch, the rest as gradient accumulation up to the global batch.

How it stays fast (seconds to a few minutes for an 8B model on 2 cores): three cuts, cheapest first.
1. Memory, analytically: the bytes every rank holds between steps (parallel/memory.bytes_per_rank, as the
   preflight counts them) must leave room on the GPU; no simulation yet.
2. Time, as a bound: each survivor's lower bound is its matmul FLOPs at the achievable matmul rate
   (6 x the active non-embedding parameters (a mixture of experts: top_k of its experts) x the tokens per GPU,
   at the fp8 peak under --fp8; cp's K/V traffic and ep's all-to-alls left out, so it stays a lower bound)
   stretched by its schedule's
   theoretical bubble (parallel/schedules.theoretical_bubble). Candidates are simulated in the order of that
   bound, and the search stops once the bound of the next one exceeds the `top`-th best predicted step: the
   model's step is never faster than its bound, so nothing skipped could have ranked.
3. Simulation, composed: a candidate's step is two one- and two-block simulations (estimate's fake-tensor
   run; step_time.predict with layers=(1, 2), and micro=(1, 2) beyond 4 micro-batches) extrapolated to
   the model's blocks and micro-batches; its peak must be within the GPU's memory less the preflight's margin.
Recomputation: full first (a layout that does not fit with it is dropped after one simulation: long sequences
rule most out so), then from none upwards, and the lightest that fits is kept (recomputing is never faster in
this model); with two sequences per micro-batch it starts where one sequence first fitted (what did not fit
with one cannot fit with two, and a layout that one sequence did not fit at all is not tried with two).
Ties in the bound are many (every split of the same tp x pp has the same one), so the order also counts tensor
parallel's activation traffic, context parallel's K/V and expert parallel's all-to-all bytes, and --max_simulations
(16 by default) caps the simulations: the output says when the cap, not the bound, ended the search.
"""
from __future__ import annotations

import dataclasses
import sys
import time

from nanomega.config import parse_args
from nanomega.sim.devices import Efficiency
from nanomega.sim.devices import device as device_named

RECOMPUTE = ("none", "selective", "full")
CP_METHODS = ("all_gather", "ring")
MARGIN = 0.10      # the preflight's PEAK_MARGIN: allocator rounding, fragmentation, CUDA context, NCCL buffers


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
            parts.append(f"fsdp {self.dp_shard}")
        if self.dp_replicate > 1:
            parts.append(f"ddp {self.dp_replicate}" + (" + dist. optimizer" if self.dp_shard == 1 else ""))
        return " x ".join(parts or ["1 GPU"]) + f", micro-batch {self.micro}, recompute {self.recompute}"


def layouts(gpus: int, n_layers: int, gpus_per_node: int = 8, seq_len: int = 0, n_experts: int = 0,
            cp_methods: tuple[str, ...] = CP_METHODS) -> list[Candidate]:
    """Every structural layout of `gpus` (module doc), recomputation "none" (tried upwards later). cp: the sizes
    that leave 2 x cp equal chunks of the sequence (context.py's load balancing), each method; ep: every divisor
    of the experts (validate_layout later keeps those that divide the ranks holding different tokens)."""
    out = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(gpus // tp):
            if n_layers % pp or pp > n_layers:
                continue
            scheds = [("1f1b", 1)] if pp > 1 else [("", 1)]
            if pp > 1 and n_layers % (2 * pp) == 0:
                scheds.append(("interleaved_1f1b", 2))
            for cp in _divisors(gpus // (tp * pp)):
                if cp > 1 and (not seq_len or seq_len % (2 * cp)):
                    continue
                dp = gpus // (tp * pp * cp)
                node_shard = max(1, gpus_per_node // (tp * cp))
                splits = {(1, dp), (dp, 1)} | ({(dp // node_shard, node_shard)} if dp > node_shard and
                                               dp % node_shard == 0 else set())
                eps = [e for e in _divisors(n_experts) if e <= gpus // pp] if n_experts else [1]
                for schedule, v in scheds:
                    for method in (cp_methods if cp > 1 else ("",)):
                        for rep, shard in sorted(splits):
                            for ep in eps:
                                for micro in (1, 2):
                                    out.append(Candidate(tp, pp, schedule, v, rep, shard, micro, "none", cp,
                                                         method, ep))
    return out


def plan(base_args: list[str], gpus: int, gpu: str = "h100", seq_len: int | None = None,
         global_batch_tokens: int | None = None, top: int = 5, max_simulations: int = 16, compiled: bool = False,
         fp8: bool = False, cp_methods: tuple[str, ...] = CP_METHODS,
         eff: Efficiency = Efficiency(), log=lambda s: None) -> dict:
    """The `top` fastest layouts that fit (module doc), with what was searched; clear errors for bad requests."""
    from nanomega.parallel import schedules
    from nanomega.parallel.mesh import model_config, validate_layout
    from nanomega.sim.counting import count_params
    from nanomega.sim.rank_bytes import bytes_per_rank
    from nanomega.sim.step_time import predict
    dev = device_named(gpu)           # an unknown GPU fails here, before any work
    if gpus < 1:
        raise ValueError(f"--gpus={gpus}: give a positive number of GPUs")
    if seq_len:
        base_args = base_args + [f"--train.seq_len={seq_len}"]
    base = parse_args(base_args)
    seq_len = base.train.seq_len
    n_params = count_params(model_config(base))
    global_batch_tokens = global_batch_tokens or gpus * seq_len * 2
    if global_batch_tokens % seq_len:
        raise ValueError(f"--global_batch_tokens={global_batch_tokens} is not a whole number of sequences of "
                         f"{seq_len} tokens; use a multiple of {seq_len}")
    sequences = global_batch_tokens // seq_len
    m = base.model
    unknown = set(cp_methods) - set(CP_METHODS)
    if unknown or not cp_methods:
        raise ValueError(f"--cp_methods={','.join(cp_methods)}: choose among {','.join(CP_METHODS)}")
    # a token meets top_k experts, not all: the bound counts the active parameters (a lower bound stays one)
    active = count_params(model_config(base), active=True)
    matmul_params = active - m.vocab_size * m.d_model * (0 if m.tie_embeddings else 1)   # the lookup is no matmul
    peak = dev.fp8_flops if fp8 and dev.fp8_flops else dev.bf16_flops
    budget = dev.hbm_bytes * (1 - MARGIN)

    candidates, rejected, held_by_layout = [], {"layout": 0, "batch": 0, "held memory": 0}, {}
    start = time.perf_counter()
    for c in layouts(gpus, base.model.n_layers, dev.gpus_per_node, seq_len, m.n_experts, tuple(cp_methods)):
        dp = c.dp_replicate * c.dp_shard
        if sequences % (c.micro * dp):
            rejected["batch"] += 1
            continue
        grad_accum = sequences // (c.micro * dp)
        if c.pp > 1 and (grad_accum < c.pp or (c.schedule == "interleaved_1f1b" and grad_accum % c.pp)):
            rejected["batch"] += 1       # fewer micro-batches than stages: the pipeline never fills
            continue
        cfg = parse_args(base_args + c.flags(seq_len, grad_accum))
        try:
            validate_layout(cfg, gpus)
        except ValueError:
            rejected["layout"] += 1
            continue
        key = dataclasses.replace(c, micro=0)     # what a rank holds does not depend on the batch
        if key not in held_by_layout:
            held_by_layout[key] = bytes_per_rank(cfg).total
        held = held_by_layout[key]
        if held > budget:
            rejected["held memory"] += 1
            continue
        bubble = float(schedules.theoretical_bubble(c.schedule, c.pp, grad_accum, c.virtual)) if c.pp > 1 else 0.0
        tokens_per_gpu = sequences * seq_len / gpus
        bound = 6 * matmul_params * tokens_per_gpu / (peak * eff.matmul) / (1 - bubble)
        # the order to simulate in: the bound plus tensor parallel's activation traffic, which nanomega waits for at
        # once (with sequence parallel: an all-gather and a reduce-scatter of [tokens, d] bf16 around attention and
        # around the MLP, forward and backward, i.e. 8 per block and micro-batch)
        tp_bytes = 8 * m.n_layers / c.pp * (c.tp - 1) / c.tp * tokens_per_gpu * c.tp * m.d_model * 2
        # context parallel: each block gathers the other ranks' K and V (bf16) forward and reduce-scatters their
        # gradients backward (the ring passes the same bytes and dK/dV once more); expert parallel: four
        # all-to-alls of every token's top_k copies per MoE layer (dispatch and combine, forward and backward)
        # (a rank's tokens: tokens_per_gpu x tp x pp, its heads 1 / tp, its blocks 1 / pp)
        cp_bytes = (2 + (c.cp_method == "ring")) * m.n_layers * (c.cp - 1) * tokens_per_gpu * 2 * m.kv_heads * m.dim_head * 2
        moe_layers = sum(m.is_moe_layer(i) for i in range(m.n_layers)) if m.n_experts else 0
        ep_bytes = 4 * moe_layers * (c.ep - 1) / c.ep * tokens_per_gpu * m.top_k * m.d_model * 2
        link = dev.nvlink_bandwidth if c.tp * c.cp * c.ep <= dev.gpus_per_node else dev.network_bandwidth
        order = (bound + tp_bytes / (dev.nvlink_bandwidth * eff.bus) + (cp_bytes + ep_bytes) / (link * eff.bus)
                 + (c.micro > 1) * 1e-9)   # ties: micro 1 first
        candidates.append((order, bound, c, grad_accum, held))
    if not candidates:
        why = ", ".join(f"{n} by {k}" for k, n in rejected.items() if n)
        raise ValueError(f"no layout of {base.model.n_layers} blocks on {gpus} {dev.name} GPUs fits ({why}): "
                         f"{n_params / 1e9:.1f}B parameters, with their gradients and optimizer state, need more "
                         f"GPUs or GPUs with more memory" if rejected["held memory"] else
                         f"no layout divides {gpus} GPUs for this model and batch ({why}); choose a GPU count that "
                         f"the heads, blocks and {sequences} sequences divide")
    candidates.sort(key=lambda x: x[0])
    found, simulated = [], 0
    lowest_fit = {}     # a layout's lightest recomputation that fitted, at its other micro-batch size
    never_fit = set()   # layouts whose one sequence per micro-batch fitted at no recomputation
    failed = []         # (layout, error) where the simulated step raised
    stopped = False
    for _, bound, c, grad_accum, held in candidates:
        if len(found) >= top and bound > sorted(r["step_s"] for r in found)[top - 1]:
            continue     # cannot rank (module doc, cut 2)
        if simulated >= max_simulations:
            stopped = True
            break
        structure = dataclasses.replace(c, micro=0)
        if c.micro > 1 and structure in never_fit:
            continue     # not even one sequence fitted with full recomputation: two cannot
        start_at = RECOMPUTE.index(lowest_fit[structure]) if c.micro > 1 and structure in lowest_fit else 0

        def simulate(recompute):
            nonlocal simulated
            trial = dataclasses.replace(c, recompute=recompute)
            cfg = parse_args(base_args + trial.flags(seq_len, grad_accum))
            simulated += 1
            try:
                r = predict(cfg, gpu, eff, compiled, fp8, layers=(1, 2) if cfg.model.n_layers // c.pp > 2 else None,
                            micro=(1, 2) if grad_accum > 4 else None)
            except RuntimeError as err:      # the step itself failed on this layout: reported, not ranked
                failed.append((trial, str(err).strip().splitlines()[-1][:300]))
                log(f"{trial.describe()}: the simulated step failed: {failed[-1][1]}")
                return None, False
            fits = r["peak_bytes"] <= budget
            log(f"{trial.describe()}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, peak "
                f"{r['peak_bytes'] / 2**30:.1f} GiB{'' if fits else ' (does not fit)'}")
            return {**r, "layout": trial, "grad_accum": grad_accum, "flags": trial.flags(seq_len, grad_accum)}, fits

        lightest = None
        if start_at == 0:
            # full recomputation first: a layout that does not fit with it fits with nothing, one simulation spent
            lightest, fits = simulate("full")
            if not fits:
                never_fit.add(structure)
                continue
        for recompute in RECOMPUTE[start_at:-1]:
            if simulated >= max_simulations:
                break
            r, fits = simulate(recompute)
            if fits:
                lightest = r
                break
        else:
            if lightest is None:
                lightest, fits = simulate("full")
                if not fits:
                    never_fit.add(structure)
                    continue
        found.append(lightest)
        lowest_fit.setdefault(structure, lightest["layout"].recompute)
    if not found:
        raise ValueError(f"no simulated layout of {base.model.n_layers} blocks on {gpus} {dev.name} GPUs fits "
                         f"in {budget / 2**30:.0f} GiB ({dev.hbm_bytes / 2**30:.0f} GiB less the {MARGIN:.0%} "
                         f"margin), even with full recomputation; use more GPUs or shorter sequences")
    found.sort(key=lambda r: r["step_s"])
    return {"gpu": dev.name, "gpus": gpus, "seq_len": seq_len, "global_batch_tokens": global_batch_tokens,
            "candidates": len(candidates), "rejected": rejected, "simulated": simulated, "stopped": stopped,
            "max_simulations": max_simulations, "failed": failed,
            "seconds": time.perf_counter() - start, "best": found[:top]}


def describe(result: dict) -> str:
    from nanomega.sim.step_time import bottleneck
    lines = [f"{result['gpus']} x {result['gpu']}, sequence {result['seq_len']:,}, "
             f"{result['global_batch_tokens']:,} tokens a step: {result['candidates']} layouts left after the "
             f"analytic cuts, {result['simulated']} simulated in {result['seconds']:.0f} s"
             + (f" (stopped at --max_simulations={result['max_simulations']}: layouts later in the bound's order were "
                  "not simulated)" if result["stopped"]
                else ""),
             "rank | layout | tokens/s/GPU | MFU | step ms | peak GiB | bottleneck"]
    for i, r in enumerate(result["best"], 1):
        lines.append(f"{i} | {r['layout'].describe()} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['step_s'] * 1e3:,.0f} | {r['peak_bytes'] / 2**30:.1f} | {bottleneck(r)}")
    for layout, err in result.get("failed", []):
        lines.append(f"not ranked, the simulated step failed: {layout.describe()}: {err}")
    lines.append("best: " + " ".join(result["best"][0]["flags"]))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    opts = {"gpus": None, "gpu": "h100", "seq_len": None, "global_batch_tokens": None, "top": 5, "max_simulations": 16,
            "cp_methods": None}
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
