"""Leaf helpers every layer may use: seeded random streams (rng), node ids (nodeids), the
plug-in loader and its allow-list (plugins), the one shape of every table of named kinds
(registry), process titles (proctitle), a child's tie to its
launcher (procexit) and the commands' argument parser, its errors on one line (cliparser).  They import nothing of fedhop above common/util/."""
