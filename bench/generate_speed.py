"""Generation speed: our KV-cached sampler against Hugging Face `generate` and our recompute-everything loop.

    python bench/generate_speed.py                            # batch 1 and 8, 128 prompt + 128 new tokens
    python bench/generate_speed.py --batches 1 --new 32 --recompute-batches '' --out /tmp/gen

One llama-shaped model (vocab 32,000, d 512, 8 layers, 8 heads of 64 with 4 key/value heads, SwiGLU 1408:
56M parameters, fp32 on the CPU), random weights, the same weights in transformers' LlamaForCausalLM
(nanomega.hf.convert). Greedy decoding from a random prompt, every new token kept (no end of
sequence), the same thread count for all (--threads, torch.set_num_threads):

- "cached": nanomega.eval.generate.sample(temperature=0): prefill in one call, then one token per call;
- "HF": model.generate(do_sample=False, use_cache=True, max_new_tokens=min_new_tokens=new), its default
  dynamic cache and SDPA attention;
- "recompute": sample(..., recompute=True), the whole context through the model for every token.

tokens/s = batch * new tokens / wall seconds of the whole call (prefill included), the best of --repeats
runs (the machine is shared: the best is the least disturbed), the three interleaved. The greedy tokens
of cached and HF are compared (they are the same model; a tie broken differently by rounding would show).
Results: <out>/generate_speed.json and .md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega of this checkout

import torch  # noqa: E402

import results_io  # noqa: E402
from nanomega.config import ModelConfig  # noqa: E402
from nanomega.eval.generate import sample  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.hf.convert import hf_config, to_hf_state_dict  # noqa: E402

MODEL = ModelConfig(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408,
                    max_seq_len=256, rope_theta=10000.0, init_std=0.1)


def tables(doc: dict) -> str:
    r = doc["results"]
    rows = []
    for row in r["rows"]:
        rec = row.get("recompute")
        rows.append([row["batch"], f"{row['cached']:,.1f}", f"{row['hf']:,.1f}", f"{row['cached'] / row['hf']:.2f}x",
                     "-" if rec is None else f"{rec:,.1f}", "-" if rec is None else f"{row['cached'] / rec:.1f}x",
                     "yes" if row["same_tokens"] else "NO"])
    return (f"Greedy generation, {r['prompt']} prompt + {r['new']} new tokens, {r['params'] / 1e6:.0f}M-parameter "
            f"llama-shaped model, fp32, CPU, {r['threads']} thread(s); tokens/s = batch x new tokens / wall time "
            f"of the call (prefill included), best of {r['repeats']}.\n\n"
            + results_io.table(["batch", "cached (tok/s)", "HF generate (tok/s)", "cached / HF", "recompute (tok/s)",
                                "cached / recompute", "same tokens as HF"], "rrrrrrl", rows))


def time_call(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--recompute-batches", default="1,8", help="batch sizes to time the recompute loop at ('' none)")
    results_io.add_arguments(ap)
    args = ap.parse_args()
    if args.render:
        return results_io.render(args.render, tables)
    if args.prompt + args.new > MODEL.max_seq_len:
        ap.error(f"--prompt + --new must be at most the model's {MODEL.max_seq_len} positions")
    import transformers

    torch.set_num_threads(args.threads)
    doc = results_io.start("generate_speed")
    params = init(MODEL, seed=0)
    hf = transformers.LlamaForCausalLM(hf_config(MODEL)).eval()
    hf.load_state_dict(to_hf_state_dict(params, MODEL), strict=True)
    n_params = sum(p.numel() for p in hf.parameters())
    recompute_batches = {int(b) for b in args.recompute_batches.split(",") if b}
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, MODEL.vocab_size, (batch, args.prompt), generator=gen)

        def ours():
            return sample(params, MODEL, prompt, args.new, temperature=0)

        def theirs():
            with torch.no_grad():
                return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, use_cache=True,
                                   max_new_tokens=args.new, min_new_tokens=args.new, eos_token_id=None,
                                   pad_token_id=0)

        def recompute():
            return sample(params, MODEL, prompt, args.new, temperature=0, recompute=True)

        ours(), theirs()   # warm-up: first-call allocations and lazy imports
        timed = {"cached": [], "hf": [], "recompute": []}
        outputs = {}
        for _ in range(args.repeats):   # interleaved, so a busy spell on the shared machine hits all alike
            for name, fn in (("cached", ours), ("hf", theirs), ("recompute", recompute)):
                if name == "recompute" and (batch not in recompute_batches or timed[name]):
                    continue      # the recompute loop is slow: one run is plenty to show the ratio
                seconds, outputs[name] = time_call(fn)
                timed[name].append(seconds)
        tokens = batch * args.new
        row = {"batch": batch, "cached": tokens / min(timed["cached"]), "hf": tokens / min(timed["hf"]),
               "seconds": timed, "same_tokens": bool(torch.equal(outputs["cached"], outputs["hf"]))}
        if timed["recompute"]:
            row["recompute"] = tokens / min(timed["recompute"])
            row["recompute_same_tokens"] = bool(torch.equal(outputs["cached"], outputs["recompute"]))
        rows.append(row)
        print(row, flush=True)
    doc["results"] = {"rows": rows, "prompt": args.prompt, "new": args.new, "threads": args.threads,
                      "repeats": args.repeats, "params": n_params,
                      "model": {k: getattr(MODEL, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads",
                                                               "n_kv_heads", "ffn_dim")}}
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
