"""The broker: its loop, object registry, shared-memory arena and client sessions."""
