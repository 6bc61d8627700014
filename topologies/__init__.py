"""Topologies as folders: `topologies/<kind>/` is the package `fedhop.topologies.<kind>`, one
topology kind whole (its spec, its rule, its server, edge and client parts), found by
`topology.kind = "<kind>"` the way a plug-in is (common/topologies `spec_for`: its `__init__`
defines `SPEC`, a `TopologySpec`).

A folder here may import common/ and the roles' shared parts (e.g. fedhop.server.driver);
common/, server/, client/ and edge/ never import it (tests/test_layers.py), so a kind is added or
removed by adding or removing its folder.  Packaging picks up every folder without a
pyproject.toml edit (package-data of fedhop.topologies; docs/architecture.md, "Topology folders").
"""
