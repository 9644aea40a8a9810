"""The target tree: an installed vLLM or a checkout, its status against the
pin and the series, applying and reverting, materializing variants, and the
start-up banner."""
