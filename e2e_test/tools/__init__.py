"""Build tools used by the CLI (not part of the harness library in infra/)."""
