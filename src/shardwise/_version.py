"""The package version, written only here (pyproject.toml reads it), in a module of its own
so that modules recording it (the ``shardwise.json`` of a save) need not import the
package's lazy ``__init__``."""

__version__ = "0.1.0"
