"""The tests, and what they share: helpers, fixtures, stand-ins (importable as ``tests.*``)."""
