"""Shared by the broker and the client: wire protocol, descriptors, dtypes, errors, config."""
