"""A user's own package, outside parle_hvd (tests/test_targets.py puts its folder on PYTHONPATH)."""
