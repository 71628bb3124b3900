"""`--train.init_from=<Hugging Face folder>`: its config.json becomes our ModelConfig, its weights our
parameters, each rank reading only the regions of its own pieces (nanomega/hf/transfer.py `load_params`).

The folders are written by `transformers` itself (a randomly initialised model of every family,
save_pretrained in several shards), so the reference is independent of our conversion: our forward on the
loaded parameters gives HF's logits. A rank's part (any box of the whole tensor) equals that slice of the
serially loaded tensor, and reads no more than its elements. The round trip through a 4-process run
(FSDP 2 x tp 2), with export, is in tests/test_parallel_train.py.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from nanomega import checkpoint

from nanomega.hf import transfer as hf
from nanomega.config import ModelConfig, parse_args
from nanomega.config.hf_folder import model_fields_from_hf, model_from_hf
from nanomega.models import forward, init
from nanomega.models.mlp import hidden_dim
from nanomega.hf.convert import hf_config
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten
from test_hf_export import CASES

transformers = pytest.importorskip("transformers")


def hf_folder(model_cfg: ModelConfig, path: Path, seed: int = 0) -> Path:
    """A randomly initialised transformers model of model_cfg's family, saved in several shards."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(model_cfg))
    with torch.no_grad():   # DeepSeek-V3's expert-score bias starts at zero: give it values to carry
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
    model.save_pretrained(str(path), max_shard_size="40KB")
    return path


def with_bias(model_cfg: ModelConfig) -> ModelConfig:
    """DeepSeek-V3's folders carry an expert bias, which our model holds when it moves it."""
    return dataclasses.replace(model_cfg, expert_bias_rate=1e-3) if model_cfg.attention == "mla" and \
        model_cfg.n_experts else model_cfg


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("family", CASES)
def test_a_transformers_folder_loads_with_its_architecture_and_logits(tmp_path, family):
    model_cfg = with_bias(CASES[family])
    folder = hf_folder(model_cfg, tmp_path / "hf")
    assert len(json.loads((folder / hf.INDEX).read_text())["weight_map"]) > 1
    # config.json -> the architecture: the HF config it gives back is the folder's, and so are the shapes
    cfg = model_from_hf(str(folder), ModelConfig(expert_bias_rate=model_cfg.expert_bias_rate), [])
    ours, theirs = hf_config(cfg).to_dict(), hf_config(model_cfg).to_dict()
    assert {k: v for k, v in ours.items() if k != "initializer_range"} == {   # the run's init, not the weights'
        k: v for k, v in theirs.items() if k != "initializer_range"}
    assert {n: t.shape for n, t in named_leaves(init(cfg, device="meta")).items()} == {
        n: t.shape for n, t in named_leaves(init(model_cfg, device="meta")).items()}
    params = hf.load_params(folder, init(cfg, seed=5), cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    theirs = hf_logits(folder, tokens)
    with torch.no_grad():
        ours = forward(params, tokens, cfg)[..., :cfg.vocab_size]
    assert (theirs - ours).norm() <= 1e-5 * ours.norm()
    assert all(p.requires_grad and p.dtype == torch.float32 for p in named_leaves(params).values())


class CountingOpen:
    """safe_open that counts the elements each tensor slice reads."""

    def __init__(self, real, counts: dict):
        self.real, self.counts = real, counts

    def __call__(self, *args, **kwargs):
        outer, counts = self, self.counts
        handle = outer.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                self.h = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_slice(self, key):
                sl = self.h.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, index):
                        t = sl[index]
                        counts[key] = counts.get(key, 0) + t.numel()
                        return t
                return Slice()

            def get_tensor(self, key):
                t = self.h.get_tensor(key)
                counts[key] = counts.get(key, 0) + t.numel()
                return t

            def keys(self):
                return self.h.keys()
        return Handle()


