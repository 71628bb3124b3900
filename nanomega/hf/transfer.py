"""Hugging Face in and out: a nanomega checkpoint, of any layout, as a folder `transformers` loads, and a
Hugging Face folder as the starting weights of a run, in any layout.

    python -m nanomega.hf export runs/default out/hf                      # the run's latest checkpoint
    python -m nanomega.hf export runs/default/ckpt-00000280 out/hf --shard-gb 5 --dtype bfloat16
    python train.py --train.init_from=path/to/hf_folder ...               # fine-tune (load_params)

The folder holds config.json (models/hf_convert.py `hf_config`: GPT-2, LLaMA, Qwen2/3, Mixtral, Qwen2/3-MoE,
DeepSeek-V3, with rope scaling), the weights renamed to Hugging Face's names (`hf_layout`, `hf_tensor`) in
safetensors files of at most --shard-gb each, and model.safetensors.index.json mapping every tensor to its
file, as `save_pretrained` writes them; `AutoModelForCausalLM.from_pretrained(out)` loads it. The weights are
written in the run's parameter dtype (bfloat16 where train.param_dtype was; --dtype chooses), shard by shard:
each tensor is read from the checkpoint when its shard is filled (a parallel run's from its rank files,
parallel/gather_checkpoint.py `open_tensors`), so host memory holds one shard, never the whole model, and
every layout exports alike. Optimizer state and fp8 amax histories are not exported; nor is a tied lm_head
(save_pretrained leaves it out too).

In: `--train.init_from=FOLDER` takes the architecture from its config.json (hf_config.model_from_hf) and the
weights from its safetensors (`load_params`): each rank reads, of each HF tensor, only the region its own
pieces come from (a safetensors slice), through the same renaming, un-fusing, transposing and row
permutation as `from_hf_state_dict`, so no rank reads a whole tensor it does not hold. No `transformers`
is needed for either direction's files (export's config.json excepted).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from nanomega import checkpoint
from nanomega.config import ModelConfig, from_dict
from nanomega.data.tokenizer import load_run_tokenizer
from nanomega.hf.convert import (_HF_BUFFERS, _VOCAB, _conv1d, _fuse_dim, _hf_constants, _hf_name, _rope_rows,
                                 hf_config, hf_family, hf_layout, hf_tensor)
from nanomega.models import init, mla
from nanomega.models.fp8 import is_amax_history
from nanomega.parallel.gather_checkpoint import open_tensors, whole_params
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


EXPORT_DTYPES = ("float32", "bfloat16")


def export_dtype(cfg) -> str:
    """The dtype an export writes by default: the one the run's parameters computed in (train.param_dtype,
    FSDP's mixed precision: bfloat16 when the run trained in bf16 parameters), else float32. (train.dtype is
    autocast's: its parameters stay fp32 and so does the export.)"""
    return cfg.train.param_dtype


@contextlib.contextmanager
def checkpoint_tensors(path):
    """Yields read(name): one whole parameter of a checkpoint of any layout, read when asked (a serial
    checkpoint's file and a parallel one's rank files are memory-mapped; parallel/gather_checkpoint.py
    puts a tensor together from its ranks' pieces)."""
    if checkpoint.read_meta(path).get("world_size", 1) > 1:
        with open_tensors(path) as read:
            yield read
    else:
        with safe_open(str(Path(path) / checkpoint.PARAMS_FILE), framework="pt") as f:
            yield f.get_tensor


