"""The cluster: everything between brokers (Note [cluster] in cluster.py). Joining and the
links to the peers (joining.py, links.py), versions offered and pulled over NIXL (offers.py,
transfers.py, mover.py, records.py, pulls.py, lending.py, replicas.py), and queues across
nodes (arrivals.py, queue_links.py).

May import: queues, store, durability. Not sessions."""
