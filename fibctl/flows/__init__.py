"""Flows: the glue that runs the compute layer against the record layer (workers, the
evaluation runner, the demo, benchmarks). The CLI calls one flow per command."""
