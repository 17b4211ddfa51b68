"""Trace-driven simulation on `kvtune.core` with no model: one token per running sequence per step."""
