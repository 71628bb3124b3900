"""nanomega.run.metrics: parameter counts checked against Hugging Face models built independently,
the FLOPs formula against a hand count, the peak-FLOPs cache, and the metrics log."""
import dataclasses
import json
import math
import os
import time

import numpy as np
import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from nanomega.config import ModelConfig
from nanomega.run import metrics
from nanomega.run.metrics import MetricsLog, Throughput, lookup_peak, mfu, peak_flops, read_metrics
from nanomega.sim.devices import DEVICES
from nanomega.sim.counting import count_params, flops_per_token
from nanomega.models.mlp import hidden_dim

SPECIAL = dict(bos_token_id=0, eos_token_id=0)   # HF defaults (e.g. GPT-2's 50256) exceed tiny vocabs


def llama(c: ModelConfig, cls=LlamaForCausalLM, conf=LlamaConfig, **extra):
    """A Hugging Face LLaMA-family model with the shape of `c`, parameters on the meta device."""
    with torch.device("meta"):
        return cls(conf(vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                        num_attention_heads=c.n_heads, num_key_value_heads=c.kv_heads,
                        intermediate_size=hidden_dim(c), max_position_embeddings=c.max_seq_len,
                        tie_word_embeddings=c.tie_embeddings, **SPECIAL, **extra))


def gpt2(c: ModelConfig):
    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_embd=c.d_model, n_layer=c.n_layers,
                                          n_head=c.n_heads, n_inner=hidden_dim(c), n_positions=c.max_seq_len,
                                          tie_word_embeddings=True, **SPECIAL))


def hf_count(model) -> int:
    return sum(p.numel() for p in model.parameters())   # a tied head is one Parameter, counted once


GPT2_LIKE = dict(norm="layernorm", mlp="gelu", position="learned", tie_embeddings=True, bias=True)

# (our config, the independent Hugging Face model of the same shape)
TINY = {
    "llama_gqa_untied": ModelConfig(vocab_size=128, vocab_multiple=1, d_model=64, n_layers=2, n_heads=4,
                                    n_kv_heads=2, ffn_dim=96),
    "llama_default_ffn": ModelConfig(vocab_size=64, vocab_multiple=1, d_model=96, n_layers=1, n_heads=3),
    "gpt2_tied_learned_bias": ModelConfig(vocab_size=128, vocab_multiple=1, d_model=64, n_layers=2,
                                          n_heads=4, max_seq_len=32, **GPT2_LIKE),
    "qwen2_qkv_bias": ModelConfig(vocab_size=128, vocab_multiple=1, d_model=64, n_layers=2, n_heads=4,
                                  n_kv_heads=1, ffn_dim=160, qkv_bias=True, tie_embeddings=True),
    "qwen3_qk_norm_head_dim": ModelConfig(vocab_size=128, vocab_multiple=1, d_model=64, n_layers=2,
                                          n_heads=4, n_kv_heads=2, head_dim=24, ffn_dim=96, qk_norm=True),
}
HF = {
    "llama_gqa_untied": llama,
    "llama_default_ffn": llama,
    "gpt2_tied_learned_bias": gpt2,
    "qwen2_qkv_bias": lambda c: llama(c, Qwen2ForCausalLM, Qwen2Config),
    "qwen3_qk_norm_head_dim": lambda c: llama(c, Qwen3ForCausalLM, Qwen3Config, head_dim=c.dim_head),
}


@pytest.mark.parametrize("name", TINY)
def test_count_params_matches_hugging_face(name):
    cfg = TINY[name]
    cfg.validate()
    assert count_params(cfg) == count_params(cfg, padded=True) == hf_count(HF[name](cfg))


