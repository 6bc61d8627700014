"""Transports as folders: `transports/<kind>/` is the package `fedhop.transports.<kind>`, one
transport kind whole (its registry entry, its endpoint and its group worlds where they are its
own), found by `transport.kind = "<kind>"` (common/transport/factory.py scans the package into
`TRANSPORTS`: each folder's `__init__` defines `TRANSPORT`, a common/transport/entry.py
`Transport`).

A folder's `__init__` imports at module level only common/transport/entry.py, common/wire/ and
common/util/ (the scan runs while factory.py is imported); its other modules may import common/
and the roles' shared parts.  common/ and the roles never import a folder (tests/test_layers.py):
they reach a transport through its entry's "module:attribute" strings.  torch.distributed is
imported only under transports/torch/.
"""
