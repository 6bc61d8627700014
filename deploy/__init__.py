"""What runs, inspects and measures experiments, by job: `cli/` the `fedhop` command line, `launch/`
what starts a run's processes (this machine, hosts over ssh, Slurm, compose, Kubernetes, emulated
hosts, one process), `tools/` what works on runs and their results (sweeps, reports, the live page,
data sets), `bench/` the benchmarks; api.py is the Python API (`fedhop.run`, `fedhop.load`)."""
