"""The benchmarks: `fedhop bench transport | large | compute | scale | growth | gpu | flower`
(bench.py, bench_large.py, bench_system.py, bench_gpu.py), figures for the transport, the
framework's overhead, large models, many clients and GPUs, and the per-process memory of LEAF
client processes (leaf_memory.py, `python -m fedhop.deploy.bench.leaf_memory`)."""
