"""The few pytree helpers the project needs, on top of torch.utils._pytree.

Parameters, gradients and optimizer states are nested dicts/lists/tuples of tensors.
Every leaf has a dotted name ("layers.0.attn.wq.weight"); sharding plans, optimizer
partitions, checkpoints and Hugging Face conversion all speak these names.
"""
from __future__ import annotations

import torch.utils._pytree as pytree
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401 (re-exported)


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def named_leaves(tree) -> dict:
    """{dotted name: leaf} in the tree's deterministic flatten order."""
    with_path, _ = pytree.tree_flatten_with_path(tree)
    return {".".join(map(_key_name, path)): leaf for path, leaf in with_path}


def leaf_names(tree) -> list[str]:
    return list(named_leaves(tree))


def map_with_name(fn, tree):
    """tree_map where fn also receives the leaf's dotted name: fn(name, leaf)."""
    return pytree.tree_map_with_path(lambda path, x: fn(".".join(map(_key_name, path)), x), tree)
