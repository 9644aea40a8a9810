"""CPU prefill/decode simulator for MoRIIO READ.

Both legs run vLLM's real ``Scheduler`` with the MoRIIO connector in READ
mode; KV "moves" page by page as the decoder's ``ReqMeta`` says and the
decoder's view of the last prompt token is checked.
"""
