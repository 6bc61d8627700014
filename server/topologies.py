"""The built-in topology drivers; importing this module registers them (server/driver.py)."""
from fedhop.server import gossip, relay, sampled, sequential, walk  # noqa: F401

__all__ = ["gossip", "relay", "sampled", "sequential", "walk"]
