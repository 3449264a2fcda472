"""The version of this package (its own module, so submodules import it without importing the package)."""

__version__ = "0.1.0"
