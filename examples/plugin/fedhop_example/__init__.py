"""An example fedhop plug-in package (see docs/plugins.md)."""
