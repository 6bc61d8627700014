"""`python -m fedhop.deploy.cli ...`: the `fedhop` command without its console script (cli.py `entry`)."""
from fedhop.deploy.cli.cli import entry

entry()
