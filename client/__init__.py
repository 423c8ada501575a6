"""The client side: `Client`, `Tensor` (a DLPack producer over shared memory), mapping caches."""
