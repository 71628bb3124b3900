"""A per-rank checkpoint put back together in one process (parallel/gather_checkpoint.py)."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from nanomega.checkpoint import FORMAT
from nanomega.checkpoint.files import BOXES
from nanomega.config import parse_args, to_dict
from nanomega.models import init
from nanomega.parallel.gather_checkpoint import whole_params
from nanomega.parallel.mesh import model_config
from nanomega.parallel.plan import layout_of
from nanomega.tree import named_leaves

ARGS = ["--model.vocab_size=251", "--model.vocab_multiple=1", "--model.d_model=32", "--model.n_layers=2",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=96", "--train.batch_size=4",
        "--parallel.dp_shard=2", "--parallel.tp=2"]


def test_fsdp_x_tp_shards_with_a_padded_vocabulary_reassemble_to_the_serial_parameters(tmp_path):
    """Shards cut with torch's own chunking (tensor.chunk, as DTensor cuts them) at each rank's mesh
    coordinate (rank = 2 * dp_shard index + tp index), the vocabulary padded 251 -> 252 for tp=2; each rank
    file's header says where its pieces lie (their global shape and offset), as a parallel save writes it."""
    cfg = parse_args(ARGS)
    serial = init(cfg.model, seed=3)                       # 251 vocabulary rows
    padded = init(model_config(cfg), seed=3)               # 252: the tp=2 run's tensors
    mesh = type("Mesh", (), {"mesh_dim_names": ("dp_shard", "tp")})()
    for rank in range(4):
        coords = {"dp_shard": rank // 2, "tp": rank % 2}
        shards, boxes = {}, {}
        for name, p in named_leaves(padded).items():
            t, offset = p.detach(), [0] * p.dim()
            for dim_name, placement in zip(mesh.mesh_dim_names, layout_of(name, t.shape, mesh, cfg).storage):
                if placement.is_shard():
                    offset[placement.dim] += coords[dim_name] * -(-t.shape[placement.dim] // 2)
                    t = t.chunk(2, dim=placement.dim)[coords[dim_name]]
            shards[name], boxes[name] = t.contiguous(), [list(p.shape), offset]
        save_file(shards, str(tmp_path / f"params-rank{rank:05d}.safetensors"), {BOXES: json.dumps(boxes)})
    (tmp_path / "meta.json").write_text(json.dumps({"format": FORMAT, "world_size": 4, "step": 7,
                                                    "config": to_dict(cfg)}))

    whole, meta = whole_params(tmp_path)
    assert meta["step"] == 7
    want = named_leaves(serial)
    assert named_leaves(whole).keys() == want.keys()
    for name, p in named_leaves(whole).items():
        assert torch.equal(p, want[name].detach()), name
