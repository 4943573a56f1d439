"""reffsdp's tests. A package, so that a test file can import shared test bodies from another:
the gloo tests under ``multiprocess/`` run the threaded tests' mixins on a second harness."""
