"""Peer engines kvtune is measured against, each installed and started in a venv of its own."""
