"""The version of this package (its own module, so submodules import it without importing the package).

Its major.minor is the .kvz format version the package writes (spec/kvz.md; tests/test_docs.py checks it),
then the package's own patch level; CHANGELOG.md says what each version changed."""

__version__ = "1.12.0"
