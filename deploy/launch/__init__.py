"""Starting a run's processes, wherever they run: `fedhop run` on this machine (launcher.py,
forked children in forkstart.py, run folders in runfolder.py, glibc malloc settings in malloc.py),
every role inside one process (inprocess.py, inmemory.py; engine.py says which engine a config
takes), `fedhop launch` on the machines of a hosts file (hosts.py), `fedhop slurm` (slurm.py),
docker compose (compose.py, and role.py, what each compose service or Kubernetes Job runs),
`fedhop k8s` (k8s_render.py), `fedhop netsim` on emulated hosts (netsim.py, with h2capture.py
for the bytes on a link), and the TLS credentials a cluster needs (`fedhop certs`, certs.py)."""
