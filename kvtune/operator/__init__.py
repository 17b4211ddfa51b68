"""The operator: metric sources, diagnosis and tuner (pure), actuators, `kvtune doctor` and the local loop.

It talks to engines over HTTP only; it never imports `kvtune.engine` or torch.
"""
