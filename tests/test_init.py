"""Parameter init (models/transformer.py `init`, models/init_streams.py): the serial numbers follow the
intended normal laws, and any rank's shard, drawn alone through init's place hook, is the serial tensor's
slice, bitwise, under every layout's placements (parallel/plan.py), uneven splits included."""
import itertools
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from nanomega.config import Config, ModelConfig, ParallelConfig
from nanomega.models import init
from nanomega.models.init_streams import TILE
from nanomega.models.transformer import NORMAL, RESIDUAL, VOCAB, named_specs, param_specs
from nanomega.parallel.mesh import MESH_DIMS, MeshShape, expert_grid
from nanomega.parallel.plan import layout_of, shard_index
from nanomega.tree import named_leaves

# dims above TILE and not multiples of it, so shards cut tiles in both directions; 300 pads to 320
DENSE = ModelConfig(vocab_size=300, d_model=192, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=320,
                    max_seq_len=16, qkv_bias=True, init_std=0.02)
MOE = ModelConfig(vocab_size=300, d_model=192, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=320, max_seq_len=16,
                  n_experts=6, top_k=2, expert_ffn_dim=160, shared_ffn_dim=160, first_dense_layers=1, init_std=0.02)


def random_leaves(cfg) -> dict:
    """{name: (kind, the std it is drawn with)} of the leaves init draws at random."""
    residual = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return {name: (kind, residual if kind == RESIDUAL else cfg.init_std)
            for name, (_, kind) in named_specs(param_specs(cfg)).items() if kind in (NORMAL, RESIDUAL, VOCAB)}


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_serial_init_follows_the_normal_laws(cfg):
    """Each random leaf's sample mean and std against N(0, std) in float64, within 5 standard errors of
    its sample size (mean: std/sqrt(n); sample std: std/sqrt(2n)); deterministic in the seed; padding
    rows 0, norm gains 1, biases 0."""
    a, b, c = (named_leaves(init(cfg, seed)) for seed in (0, 0, 1))
    drawn = random_leaves(cfg)
    for name, t in a.items():
        assert t.dtype == torch.float32 and t.requires_grad and torch.equal(t, b[name]), name
        if name not in drawn:
            assert torch.equal(t, torch.ones_like(t) if name.endswith("norm.weight") else torch.zeros_like(t)), name
            continue
        kind, std = drawn[name]
        if kind == VOCAB:
            assert not t[cfg.vocab_size:].any(), name
            t = t[:cfg.vocab_size]
        x, n = t.detach().double().flatten(), t.numel()
        assert abs(x.mean().item()) < 5 * std / math.sqrt(n), name
        assert abs(x.std().item() / std - 1) < 5 / math.sqrt(2 * n), name
        assert not torch.equal(a[name], c[name]), name


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_tiles_are_independent_streams(cfg):
    """Every tile of the model (each expert's own) comes from its own stream: no two tiles start alike
    (torch's CPU generator keeps 32 bits of a seed; hashing names into them would repeat some), and
    neighbouring tiles are uncorrelated (|r| within 5 / sqrt(n) of 0)."""
    params = named_leaves(init(cfg, 0))
    starts = []
    for name in random_leaves(cfg):      # matrices over the last two dims; the vocabulary's real rows only
        w = params[name].detach()[:cfg.vocab_size]
        for m in w.reshape(-1, *w.shape[-2:]):
            starts += [tuple(m[i, j:j + 4].tolist()) for i in range(0, len(m), TILE) for j in range(0, m.shape[1], TILE)]
    assert len(starts) == len(set(starts)) > 20
    w = params["layers.0.mlp.w_up.weight"].detach().double()     # [320, 192]: tiles of 128 x 128 and 128 x 64
    corner = w[:TILE, :TILE]
    for other in (w[:TILE, TILE:], w[TILE:2 * TILE, :TILE]):
        a, b = corner[:, :other.shape[1]].flatten(), other.flatten()
        r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(r) < 5 / math.sqrt(len(a))


