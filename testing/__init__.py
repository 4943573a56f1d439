"""reffsdp's testing package: harnesses, process groups, comm counting, parity checks."""
