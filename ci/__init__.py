"""What the nox sessions build and run with (imported by noxfile.py and its
tests; nothing in vllm_overlay imports it)."""
