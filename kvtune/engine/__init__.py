"""The engine (`kvtune serve`): a paged-attention inference server on kvtune.core, kvtune.kernels and the
shared front, in three rooms: http (the OpenAI routes), loop (the engine thread and step), model (the
runner and the model)."""
