"""Named run configurations: each module defines `config() -> nanomega.config.Config`."""
