"""Runnable multi-process programs, one per demo. Each docstring gives its commands."""
