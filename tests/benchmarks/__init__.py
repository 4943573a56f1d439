"""Benchmarks, and the torch implementations ``python -m reffsdp.bench`` measures against."""
