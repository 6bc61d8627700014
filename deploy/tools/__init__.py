"""Tools that work on experiments and their results: tuned comparisons (`fedhop sweep`: sweep.py,
its spec sweep_spec.py, bracketing in bracket.py), reading run directories (runread.py) and
comparing them (`fedhop report`: report.py, tensorboard.py), the live run page (`fedhop
dashboard`: dashboard.py, dashboard.html), merging an interrupted run's ledgers (`fedhop
merge-ledgers`: ledgers.py), and data sets (`fedhop data fetch`, `fedhop data show`: datafetch.py,
datashow.py)."""
