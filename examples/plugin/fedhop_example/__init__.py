"""An example fedhop plug-in package (see README, "Bring your own model")."""
