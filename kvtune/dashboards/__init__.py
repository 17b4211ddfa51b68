"""Dashboards as code: the panels (one source), the three Grafana dashboards built from them, the build and
push commands, and `kvtune report`, which draws the same panels without Grafana."""
