"""reffsdp: a readable reference implementation of PyTorch Fully Sharded Data Parallel."""
