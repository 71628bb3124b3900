"""nanomega: Megatron-style LLM training as pure functions over parameter pytrees."""
