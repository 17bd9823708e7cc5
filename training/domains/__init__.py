"""Verifiable task domains: math, code, terminal and tool calling (see base.py)."""
