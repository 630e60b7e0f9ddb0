"""Helpers shared by test files of more than one tests/<package>/ folder (tests/ is on sys.path under pytest)."""
