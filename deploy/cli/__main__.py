"""`python -m fedhop.deploy.cli ...`: the `fedhop` command without its console script (cli.py `entry`)."""
from fedhop.deploy.cli.cli import entry

if __name__ == "__main__":   # not when a worker process of the in-process engine imports it (deploy/launch/workers.py)
    entry()
