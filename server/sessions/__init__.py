"""Sessions: the clients and how they reach the broker. ZeroMQ and Unix-socket lanes
(sockets.py, lanes.py, backlog.py, endpoint.py), replies sent in order (outbox.py), and the
client sessions with their processes watched (sessions.py).

May import: store, durability. Not queues (a peer wing) nor cluster (above)."""
