"""The engine sidecar: a paged-attention inference server built on kvtune.core and kvtune.kernels."""
