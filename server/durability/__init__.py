"""Durability: what outlives a broker that dies. The journal of objects, queues and sessions
(journal.py), the state directory and its lock (state.py, Note [recovery]), and what a state
left behind by a broker that is gone (leftovers.py).

Imports no other wing: every wing above may write to the journal."""
