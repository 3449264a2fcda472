"""Measurement and demonstration on the real model: ``kvz bench``, ``kvz eval``, ``kvz claims``, ``kvz demo``.

Nothing in the codec imports this package; it uses only the public API and the documented building blocks.
The corpus is named explicitly (``--corpus`` / ``$KVCODEC_CORPUS``).
"""