# (model, parallel settings): every rank of the mesh (and of the expert mesh) is simulated
LAYOUTS = {
    "fsdp3_uneven": (DENSE, dict(dp_shard=3)),                  # Shard(0), the first ranks' chunks larger
    "fsdp12_empty_chunk": (DENSE, dict(dp_shard=12)),           # wk's 64 rows in 12: 6 x 10, 4, and 0 for the last
    "tp2": (DENSE, dict(tp=2)),                                 # column Shard(0), row Shard(1), vocab-parallel
    "tp3_uneven": (DENSE, dict(tp=3)),
    "fsdp2_tp3": (DENSE, dict(dp_shard=2, tp=3)),               # FSDP beside tp: Shard(1) of column weights
    "hsdp_zero1": (DENSE, dict(dp_replicate=2, dp_shard=3, distributed_optimizer=True)),
    "ep3_fsdp9": (MOE, dict(dp_shard=9, ep=3)),                 # experts Shard(0) on ep, Shard(1) on edp (uneven)
    "ep2_tp2": (MOE, dict(dp_shard=2, tp=2, ep=2)),             # experts whole on ep, replicated on etp
}


def meshes(cfg) -> list[MeshShape]:
    """The main mesh (build_mesh's dims larger than 1) and, for an MoE model, the expert mesh, as shapes."""
    sizes = {name: getattr(cfg.parallel, name) for name in MESH_DIMS if getattr(cfg.parallel, name) > 1}
    out = [MeshShape(tuple(sizes), tuple(sizes.values()))]
    if cfg.model.n_experts:
        names, grid = expert_grid(cfg)
        out.append(MeshShape(names, tuple(grid.shape)))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_draws_its_shard_alone_equal_to_the_serial_slice(layout):
    model, parallel = LAYOUTS[layout]
    cfg = Config(model=model, parallel=ParallelConfig(**parallel))
    mesh, *expert_mesh = meshes(cfg)
    serial = named_leaves(init(model, seed=3))
    layouts = {name: layout_of(name, t.shape, mesh, cfg, *expert_mesh) for name, t in serial.items()}
    split, empty = set(), set()
    for rank_mesh in (mesh, *expert_mesh):    # each mesh's ranks, and their parts of the leaves on it
        for coords in itertools.product(*(range(s) for s in rank_mesh.shape)):
            on_mesh = [name for name in serial if layouts[name].mesh is rank_mesh]

            def index(name):
                lay = layouts[name]
                return shard_index(serial[name].shape, lay.storage, lay.mesh.shape, coords)
            parts = named_leaves(init(model, seed=3, place=lambda name, part: part(index(name))
                                      if name in on_mesh else None))
            for name in on_mesh:
                expected = serial[name].detach()[index(name)]
                assert parts[name].shape == expected.shape and torch.equal(parts[name], expected), (coords, name)
                if expected.shape != serial[name].shape:
                    split.add(name)
                if expected.numel() == 0:
                    empty.add(name)
    assert any(".experts." in n for n in split) if model.n_experts else "tok_embed.weight" in split
    assert empty or "empty" not in layout, "the case meant to give a rank an empty chunk gives none"


def test_vocabulary_padding_changes_no_number():
    """Padding the vocabulary further (tensor parallel's multiple) leaves every number, later leaves' too."""
    wide = ModelConfig(**{**DENSE.__dict__, "vocab_multiple": 256})
    assert wide.padded_vocab > DENSE.padded_vocab
    a, b = named_leaves(init(DENSE, 0)), named_leaves(init(wide, 0))
    for name, t in a.items():
        rows = len(t)     # the wider vocabulary's extra rows are padding: zeros
        assert torch.equal(t, b[name][:rows]) and not b[name][rows:].any(), name


def test_random_false_draws_nothing_random():
    """init(random=False) (--train.init_from, whose weights overwrite them): random leaves 0, the rest as usual."""
    plain, skipped = named_leaves(init(DENSE, 0)), named_leaves(init(DENSE, 0, random=False))
    drawn = random_leaves(DENSE)
    for name, t in skipped.items():
        assert t.requires_grad and torch.equal(t, torch.zeros_like(t) if name in drawn else plain[name]), name


def test_fake_tensors_draw_nothing():
    """Under FakeTensorMode (estimate.py, contracts.py) a llama3_8b shard is a fake tensor at once, not a draw."""
    from tests.test_models import LLAMA3_8B
    with FakeTensorMode():
        parts = named_leaves(init(LLAMA3_8B, place=lambda name, part: part()))
    assert all(is_fake(t) for t in parts.values()) and parts["lm_head.weight"].shape == (128256, 4096)
