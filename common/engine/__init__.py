"""The round engine: rounds played in one process (rounds), the virtual clock of simulated
device speeds (vclock, devices) and robust aggregation (robust)."""
