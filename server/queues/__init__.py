"""Queues: ordinary and broadcast queues and their items. The queue table (queue_state.py),
the handlers (queues.py), bounded slots and credits (slots.py), queue rings in shared memory
(qring_state.py, qrings.py; Note [queue ring] in common/qring.py), broadcast rings and
subscriptions (rings.py, broadcast.py, subscriptions.py), and items handed straight to a
consumer (handoff.py, direct.py).

May import: store, durability. Not sessions (a peer wing) nor cluster (above)."""
