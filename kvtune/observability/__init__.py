"""Observability as code: the recording and alert rules (and, beside them, dashboards and reports)."""
