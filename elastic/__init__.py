"""elastic: a Ray-based elastic training cluster manager."""

__version__ = "0.1.0"
