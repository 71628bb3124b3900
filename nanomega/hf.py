"""Hugging Face export: a nanomega checkpoint, of any layout, as a folder `transformers` loads.

    python -m nanomega.hf export runs/default out/hf                      # the run's latest checkpoint
    python -m nanomega.hf export runs/default/ckpt-00000280 out/hf --shard-gb 5

The folder holds config.json (models/hf.py `hf_config`: GPT-2, LLaMA, Qwen2/3, Mixtral, Qwen2/3-MoE,
DeepSeek-V3), the weights renamed to Hugging Face's names (`to_hf_state_dict`) in safetensors files of at
most --shard-gb each, and model.safetensors.index.json mapping every tensor to its file, as
`save_pretrained` writes them; `AutoModelForCausalLM.from_pretrained(out)` loads it. A parallel run's
checkpoint (one file per rank) is put back together first, from its layout (parallel/gather_checkpoint.py),
so every layout exports alike. Optimizer state and fp8 amax histories are not exported.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanomega import checkpoint
from nanomega.config import from_dict
from nanomega.models import init
from nanomega.models.hf import hf_config, to_hf_state_dict
from nanomega.parallel.gather_checkpoint import whole_params
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten

INDEX = "model.safetensors.index.json"


def checkpoint_dir(path) -> Path:
    """A checkpoint directory, or a run directory's latest checkpoint."""
    path = Path(path)
    if (path / checkpoint.META_FILE).is_file():
        return path
    latest = checkpoint.latest(path)
    if latest is None:
        raise ValueError(f"{path} is neither a checkpoint (no {checkpoint.META_FILE}) nor a run directory "
                         "holding one (ckpt-NNNNNNNN/)")
    return latest


def whole_model(path) -> tuple[dict, object]:
    """(the parameters as whole tensors, the run's Config) of a checkpoint of any layout."""
    meta = checkpoint.read_meta(path)
    cfg = from_dict(meta["config"])
    if meta.get("world_size", 1) > 1:
        params, _ = whole_params(path)
        return params, cfg
    stored = load_file(str(Path(path) / checkpoint.PARAMS_FILE))
    like = init(cfg.model, device="meta")          # the serial model's names (no fp8 amax histories)
    _, spec = tree_flatten(like)
    return tree_unflatten([stored[name] for name in named_leaves(like)], spec), cfg


def export(src, dst, shard_bytes: int = 5 * 2**30) -> Path:
    """Write the Hugging Face folder of checkpoint (or run) `src` into `dst`; returns dst."""
    path = checkpoint_dir(src)
    params, cfg = whole_model(path)
    hf_cfg = hf_config(cfg.model)                # refuses a model no transformers class matches, before writing
    state = {k: v.detach().contiguous() for k, v in to_hf_state_dict(params, cfg.model).items()}
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(str(dst))
    shards, current, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t, size + nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dst


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanomega.hf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="a checkpoint (or a run's latest) -> a Hugging Face folder")
    ex.add_argument("source", help="a ckpt-NNNNNNNN directory, or a run directory (its latest checkpoint)")
    ex.add_argument("out", help="the folder to write (config.json, safetensors shards, index)")
    ex.add_argument("--shard-gb", type=float, default=5.0, help="at most this many GB per safetensors file")
    args = ap.parse_args(argv)
    try:
        out = export(args.source, args.out, int(args.shard_gb * 2**30))
    except (ValueError, checkpoint.CheckpointMismatch, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {out} (from {checkpoint_dir(args.source)}): load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main(sys.argv[1:]))
