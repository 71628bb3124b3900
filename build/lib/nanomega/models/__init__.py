"""Models as pure functions over parameter pytrees."""
from nanomega.models.transformer import forward, init, loss_fn, param_specs

__all__ = ["forward", "init", "loss_fn", "param_specs"]
