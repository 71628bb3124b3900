"""Everything that knows about ranks: mesh, sharding plan, activation hints, parallel optimizer.

A reader who skips this package still understands the whole model and training loop; see
docs/parallelism.md for each layout with its placements.
"""
