"""The memory tier (docs/tiers.md): identity, memory saves, replicas, restore, transport and
signals, above the engine (the engine never imports this package).

Nothing is imported here, so `statereg.tiers.report` and `statereg.tiers.identity` stay
torch-free for the CLI.
"""
