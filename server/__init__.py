"""The broker. Its loop and handler table (broker.py) sit on top of the wings, each a
sub-package whose docstring says what it owns and which wings it may import (checked by
`make lint`, import-linter's contracts in pyproject.toml), from the top down:

    broker.py (the loop), dispatch.py (each request to its room), ops.py (the op table),
    seals.py, adoption.py, inventory.py, metrics.py, opstats.py
    cluster/      everything between brokers
    queues/       sessions/      (peers: neither imports the other)
    store/        the arena, objects, leases, directory, grants
    durability/   the journal and the state directory
"""
