"""The wire between kvtune's parts, written once: metric names and their vLLM/SGLang spellings, the admin
API's path, knobs and JSON, the live cap setting, and the prefix report's path and shape.

Every part that speaks or reads the wire (the engine, the proxy, the operator, the rules and dashboards,
the benchmarks and the demo) imports it from here. Data only, dependency-light: pydantic, never the project
(but `kvtune.errors`), torch, an HTTP stack or the Kubernetes client.
"""