def export(src, dst, shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> Path:
    """Write the Hugging Face folder of checkpoint (or run) `src` into `dst` in `dtype` (default: the run's
    parameter dtype, `export_dtype`); returns dst. Shard by shard: the shards are planned from the shapes,
    then each is filled reading its tensors one at a time, written and freed, so host memory holds one
    shard and one tensor, not the model."""
    path = checkpoint_dir(src)
    meta = checkpoint.read_meta(path)
    cfg = from_dict(meta["config"])
    dtype = dtype or export_dtype(cfg)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {EXPORT_DTYPES}")
    hf_cfg = hf_config(cfg.model)                # refuses a model no transformers class matches, before writing
    hf_cfg.dtype = getattr(torch, dtype)
    # the run's tokenizer (<out_dir>/tokenizer), written beside the weights so AutoTokenizer loads it too;
    # config.json names the same special ids
    tok = load_run_tokenizer(path, meta.get("tokenizer"))
    for role in ("bos", "eos", "pad"):
        setattr(hf_cfg, f"{role}_token_id", getattr(tok, f"{role}_id"))
    model = cfg.model
    layout = hf_layout(model)
    constants = _hf_constants(model, hf_family(model))
    like = named_leaves(init(model, device="meta"))
    shapes = {key: hf_tensor(key, names, [like[n] for n in names], model).shape for key, names in layout.items()}
    shapes.update({key: t.shape for key, t in constants.items()})
    itemsize = getattr(torch, dtype).itemsize
    shards, size = [[]], 0
    for key, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(str(dst))
    tok.save(dst)
    config = json.loads((dst / "config.json").read_text())   # transformers 4 reads torch_dtype, 5 writes dtype
    (dst / "config.json").write_text(json.dumps({**config, "dtype": dtype, "torch_dtype": dtype}, indent=2) + "\n")
    weight_map = {}
    with checkpoint_tensors(path) as read:
        for i, keys in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            shard = {}
            for key in keys:
                t = constants[key] if key in constants else hf_tensor(key, layout[key], [read(n) for n in layout[key]],
                                                                      model)
                shard[key] = t.to(getattr(torch, dtype)).contiguous()
            save_file(shard, str(dst / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(keys, file))
            del shard, t                         # this shard's tensors go before the next shard's are read
    total = sum(math.prod(shape) * itemsize for shape in shapes.values())
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dst


# ---------------------------------------------------------------- in: a Hugging Face folder's weights

def hf_files(folder) -> dict[str, Path]:
    """{HF tensor name: its safetensors file} of a model folder (sharded with an index, or one file)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / "model.safetensors")
    raise ValueError(f"{folder} holds neither {INDEX} nor model.safetensors; save the model with "
                     "save_pretrained(..., safe_serialization=True)")


# The Hub's (and save_pretrained's) layout of MoE weights: one tensor per expert, and Mixtral's original
# module name. Our export writes transformers 5's stacked tensors (experts.gate_up_proj); both are read.
_PER_EXPERT = {"w_gate": ("gate_proj", "w1"), "w_up": ("up_proj", "w3"), "w_down": ("down_proj", "w2")}


def _hub_name(key: str, family: str) -> str:
    return key.replace(".mlp.gate.", ".block_sparse_moe.gate.") if family == "mixtral" else key


def _expert_keys(name: str, cfg: ModelConfig, family: str) -> list[str]:
    """The per-expert HF tensors of our stacked expert leaf `name` (layers.<i>.moe.experts.w_*)."""
    parts = name.split(".")
    i, leaf = parts[1], parts[-1]
    module, proj = ("block_sparse_moe", _PER_EXPERT[leaf][1]) if family == "mixtral" else ("mlp", _PER_EXPERT[leaf][0])
    return [f"model.layers.{i}.{module}.experts.{e}.{proj}.weight" for e in range(cfg.n_experts)]


def _sources(cfg: ModelConfig, family: str, files: dict) -> tuple[dict, list[str], dict]:
    """({our leaf name: (HF keys, rows before ours in a fused HF tensor, the fused tensor's rows)} over the
    whole model, the HF keys it needs that `files` lacks, {our leaf name: its whole shape}). One key per
    leaf, or one per expert for a stacked expert leaf of a per-expert folder; start and rows are None for
    a leaf that is not fused."""
    template = {n: t for n, t in named_leaves(init(cfg, device="meta")).items() if not is_amax_history(n)}
    sizes: dict = {}                  # fused HF key -> {slot: our rows along the output dim}
    names = {name: _hf_name(name, family) for name in template}
    for name, (key, slot) in names.items():
        if slot is not None:
            sizes.setdefault(key, {})[slot] = template[name].shape[_fuse_dim(template[name])]
    sources, missing = {}, []
    for name, (key, slot) in names.items():
        if key not in files and _hub_name(key, family) in files:
            key = _hub_name(key, family)
        if key not in files and ".moe.experts." in name:
            keys = _expert_keys(name, cfg, family)
            sources[name] = (keys, None, None)
            missing += [k for k in keys if k not in files]
            continue
        sources[name] = ([key], None, None) if slot is None else \
            ([key], sum(n for s, n in sizes[key].items() if s < slot), sum(sizes[key].values()))
        missing += [] if key in files else [key]
    return sources, sorted(set(missing)), {name: list(t.shape) for name, t in template.items()}


def check_folder(folder, cfg: ModelConfig) -> tuple[dict, dict]:
    """Refuse, before any weight is read, a folder whose tensors do not fit cfg: a missing tensor, one with
    no place in the model, a shape that differs (headers only). Returns (files, sources) for load_params."""
    family = hf_family(cfg)
    files = hf_files(folder)
    sources, missing, whole = _sources(cfg, family, files)
    if missing:
        raise checkpoint.CheckpointMismatch(f"{folder} lacks {missing[0]!r} ({len(missing)} missing in all), which "
                                            f"this {family} model needs")
    used = {k for keys, *_ in sources.values() for k in keys} | set(_hf_constants(cfg, family))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
    if unused := [k for k in files if k not in used and not k.endswith(_HF_BUFFERS)]:
        raise checkpoint.CheckpointMismatch(f"{folder} has tensors with no place in this model: {unused[:8]}")
    shapes: dict = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})
    for name, (keys, start, rows) in sources.items():
        shape = whole[name][1:] if len(keys) > 1 else whole[name]   # per-expert tensors: one expert's [rows, cols]
        for key in keys:
            want = _hf_shape(name, key, shape, cfg, family, start, rows)
            if shapes[key] != want:
                raise checkpoint.CheckpointMismatch(
                    f"{key!r} has shape {tuple(shapes[key])}, but our {name!r} of shape "
                    f"{tuple(whole[name])} needs {tuple(want)}; the folder's config.json and weights disagree")
    return files, sources


def _hf_shape(name: str, key: str, shape: list, cfg: ModelConfig, family: str, start, rows) -> list:
    """The shape of HF tensor `key` that holds our leaf `name` (whole shape `shape`)."""
    expected = list(shape)
    if name in _VOCAB:
        expected[0] = cfg.vocab_size
    if start is not None:
        expected[len(shape) - 2 if len(shape) >= 2 else 0] = rows
    return expected[::-1] if _conv1d(key, family, len(shape)) else expected


def load_params(folder, like, cfg: ModelConfig, box_of=None):
    """The tree `like` (this rank's parameters in its layout: DTensor shards, plain tensors, or a pipeline
    stage's subtree) with the values of the Hugging Face folder's weights. Each leaf's part (checkpoint.box)
    is read as the region of its HF tensor it comes from; the vocabulary's padding rows are zeros, fp8 amax
    histories keep like's values. Every HF tensor must have a place in cfg (names, shapes: check_folder),
    as in `from_hf_state_dict`, of which this is the sliced version. box_of(name, leaf) -> (global shape,
    offset) places plain-tensor leaves that are parts (DTensors say it themselves; default: whole tensors)."""
    family = hf_family(cfg)
    files, sources = check_folder(folder, cfg)
    handles: dict = {}

    def opened(key: str):
        if files[key] not in handles:
            handles[files[key]] = safe_open(str(files[key]), framework="pt").__enter__()
        return handles[files[key]]
    try:
        for key, value in _hf_constants(cfg, family).items():
            if key in files and not torch.equal(opened(key).get_tensor(key).to(value.dtype), value):
                raise checkpoint.CheckpointMismatch(
                    f"{key!r} is not {value.flatten()[:1].item()} everywhere and this model has no place for it; "
                    "set --model.expert_bias_rate > 0 to keep the expert bias")
        leaves, spec = tree_flatten(like)
        out = []
        for name, ref in zip(named_leaves(like), leaves):
            if is_amax_history(name):
                out.append(ref)
                continue
            keys, start, _ = sources[name]
            shape, offset = checkpoint.box(ref) if box_of is None or isinstance(ref, DTensor) else box_of(name, ref)
            local = list((ref.to_local() if isinstance(ref, DTensor) else ref).shape)
            if len(keys) == 1:
                piece = _read_region(opened(keys[0]), keys[0], name, shape, offset, local, cfg, family, start)
            else:     # per-expert tensors: this part's experts, each its region of the other two dims
                piece = torch.stack([_read_region(opened(keys[e]), keys[e], name, shape[1:], offset[1:], local[1:],
                                                  cfg, family, None)
                                     for e in range(offset[0], offset[0] + local[0])])
            out.append(checkpoint.placed_like(piece.to(ref.dtype), ref, requires_grad=True))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return tree_unflatten(out, spec)


def _read_region(f, key: str, name: str, shape, offset, local, cfg: ModelConfig, family: str,
                 start) -> torch.Tensor:
    """The part (offset, local shape) of our leaf `name` (whole shape `shape`), read from HF tensor `key` in
    open file f (its shape checked by check_folder). Our index i along a dim maps to the HF tensor: + `start`
    along the fused output dim, through the MLA rope-row permutation along rows, and transposed for GPT-2's Conv1D;
    rows past the vocabulary are zero. One contiguous span per dim is read, then the exact rows taken."""
    conv = _conv1d(key, family, len(shape))
    fused = len(shape) - 2 if len(shape) >= 2 else 0
    out = torch.zeros(local)                 # float32, our parameters' dtype (bf16 weights convert exactly)
    index = [torch.arange(o, o + n) for o, n in zip(offset, local)]
    keep = slice(None)
    if name in _VOCAB:                       # padding rows stay zero: nothing to read
        keep = slice(0, int((index[0] < cfg.vocab_size).sum()))
        index[0] = index[0][keep]
    if (rope := _rope_rows(name, cfg, family)) is not None:
        hf_row = mla.rope_rows_from_interleaved(torch.arange(shape[0])[:, None], *rope, cfg.qk_rope_dim)[:, 0]
        index[0] = hf_row[index[0]]
    if start is not None:
        index[fused] = index[fused] + start
    hf_index = index[::-1] if conv else index
    if not all(len(i) for i in hf_index):
        return out
    if not hf_index:
        t = f.get_tensor(key)
    else:
        spans = [slice(int(i.min()), int(i.max()) + 1) for i in hf_index]
        t = f.get_slice(key)[tuple(spans)]
        for d, (i, span) in enumerate(zip(hf_index, spans)):
            if len(i) != span.stop - span.start or not torch.equal(i, torch.arange(span.start, span.stop)):
                t = t.index_select(d, i - span.start)
    out[keep] = (t.t() if conv else t).to(out.dtype)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanomega.hf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="a checkpoint (or a run's latest) -> a Hugging Face folder")
    ex.add_argument("source", help="a ckpt-NNNNNNNN directory, or a run directory (its latest checkpoint)")
    ex.add_argument("out", help="the folder to write (config.json, safetensors shards, index)")
    ex.add_argument("--shard-gb", type=float, default=5.0, help="at most this many GB per safetensors file")
    ex.add_argument("--dtype", choices=EXPORT_DTYPES, default=None,
                    help="the weights' dtype (default: the run's train.param_dtype: bfloat16 if it trained so)")
    args = ap.parse_args(argv)
    try:
        out = export(args.source, args.out, int(args.shard_gb * 2**30), args.dtype)
    except (ValueError, checkpoint.CheckpointMismatch, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {out} (from {checkpoint_dir(args.source)}): load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0

