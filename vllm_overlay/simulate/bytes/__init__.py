"""Byte-level prefill/decode simulation (``vllm-overlay simulate-bytes``).

Both legs' real MoRIIO workers (``MoRIIOConnectorWorker`` from the variant's
moriio package, base or overlaid) run as prefill and decode rank processes,
with real KV cache tensors in vLLM's layout, driven by the scheduler metadata
the two real schedulers produce; the KV moves over ``standin/mori``, a
loopback stand-in for mori's IO engine. Every byte the decoder attends to is
checked against what the prefiller computed, and every byte written outside
the destination pages is caught.
"""