PUBLISHED = {   # name: (config, count reported for the released checkpoint)
    "llama3_8b": (ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              ffn_dim=14336, max_seq_len=8192), 8_030_261_248),
    "gpt2_124m": (ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, ffn_dim=3072,
                              max_seq_len=1024, **GPT2_LIKE), 124_439_808),
    "tinyllama_1.1b": (ModelConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                                   ffn_dim=5632, max_seq_len=2048), 1_100_048_384),
    "qwen3_0.6b": (ModelConfig(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                               head_dim=128, ffn_dim=3072, qk_norm=True, tie_embeddings=True,
                               norm_eps=1e-6, max_seq_len=40960), 596_049_920),
}
PUBLISHED_HF = {"llama3_8b": llama, "gpt2_124m": gpt2, "tinyllama_1.1b": llama,
                "qwen3_0.6b": lambda c: llama(c, Qwen3ForCausalLM, Qwen3Config, head_dim=c.dim_head)}


@pytest.mark.parametrize("name", PUBLISHED)
def test_count_params_published_shapes(name):
    cfg, published = PUBLISHED[name]
    assert count_params(cfg) == published == hf_count(PUBLISHED_HF[name](cfg))
    # Padding only adds embedding rows (twice when untied: embedding and head).
    extra = (cfg.padded_vocab - cfg.vocab_size) * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    assert count_params(cfg, padded=True) == published + extra


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_hand_formula(tied):
    # vocab 100 pads to 128: the head matmul runs at 128 rows.
    L, d, H, hd, f, V, T, S = 2, 32, 4, 8, 64, 128, 16, 48
    cfg = ModelConfig(vocab_size=100, vocab_multiple=64, d_model=d, n_layers=L, n_heads=H, n_kv_heads=2,
                      ffn_dim=f, max_seq_len=S, position="learned", norm="layernorm", tie_embeddings=tied)
    kv = 2 * hd
    layer = (d * H * hd + 2 * d * kv + H * hd * d) + 3 * d * f + 2 * (2 * d)   # attn, swiglu, 2 LayerNorms
    n = V * d + S * d + L * layer + 2 * d + (0 if tied else V * d)
    assert count_params(cfg, padded=True) == n
    embedding = V * d + S * d
    head_back = V * d if tied else 0          # a tied head still does a [d, V] matmul
    expected = 6 * (n - embedding + head_back) + 12 * L * H * hd * T
    assert flops_per_token(cfg, T) == expected
    # Tying changes the parameter count but not the arithmetic.
    untied = flops_per_token(dataclasses.replace(cfg, tie_embeddings=not tied), T)
    assert untied == expected


def test_flops_matmul_params_from_hugging_face():
    # N_matmul is every HF parameter except the lookup tables (wte, wpe), plus the tied head.
    cfg = TINY["gpt2_tied_learned_bias"]
    model = gpt2(cfg)
    n_matmul = sum(p.numel() for k, p in model.named_parameters() if k.split(".")[1] not in ("wte", "wpe"))
    n_matmul += cfg.vocab_size * cfg.d_model
    T = 32
    assert flops_per_token(cfg, T) == 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * T


def test_lookup_peak_names():
    assert lookup_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert lookup_peak("NVIDIA H100 PCIe") == 756e12
    assert lookup_peak("NVIDIA H200") == 989e12
    assert lookup_peak("NVIDIA A100-SXM4-80GB") == lookup_peak("NVIDIA A100 80GB PCIe") == 312e12
    assert lookup_peak("NVIDIA L4") == 121e12
    assert lookup_peak("NVIDIA L40S") == 362e12
    assert lookup_peak("NVIDIA L40") == 0.0   # not an L4
    assert lookup_peak("NVIDIA GeForce RTX 4090") == 165e12
    assert lookup_peak("AMD Instinct MI300X") == 1307e12
    assert lookup_peak("NVIDIA A10G") == 125e12 and lookup_peak("NVIDIA B200") == 2250e12
    assert lookup_peak("Tesla T4") == 0.0
    assert all(d.bf16_flops > 1e14 for d in DEVICES.values())


def test_the_datasheet_table_is_dense_figures_with_memory_on_every_entry():
    """One table (nanomega/sim/devices.py) for the MFU and the step-time model: fp8, where present, is twice bf16
    within the rounding of the bf16 figure, as every one of these datasheets gives it; fp32 below bf16."""
    for key, d in DEVICES.items():
        assert d.fp8_flops is None or abs(d.fp8_flops / d.bf16_flops - 2) < 0.03, key
        assert d.fp32_flops is None or d.fp32_flops < d.bf16_flops, key
        assert d.hbm_bytes >= 24e9 and d.hbm_bandwidth >= 300e9, key


