"""Train-step throughput: our eager/compiled fp32/bf16 steps against Hugging Face, same model and batches.

    python bench/throughput.py --steps 8 --warmup 2             # CPU default config, 5 variants (~3 min, 2 cores)
    python bench/throughput.py --config=tinyllama_1b --train.batch_size=8 --variants=compiled-bf16,eager-bf16
    python bench/throughput.py --variants=compiled-bf16,compiled-fp8tensorwise,compiled-fp8rowwise   # fp8 recipes

A step is forward + backward + AdamW update (optim.build, with its grad clipping) on one micro-batch
of train.batch_size x train.seq_len random tokens; train.grad_accum, train.dtype and train.compile
are ignored (the variant decides). HF variants run the same weights (to_hf_state_dict) eagerly with
torch.optim.AdamW(foreach=True), the same lr/betas/eps/weight decay/clipping, on the same batches.
Our variants share one training state, the HF ones one model: memory for two copies, not five.
Rounds interleave variants, one step each (A B C A B C ...); each reports its median step, so a
noisy shared machine slows all alike. Warm-up steps (compilation) are untimed; the first is shown apart.
Results: <out>/<name>.json and .md (bench/results/throughput.*; --render JSON writes the .md again).
fp8 variants (`compiled-fp8<recipe>`) run the blocks' linear layers in float8 (nanomega/models/fp8.py)
under bf16 autocast; their MFU is against the dense bf16 peak (the FLOPs are the same, the peak is not
float8's), so a 1.3x speed-up shows as 1.3x the bf16 MFU.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega and configs/ of this checkout

import results_io  # noqa: E402  (bench/results_io.py: the results set)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanomega import optim  # noqa: E402
from nanomega.config import parse_args, to_dict  # noqa: E402
from nanomega.run.metrics import hardware_name, lookup_peak, measure_matmul_flops, peak_flops  # noqa: E402
from nanomega.sim.counting import count_params, flops_per_token  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.train.step import autocast, make_step_fns  # noqa: E402
from nanomega.parallel.mesh import pick_device  # noqa: E402

FP8 = ("tensorwise", "rowwise", "blockwise", "delayed")
VARIANTS = ("eager-fp32", "compiled-fp32", "eager-bf16", "compiled-bf16", "hf-eager-fp32", "hf-eager-bf16",
            *(f"compiled-fp8{r}" for r in FP8))
DEFAULT = "eager-fp32,compiled-fp32,eager-bf16,compiled-bf16,hf-eager-fp32"
BASELINE = "hf-eager-fp32"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", **{f"fp8{r}": "bfloat16" for r in FP8}}   # autocast dtype
PEAK = {"fp32": "fp32", "bf16": "bf16", **{f"fp8{r}": "bf16" for r in FP8}}   # MFU against the dense bf16 peak


def our_step(cfg, state: dict, compiled: bool, dtype: str, model_cfg=None):
    fns = make_step_fns(model_cfg or cfg.model, state["opt"], compile=compiled, dtype=dtype)

    def step(x, y):
        _, grads, _ = fns.grads(state["params"], [(x, y)])
        state["params"], state["opt_state"] = fns.update(grads, state["opt_state"], state["params"])
    return step


def hf_model(cfg, params, device):
    """HF model with our weights, and its optimizer; weight decay on matrices except embeddings, as ours."""
    import transformers
    from nanomega.hf.convert import hf_config, to_hf_state_dict

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model), attn_implementation="sdpa")
    model.float().train().load_state_dict(to_hf_state_dict(params, cfg.model))
    o = cfg.optim
    named = list(model.named_parameters())
    decay = {n for n, p in named if p.ndim >= 2 and not any(s in n for s in ("embed_tokens", ".wte.", ".wpe."))}
    groups = [{"params": [p for n, p in named if (n in decay) == d], "weight_decay": o.weight_decay * d}
              for d in (True, False)]
    adam = optim.check(o)         # AdamW's own settings (the run is AdamW's: its beta1, beta2, eps)
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps, foreach=True)
    return model, opt


def hf_step(cfg, model, opt, dtype: str):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast(dtype, x.device):
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())   # as our loss_fn
        loss.backward()
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        opt.step()
    return step


def timed(step, batch, device) -> float:
    """Seconds for one step; on CUDA the queue is drained before each clock read."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    start = time.perf_counter()
    step(*batch)
    sync(device)
    return time.perf_counter() - start


