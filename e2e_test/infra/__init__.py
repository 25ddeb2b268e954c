"""The harness library: usable from a Python prompt, without pytest."""
