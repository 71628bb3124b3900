"""The optimizers by name: each optimizer's file registers one `Optimizer`, and everything else reads it here.

    register(Optimizer("lion", LionSettings, lambda s, state_dtype, parts: {"lion": scale_by_lion(s.b1, s.b2)}))
    REGISTRY["muon"].elementwise        # False: FSDP / ZeRO hand it whole matrices (parallel/optimizer.py)
    check(cfg.optim)                    # MuonSettings(muon_momentum=0.95, ...), or a ValueError saying what to change

An `Optimizer` declares what the rest of the system needs and nothing else keeps a list of names:
- `settings`: a frozen dataclass of its own hyperparameters, their defaults (its own: Lion's b2 is 0.99, Adam's
  0.95) and their ranges or choices (`setting(...)`). OptimConfig carries the ones a run sets as (key, value)
  pairs; `check` types them against this class and refuses an unknown name or a setting it does not read.
- `directions(settings, state_dtype, parts) -> {label: GradientTransformation}`: its direction(s); the label
  names its state ("adam.mu.<param>"). `parts` are a parallel run's pieces (Muon's sharded Newton-Schulz,
  the index of a rank's first expert); a serial run gets the plain ones.
- `elementwise`: True when each parameter's update reads its own gradient and state alone (AdamW, SGD, Lion):
  it runs on shards (FSDP, TP, ZeRO) and one leaf at a time. False: a whole-matrix direction for the hidden
  matrices (optim.hidden_matrix), which parallel/optimizer.py feeds whole matrices on their owners, while
  Adam (the settings' beta1, beta2, eps, at lr * adam_lr_ratio: `MatrixAdam`) takes the other parameters.
- `coupled_decay`: weight decay added to the gradient before the directions (SGD's L2), not decoupled after.
- `tp_shards`: a whole-matrix direction that takes its maths on tensor-parallel shards through
  `parts.orthogonalize` (parallel.muon_tp=distributed: Muon's Newton-Schulz with an all-reduced Gram matrix).
- `refresh_every(settings)` and `branches`: what the step-time model amortizes (sim/step_time.py): the steps
  between its periodic work, and the optim.linalg.branch functions (qualified names) by the steps taking them.
- `matrix_cost(settings, (M, N))`: the FLOPs of one whole-matrix update of an [M, N] matrix, averaged over
  steps: parallel/ownership.py balances the matrices' owners by it (None: by elements).
State memory needs no declaration: `init` must run on meta tensors, and the accountants count what it builds
(optim/memory.py, sim/rank_bytes.py).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from nanomega.config import check_setting, setting   # setting: a settings field, as the config's own are
from nanomega.optim.linalg import newton_schulz


@dataclass(frozen=True)
class Adam:
    """Adam's settings (AdamW's own, and the Adam part of the whole-matrix optimizers)."""
    beta1: float = setting(0.9, "[0, 1)", "an EMA coefficient")
    beta2: float = setting(0.95, "[0, 1)", "an EMA coefficient")
    eps: float = setting(1e-8, "(0, inf)")


@dataclass(frozen=True)
class MatrixAdam(Adam):
    """A whole-matrix optimizer's settings for the parameters it leaves to Adam (embeddings, head, norms)."""
    adam_lr_ratio: float = setting(1.0, "(0, inf)", "the Adam part's lr as a fraction of optim.lr")


class Parts(NamedTuple):
    """A parallel run's pieces for a direction (optim.build's arguments of the same names)."""
    orthogonalize: Callable = newton_schulz
    first_expert: dict | None = None