@pytest.mark.parametrize("family", CASES)
def test_a_ranks_part_is_its_slice_and_reads_no_more(tmp_path, monkeypatch, family):
    """Each leaf cut in two along every dim of size >= 2 (a rank of a 2 x 2 or 2 x 2 x 2 grid): the part
    read alone is that slice of the whole, bitwise, and reads only its own elements (MLA's permuted rope
    rows: at most the span of the rows it needs)."""
    model_cfg = with_bias(CASES[family])
    folder = hf_folder(model_cfg, tmp_path / "hf")
    cfg = model_from_hf(str(folder), ModelConfig(expert_bias_rate=model_cfg.expert_bias_rate), [])
    whole = named_leaves(hf.load_params(folder, init(cfg, device="meta"), cfg))
    counts: dict = {}
    monkeypatch.setattr(hf, "safe_open", CountingOpen(hf.safe_open, counts))
    for corner in (0, 1):
        boxes, parts = {}, []
        for name, t in whole.items():
            offset = [n // 2 * corner if n >= 2 else 0 for n in t.shape]
            local = [n - n // 2 if n >= 2 and corner else (n // 2 if n >= 2 else n) for n in t.shape]
            boxes[name] = (list(t.shape), offset)
            parts.append(torch.zeros(local))
        like = tree_unflatten(parts, tree_flatten(init(cfg, device="meta"))[1])
        counts.clear()
        got = named_leaves(hf.load_params(folder, like, cfg, box_of=lambda name, ref: boxes[name]))
        needed = 0
        for name, t in whole.items():
            index = tuple(slice(o, o + n) for o, n in zip(boxes[name][1], got[name].shape))
            assert torch.equal(got[name], t[index].detach()), (corner, name)
            needed += got[name].numel()
        read = sum(counts.values())
        slack = 1.5 if cfg.attention == "mla" else 1.0
        assert read <= slack * needed, (corner, read, needed)


def test_what_our_models_do_not_compute_is_refused_naming_the_key(tmp_path):
    llama = CASES["llama"]
    folder = hf_folder(llama, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    for change, message in ((dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}),
                             "rope_type='dynamic'"),
                            (dict(hidden_act="gelu"), "hidden_act='gelu'"),
                            (dict(model_type="mamba"), "model_type='mamba'")):
        with pytest.raises(ValueError, match=message):
            model_fields_from_hf({**config, **change})
    with pytest.raises(ValueError, match="no config.json"):
        parse_args([f"--train.init_from={tmp_path}"])


def test_an_override_that_contradicts_the_weights_is_refused_and_one_that_agrees_is_kept(tmp_path):
    llama = CASES["llama"]
    folder = hf_folder(llama, tmp_path / "hf")
    wide = 2 * llama.d_model
    with pytest.raises(ValueError, match=rf"--model.d_model={wide} contradicts .*d_model={llama.d_model}"):
        parse_args([f"--train.init_from={folder}", f"--model.d_model={wide}", "--train.seq_len=16"])
    cfg = parse_args([f"--train.init_from={folder}", f"--model.d_model={llama.d_model}", "--model.max_seq_len=32",
                      "--model.vocab_multiple=128", "--train.seq_len=32"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.max_seq_len, cfg.model.vocab_multiple) == (
        llama.d_model, llama.n_layers, 32, 128)      # rope: max_seq_len is the run's; padding too


def test_weights_that_do_not_fit_the_config_are_named(tmp_path):
    llama = CASES["llama"]
    folder = hf_folder(llama, tmp_path / "hf")
    cfg = model_from_hf(str(folder), ModelConfig(), [])
    wider = dataclasses.replace(cfg, ffn_dim=hidden_dim(cfg) * 2)
    with pytest.raises(checkpoint.CheckpointMismatch, match="mlp.gate_proj.weight' has shape"):
        hf.load_params(folder, init(wider, device="meta"), wider)
    deeper = dataclasses.replace(cfg, n_layers=cfg.n_layers + 1)
    with pytest.raises(checkpoint.CheckpointMismatch, match="lacks 'model.layers"):
        hf.load_params(folder, init(deeper, device="meta"), deeper)
    shallower = dataclasses.replace(cfg, n_layers=cfg.n_layers - 1)
    with pytest.raises(checkpoint.CheckpointMismatch, match="no place in this model"):
        hf.load_params(folder, init(shallower, device="meta"), shallower)
