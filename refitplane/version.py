"""The release every refitplane distribution of this checkout carries (core and services)."""

__version__ = "0.1.0"
