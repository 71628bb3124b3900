"""MLP kinds: each is one entry in a registry that everything else reads.

    def relu2(p, x, cfg):            # p holds the entry's matrices, each {"weight", ("bias")}
        return linear(p["w_down"], F.relu(linear(p["w_up"], x, cfg)).square(), cfg)

    register(MLPKind("relu2", relu2, column=("w_up",), row=("w_down",), width=lambda d: 4 * d))

An entry declares what the rest of the system would otherwise have to know about a kind by name:
    forward   (p, x [B, T, d], cfg) -> [B, T, d], the maths, built from layers.linear (float8 as cfg.fp8 says)
    column    the d_model -> hidden matrices, weights [f, d] (+ bias [f]): tensor parallel splits their outputs
    row       the hidden -> d_model matrices, weights [d, f] (+ bias [d]): split on their inputs (a partial sum
              follows), initialised as residual projections (init_std / sqrt(2 n_layers))
    width     the hidden width f for d_model when model.ffn_dim is 0
Readers: the block's forward (`mlp`), models/transformer.py's param_specs (names, shapes, init kinds; so init,
checkpoints and the parameter and FLOP counts of sim/counting.py follow), parallel/plan.py (column / row
parallel, through `matrix_roles`), parallel/mesh.py (tp must divide `hidden_dim`), hf/convert.py (the width
its config gets). A Hugging Face family names its kind (config/hf_folder.py's FAMILIES: GPT-2's is gelu).

Why a model.mlp string checked here and not in config.validate: config/ sits below models/ and cannot read
this registry. An unknown kind is refused by `kind_of`, which param_specs calls first: train.py's preflight
reaches it through the parameter count before any data or parameter is touched, and every other path (init,
the simulator, conversion) before it allocates anything.

Matrix names start with "w_": float8 runs the MLP matrices it finds by that pattern (models/fp8.py's FP8_LINEARS).
A name is column or row parallel in every kind that uses it (`register` refuses a conflict), so the sharding
plan can read a parameter's role from its name alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from nanomega.config import ModelConfig
from nanomega.models.layers import linear


@dataclass(frozen=True)
class MLPKind:
    name: str
    forward: Callable[[dict, torch.Tensor, ModelConfig], torch.Tensor]
    column: tuple[str, ...]
    row: tuple[str, ...]
    width: Callable[[int], int]


KINDS: dict[str, MLPKind] = {}


def register(kind: MLPKind) -> MLPKind:
    """Adds `kind` to KINDS (at import of the module that declares it) and returns it."""
    if kind.name in KINDS:
        raise ValueError(f"an MLP kind named {kind.name!r} is already registered; choose another name")
    bad = [m for m in kind.column + kind.row if not m.startswith("w_")]
    if bad or not kind.column or not kind.row:
        raise ValueError(f"MLP kind {kind.name!r} needs column and row matrices named w_*; got column={kind.column}, "
                         f"row={kind.row}")
    roles = matrix_roles()
    clash = [f"{m} {role} parallel (another kind has it {roles[m]} parallel)" for m, role in _roles(kind).items()
             if roles.get(m, role) != role]
    if clash:
        raise ValueError(f"MLP kind {kind.name!r} makes {'; '.join(clash)}; a matrix name has one role in every kind "
                         "(the sharding plan reads it from the name): rename the matrix")
    KINDS[kind.name] = kind
    return kind


def _roles(kind: MLPKind) -> dict[str, str]:
    return {**{m: "column" for m in kind.column}, **{m: "row" for m in kind.row}}


def matrix_roles() -> dict[str, str]:
    """{matrix name: "column" | "row"} over every registered kind (parallel/plan.py's MLP rules)."""
    return {m: role for kind in KINDS.values() for m, role in _roles(kind).items()}


def kind_of(cfg: ModelConfig) -> MLPKind:
    """The registered kind model.mlp names; refuses an unknown name with the known ones."""
    if cfg.mlp not in KINDS:
        raise ValueError(f"model.mlp={cfg.mlp!r} is not a registered MLP kind; choose one of {sorted(KINDS)} "
                         "(nanomega/models/mlp.py registers them)")
    return KINDS[cfg.mlp]


def hidden_dim(cfg: ModelConfig) -> int:
    """The dense MLP's hidden width: model.ffn_dim, or (0) the kind's default for d_model."""
    return cfg.ffn_dim or kind_of(cfg).width(cfg.d_model)


def expert_dim(cfg: ModelConfig) -> int:
    """One routed expert's hidden width: model.expert_ffn_dim, or (0) the dense MLP's."""
    return cfg.expert_ffn_dim or hidden_dim(cfg)


def mlp(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The model's MLP kind on x [B, T, d]."""
    return kind_of(cfg).forward(p, x, cfg)


def _gelu(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return linear(p["w_down"], F.gelu(linear(p["w_up"], x, cfg), approximate="tanh"), cfg)


def _swiglu(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return linear(p["w_down"], F.silu(linear(p["w_gate"], x, cfg)) * linear(p["w_up"], x, cfg), cfg)


# GPT-2: tanh-approximated GELU, 4 d wide
GELU = register(MLPKind("gelu", _gelu, column=("w_up",), row=("w_down",), width=lambda d: 4 * d))
# LLaMA: silu(x W_gate) * (x W_up), 8/3 d wide (the same parameters as a 4 d ungated MLP) rounded up to 256
SWIGLU = register(MLPKind("swiglu", _swiglu, column=("w_gate", "w_up"), row=("w_down",),
                          width=lambda d: (int(8 * d / 3) + 255) // 256 * 256))
