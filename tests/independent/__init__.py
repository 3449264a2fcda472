"""A second implementation of spec/kvz.md, written from spec/ and the vectors alone (without reading kvcodec),
2026-11-30, to check that the spec stands alone.  Kept as a test: it must decode every golden vector.
Its own reading of the spec's rules may be stricter than kvcodec's; where it differs, fix the spec."""