def tables(doc: dict) -> str:
    """The markdown table and its footnote, from a results document alone."""
    s, results = doc["summary"], doc["results"]
    cuda = any("peak_mem_gib" in r for r in results)
    lines = [f"config {' '.join([s['config']] + s['overrides'])}: {s['params'] / 1e6:.2f}M parameters, batch "
             f"{s['batch_size']} x seq {s['seq_len']}, device {s['device']} ({s['hardware']}), {s['threads']} threads, "
             f"{s['steps']} rounds after {s['warmup']} warm-up steps", "",
             f"| variant | tokens/s | step ms | TFLOP/s | MFU¹ | vs {BASELINE} | first step s |"
             + (" peak GiB |" if cuda else ""), "|---|--:|--:|--:|--:|--:|--:|" + ("--:|" if cuda else "")]
    for r in results:
        ratio = f"{r['vs_hf_fp32']:.2f}x" if r["vs_hf_fp32"] else "—"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:,.1f} | {r['tflops']:.3g} | "
                     f"{r['mfu']:.1%} | {ratio} | {r['first_step_s']:.1f} |"
                     + (f" {r['peak_mem_gib']:.1f} |" if cuda else ""))
    lines += [f"| {v} | {msg} |" for v, msg in doc["errors"].items()]
    peaks = ", ".join(f"{k} {x / 1e12:.3g}" for k, x in sorted(s["peak_flops"].items()))
    lines += ["", f"Medians over {s['steps']} interleaved rounds; FLOPs/token {s['flops_per_token'] / 1e6:.1f}M "
                  f"(PaLM convention).", f"¹ MFU = tokens/s x FLOPs/token / peak; peak {peaks} TFLOP/s: "
                  f"{s['peak_kind']}."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 epilog="Other arguments: --config=NAME and --section.key=value overrides")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds; each times one step of every variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first, >= 1 (compilation)")
    ap.add_argument("--variants", default=DEFAULT, help=f"comma-separated, from: {', '.join(VARIANTS)}")
    ap.add_argument("--device", default="", help="auto | cpu | cuda | cuda:N (default: train.device)")
    ap.add_argument("--name", default="throughput", help="the results set's name: <out>/<name>.json and .md")
    results_io.add_arguments(ap)
    args, rest = ap.parse_known_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start(args.name)
    variants = [v for v in args.variants.split(",") if v]
    try:
        cfg = parse_args(rest)
        if bad := [v for v in variants if v not in VARIANTS]:
            raise ValueError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
        if args.steps < 1 or args.warmup < 1:
            raise ValueError("--steps and --warmup must be >= 1")
    except ValueError as err:
        sys.exit(f"error: {err}")
    device = args.device or cfg.train.device
    device = pick_device(device)
    cuda = device.type == "cuda"
    m, B, T = cfg.model, cfg.train.batch_size, cfg.train.seq_len
    fpt = flops_per_token(m, T)
    # MFU's peak: --train.peak_flops, else a known GPU's bf16 table entry, else (CPU) the median of n x n matmul
    # rates measured once per round, under the same load as the steps (a cached one-off rate can be far off).
    fixed = cfg.train.peak_flops > 0 or (cuda and lookup_peak(torch.cuda.get_device_name(device)) > 0)
    peaks = {k: peak_flops(device, getattr(torch, DTYPES[k]), cfg.train.peak_flops) for k in ("fp32", "bf16") if fixed}
    name = next((a.split("=", 1)[1] for a in rest if a.startswith("--config=")), "default")
    summary = {"config": name, "overrides": [a for a in rest if not a.startswith("--config=")],
               "params": count_params(m), "flops_per_token": fpt, "batch_size": B, "seq_len": T,
               "device": str(device), "hardware": hardware_name(device), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "steps": args.steps, "warmup": args.warmup}
    print(f"config {' '.join([name] + summary['overrides'])}: {summary['params'] / 1e6:.2f}M parameters, "
          f"{fpt / 1e6:.1f} MFLOP/token (fwd+bwd) | batch {B} x seq {T} = {B * T} tokens/step\n"
          f"device {device}: {summary['hardware']} | torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads | {args.steps} rounds after {args.warmup} warm-up steps", flush=True)

    gen = torch.Generator().manual_seed(cfg.train.seed)
    tokens = [torch.randint(0, m.vocab_size, (B, T + 1), generator=gen).to(device) for _ in range(4)]
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    params = init(m, cfg.train.seed, device)
    opt = optim.build(cfg.optim, (args.warmup + args.steps) * len(variants) + 1)
    state = {"opt": opt, "params": params, "opt_state": opt.init(params)}
    steps, errors, hf = {}, {}, None
    for v in variants:
        *kind, mode, prec = v.split("-")
        try:
            if kind:                                   # hf-eager-*: HF takes a copy of the initial weights
                hf = hf or hf_model(cfg, params, device)
                steps[v] = hf_step(cfg, *hf, DTYPES[prec])
            elif prec.startswith("fp8"):                # the blocks' linears in float8 (model.fp8); delayed
                fp8_cfg = dataclasses.replace(m, fp8=prec[3:])   # scaling's params carry amax histories
                own = state if prec != "fp8delayed" else {"opt": opt, "params": init(fp8_cfg, cfg.train.seed, device)}
                own.setdefault("opt_state", opt.init(own["params"]))
                steps[v] = our_step(cfg, own, mode == "compiled", DTYPES[prec], fp8_cfg)
            else:
                steps[v] = our_step(cfg, state, mode == "compiled", DTYPES[prec])
        except (ImportError, ValueError) as err:       # no transformers, or no HF model with this layout
            errors[v] = f"skipped: {err}"
    del params

    first, times, peak_mem = {}, {v: [] for v in steps}, {}
    for v in list(steps):                              # warm-up, one variant at a time
        try:
            for i in range(args.warmup):
                seconds = timed(steps[v], batches[i % len(batches)], device)
                first.setdefault(v, seconds)
            print(f"  {v}: first step {first[v]:.2f} s, last warm-up step {seconds:.3f} s", flush=True)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            errors[v] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            print(f"  {v}: {errors[v]}", flush=True)
            del steps[v], times[v]
            torch.cuda.empty_cache() if cuda else None
    rates = {k: [] for k in {PEAK[v.rsplit("-", 1)[1]] for v in steps} if not fixed}
    for r in range(args.steps):                        # timed rounds: A B C A B C ...
        for v in steps:
            torch.cuda.reset_peak_memory_stats(device) if cuda else None
            times[v].append(timed(steps[v], batches[r % len(batches)], device))
            if cuda:                                   # everything live: both shared states, activations
                peak_mem[v] = max(peak_mem.get(v, 0), torch.cuda.max_memory_allocated(device))
        for k in rates:
            rates[k].append(measure_matmul_flops(device, getattr(torch, DTYPES[k])))
    peaks.update({k: statistics.median(x) for k, x in rates.items()})

    tps = {v: B * T / statistics.median(times[v]) for v in steps}
    base = tps.get(BASELINE)
    results = [{"variant": v, "tokens_per_s": t, "step_ms": 1e3 * B * T / t, "tflops": t * fpt / 1e12,
                "mfu": t * fpt / peaks[PEAK[v.rsplit("-", 1)[1]]], "vs_hf_fp32": t / base if base else None,
                "first_step_s": first[v], "step_times_s": times[v],
                **({"peak_mem_gib": peak_mem[v] / 2**30} if cuda else {})} for v, t in tps.items()]
    kind = ("--train.peak_flops" if cfg.train.peak_flops > 0 else "the GPU's dense bf16 table peak "
            "(nanomega/sim/devices.py), for fp32 too" if fixed else "NOT a datasheet peak: this machine's "
            "n x n matmul rate in the variant's dtype, median of one per round, i.e. under the same load")
    doc.update(summary={**summary, "peak_flops": peaks, "peak_kind": kind}, model=to_dict(m), results=results,
               errors=errors)
    results_io.write(doc, tables(doc), args.out)
    return 1 if not results or any(e.startswith("failed") for e in errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
