"""`kvtune proxy`: an OpenAI-compatible pass-through in front of vLLM or SGLang that caps max_tokens,
feeds the prefix-defeat detector and exports its own metrics. It runs without torch."""