@dataclass(frozen=True)
class KroneckerFactors(MatrixAdam):
    """The settings Shampoo and SOAP share: the EMA of each matrix's Kronecker factors (L = E[G Gᵀ], R = E[Gᵀ G])
    and the preconditioner refreshed from them every precondition_frequency steps (Shampoo's inverse roots,
    SOAP's eigenbases)."""
    precondition_frequency: int = setting(10, "[1, inf)", "steps between preconditioner refreshes")
    shampoo_beta: float = setting(0.95, "(0, 1]", "EMA of the Kronecker factors; 1 sums them (AdaGrad)")
    shampoo_eps: float = setting(1e-12, "(0, inf)", "added to the factors before their roots or eigh")
    # stored dtypes of the factors and of the preconditioner (roots or bases); "float32" stores them as computed
    factor_dtype: str = setting("float32", choices=("float32", "bfloat16"))
    basis_dtype: str = setting("float32", choices=("float32", "bfloat16"))


@dataclass(frozen=True)
class Optimizer:
    name: str
    settings: type
    directions: Callable[[Any, Any, Parts], dict]
    elementwise: bool = True
    coupled_decay: bool = False
    tp_shards: bool = False
    refresh_every: Callable[[Any], int] | None = None
    branches: dict = field(default_factory=dict)
    matrix_cost: Callable[[Any, tuple], float] | None = None


REGISTRY: dict[str, Optimizer] = {}


def register(spec: Optimizer) -> Optimizer:
    """Add an optimizer under spec.name (a module imported twice registers the same settings class again)."""
    old = REGISTRY.get(spec.name)
    if old is not None and old.settings.__qualname__ != spec.settings.__qualname__:
        raise ValueError(f"optimizer {spec.name!r} is registered already (settings {old.settings.__module__}."
                         f"{old.settings.__qualname__}); choose another name")
    REGISTRY[spec.name] = spec
    return spec


def spec_of(name: str) -> Optimizer:
    if name not in REGISTRY:
        raise ValueError(f"optim.name={name!r} is not a registered optimizer; known: {', '.join(sorted(REGISTRY))} "
                         "(a new one registers itself in its own file: docs/extending.md)")
    return REGISTRY[name]


def setting_names(name: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(spec_of(name).settings))


def _own(name: str, given: dict, scope: str = "") -> dict:
    """`given` typed and checked against optimizer `name`'s settings."""
    cls = spec_of(name).settings
    hints, fields = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in given.items():
        if key not in fields:
            raise ValueError(f"optim.{scope}{key} is not read by {name}; {name} reads "
                             + (", ".join(f"optim.{scope}{k}" for k in fields) or "no settings of its own")
                             + " (besides the common optim.lr, schedule, weight_decay, grad_clip, ...)")
        typ = hints[key]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)       # 1 on a command line is a float setting's 1.0
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ValueError(f"optim.{scope}{key}={value!r} is not a {typ.__name__} ({name}'s setting)")
        check_setting(f"optim.{scope}{key}", value, fields[key].metadata)
        out[key] = value
    return out


def check(cfg):
    """cfg's optimizer settings, typed: an instance of its optimizer's settings class. Raises, saying what to
    change, for an unknown optimizer name, a setting it does not read, or a value out of its range; a scoped
    setting (`NAME.KEY`) is checked against NAME's settings and read only when NAME is chosen."""
    cfg.validate()
    spec = spec_of(cfg.name)
    own, scoped = {}, {}
    for key, value in cfg.settings:
        scope, _, bare = key.rpartition(".")
        if not scope:
            own[key] = value
            continue
        if scope not in REGISTRY:
            raise ValueError(f"optim.{key}: {scope!r} is not a registered optimizer; known: "
                             + ", ".join(sorted(REGISTRY)))
        scoped.setdefault(scope, {})[bare] = value
    for scope, given in scoped.items():
        typed = _own(scope, given, scope + ".")
        if scope == spec.name:
            own = {**typed, **own}        # an unscoped setting wins over the scoped one
    return spec.settings(**_own(spec.name, own))


def stored_dtype(name: str):
    """A stored-dtype setting ("float32" | "bfloat16") as a factors/bases dtype: None for "float32", the maths'
    own (fp32, or fp64 for fp64 parameters)."""
    return None if name == "float32" else getattr(torch, name)
