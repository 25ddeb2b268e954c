"""Programs that run inside an engine's processes. Each is standard library only and
importable by its own top-level name: a worker's PYTHONPATH gets this folder (never instead of
what it had), and nothing else lives here, so no name here shadows a package."""
