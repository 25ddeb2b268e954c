"""End-to-end test harness for LLM serving: real engines behind the smg gateway."""

__version__ = "0.1.0"