def test_the_step_time_model_takes_only_gpus_with_interconnect_figures():
    from nanomega.sim.devices import device
    assert device("H100") is DEVICES["h100"]
    with pytest.raises(ValueError, match=r"GPU 'l4' has no NVLink or cluster network figures .* choose one of "
                                         r"\['a100', 'b200', 'h100', 'h100_hbm2e', 'h200'\]"):
        device("l4")
    with pytest.raises(ValueError, match=r"unknown GPU 'v100'; choose one of \['a100'"):
        device("v100")


def test_peak_flops_override_and_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.os, "getloadavg", lambda: (0.0, 0.0, 0.0))    # an idle machine: its rate is kept
    cpu = torch.device("cpu")
    assert peak_flops(cpu, torch.float32, override=123e12, cache_dir=str(tmp_path)) == 123e12
    assert not (tmp_path / "peak_flops.json").exists()     # an override measures nothing
    first = peak_flops(cpu, torch.float32, cache_dir=str(tmp_path))
    assert first > 1e8
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cache.values()) == [first] and "float32" in next(iter(cache))
    start = time.perf_counter()
    assert peak_flops("cpu", torch.float32, cache_dir=str(tmp_path)) == first
    assert time.perf_counter() - start < 0.05
    assert peak_flops(cpu, torch.float32, override=5.0, cache_dir=str(tmp_path)) == 5.0


def test_a_peak_measured_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    """More runnable processes than cores: the measured rate is this moment's share of the cores, so this run uses
    it and no later run inherits it."""
    monkeypatch.setattr(metrics.os, "getloadavg", lambda: (4.0 * (os.cpu_count() or 1), 0.0, 0.0))
    assert peak_flops("cpu", torch.float32, cache_dir=str(tmp_path)) > 1e8
    assert not (tmp_path / "peak_flops.json").exists()


def test_mfu_and_throughput():
    assert mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    rates = Throughput(flops_per_token=6e9, peak=12e12).rates(tokens=4000, seconds=2.0)
    assert rates == pytest.approx({"tokens_per_s": 2000.0, "mfu": 1.0})
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


def test_metrics_log_round_trip(tmp_path):
    path = tmp_path / "run" / "nested" / "metrics.jsonl"   # directories are created
    log = MetricsLog(path)
    log.log({"step": 1, "loss": torch.tensor(2.5), "lr": 3e-4, "grad_norm": np.float32(0.25), "ok": True})
    log.log({"step": 2, "loss": 2.0, "tokens": torch.tensor(7), "skipped": float("nan")})
    lines = path.read_text().splitlines()
    assert len(lines) == 2                                   # already on disk, no close() needed
    first, second = read_metrics(path)
    assert first == {"step": 1, "loss": 2.5, "lr": 3e-4, "grad_norm": 0.25, "ok": True}
    assert isinstance(second["loss"], float) and second["loss"] == 2.0   # stays a float, not 2
    assert second["tokens"] == 7 and isinstance(second["tokens"], int)
    assert math.isnan(second["skipped"])
    MetricsLog(path).log({"step": 3})                        # a resumed run appends
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')                           # killed mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_peak_memory_on_the_cpu_is_the_process_peak_resident_memory():
    """A fresh process that touches half a GiB more than its peak so far reports a peak of at least that, equal to
    the operating system's own count of its peak (/proc's VmHWM, read independently). The tensor is sized from the
    peak before it: importing torch alone can peak above a fixed size (0.79 GiB on CI)."""
    import subprocess
    import sys
    code = ("import torch, re; from nanomega.run.metrics import peak_memory_gib as p; d = torch.device('cpu'); "
            "a = p(d); x = torch.ones(int((a + 0.5) * 2**28)); b = p(d); "
            "hwm = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 2**20; "
            "print(a, b, hwm)")
    before, after, hwm = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout.split())
    assert after >= before + 0.5               # (before + 0.5) GiB of float32, touched by ones()
    assert after == pytest.approx(hwm, rel=0.02)
