"""The hidden-state cache: one schema module (schema.py) that the writer, the reader and the
verifier all import, so the three cannot drift apart."""
