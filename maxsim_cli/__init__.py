"""maxsim: exact late-interaction MaxSim scoring over on-disk embedding shards."""

__version__ = "0.1.0"
