"""Model acquisition: where a model directory comes from before the loader (``models/loader.py``) reads it.

    download.py        ``pdserve download NAME`` and ``pdserve node --model NAME``: a known model, converted once
                       into plain HF files in the cache (atomic: a directory exists only when complete)
    tiny_model.py      ``pdserve make-tiny-model DIR``: tiny random checkpoints for tests and ``pdserve serve``'s demo
    tiny_deepseek.py   ``pdserve make-tiny-model DIR --arch deepseek_v2|deepseek_v3``: tiny MLA checkpoints
    tiny_files.py      what every tiny checkpoint writes beside its config: safetensors, tokenizer files
    tiny_moe.py        ``--arch qwen3_moe|mixtral|qwen2_moe``: the MoE ones, dense siblings with MoE blocks (tiny_model's pieces)
    tiny_tokenizer.py  the tiny models' tokenizers (byte-level BPE, SentencePiece-style), trained offline

Called by the CLI (``node.resolve_model``, the subcommands above), ``pdserve serve`` (the demo model) and tests.
"""
