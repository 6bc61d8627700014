"""The `fedhop` command line: the top-level parser that hands each sub-command to its module
(cli.py, the `fedhop` entry point), `fedhop examples` (examples.py), `fedhop config show` and the
generated reference pages docs/cli.md and docs/config.md (clidoc.py, configref.py, and pagegen.py,
the command line both pages are written and checked with)."""
