"""The round engine: rounds played in one process (rounds), the virtual clock of simulated
device speeds (vclock), the straggler draws and device profiles it reads (heterogeneity) and
robust aggregation (robust)."""
