"""Text on either side of the token ids: the tokenizer, chat templates, incremental detokenization.

    tokenizer.py      load_tokenizer and apply_chat_template; the node, the engine-core client and the proxy all
                      tokenize through it, so the proxy tokenizes exactly as the nodes do
    chat_template.py  the model's chat template rendered in a bounded Jinja sandbox (deadline, output size)
    detokenizer.py    incremental text and stop strings per request (RequestText), O(new tokens) per step

Called by the HTTP server's prompt work (``server/prompt_work.py``), ``LLMEngine`` and its ``OutputAssembler``, the
engine-core client's ``OutputProcessor`` and the proxy.
"""
