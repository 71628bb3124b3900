"""Sampling: greedy equals a hand-written argmax loop, top-k=1 is greedy, padding ids never come out."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from nanomega import checkpoint
from nanomega.config import Config, ModelConfig, to_dict
from nanomega.eval.generate import sample
from nanomega.models import forward, init

CFG = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                  init_std=0.5)


def test_greedy_matches_argmax_loop_and_crops_context():
    params = init(CFG, 0)
    prompt = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    out = sample(params, CFG, prompt, 20, temperature=0)  # runs past max_seq_len=16: context is cropped
    ref = prompt
    with torch.no_grad():
        for _ in range(20):
            logits = forward(params, ref[:, -16:], CFG)[:, -1, :100]
            ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_stop_ends_generation_at_the_token_it_names_on_the_cache_and_past_it():
    params = init(CFG, 0)
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    whole = sample(params, CFG, prompt, 20, temperature=0)            # the cache to 16 tokens, then recomputed
    for n in (1, 4, 11, 15):                                          # inside the cache and past max_seq_len
        seen = []
        out = sample(params, CFG, prompt, 20, temperature=0, stop=lambda new: seen.append(new.shape[1]) or
                     new.shape[1] == n)
        assert torch.equal(out, whole[:, :5 + n]) and seen == list(range(1, n + 1))
        assert torch.equal(sample(params, CFG, prompt, 20, temperature=0, recompute=True,
                                  stop=lambda new: new.shape[1] == n), out)


def test_top_k_one_is_greedy_and_seeded_sampling_is_deterministic():
    params = init(CFG, 1)
    prompt = torch.zeros(3, 1, dtype=torch.long)
    greedy = sample(params, CFG, prompt, 8, temperature=0)
    assert torch.equal(sample(params, CFG, prompt, 8, 1.5, top_k=1, generator=torch.Generator().manual_seed(5)),
                       greedy)
    a = sample(params, CFG, prompt, 8, 1.0, 10, torch.Generator().manual_seed(7))
    b = sample(params, CFG, prompt, 8, 1.0, 10, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_padding_ids_are_never_sampled():
    params = init(CFG, 2)
    with torch.no_grad():                      # make the padding rows (100..127) the most likely tokens
        params["lm_head"]["weight"][100:] = 50.0 * params["lm_head"]["weight"][:28].sign()
    out = sample(params, CFG, torch.zeros(4, 1, dtype=torch.long), 30, 1.0, 0, torch.Generator().manual_seed(0))
    assert int(out.max()) < 100


def test_sample_command_reads_a_checkpoint(tmp_path):
    cfg = Config(model=ModelConfig(d_model=32, n_layers=1, n_heads=4, ffn_dim=64, max_seq_len=16))
    params = init(cfg.model, 0)
    path = checkpoint.save(tmp_path, 3, params, (), {"config": to_dict(cfg), "data_position": 0,
                                                       "rng": checkpoint.rng_state()}, keep=1)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "sample.py", f"--ckpt={path}", "--tokens=10", "--temperature=0",
                           "--prompt=ab"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = sample(params, cfg.model, torch.tensor([[97, 98]]), 10, temperature=0)[0].tolist()
    assert bytes(expected).decode("utf-8", errors="replace") in done.stdout
