"""Every benchmark command and the peer harness (vLLM's CPU build), with the one load generator they share.

A leaf: it may import any part of kvtune, and nothing but `kvtune.cli` (and the demo) imports it, so no
product package carries benchmark code.
"""
