"""Imported only by test_fast_start.py (Preload imports it by name)."""
