"""Kernel benchmarks: `python -m prefixgate.kernels.bench` (micro), and the engine
end to end (e2e)."""
