"""The example configs, installed as data of this package: `fedhop examples` lists and copies them
(deploy/cli/examples.py).  Nothing here is meant to be imported."""
