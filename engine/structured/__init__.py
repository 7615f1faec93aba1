"""pdserve.engine.structured: constrained decoding -- JSON schemas, regexes, choices and grammars (xgrammar).

Who calls it: the HTTP server turns ``response_format`` / ``structured_outputs`` / ``guided_*`` / a forced
``tool_choice`` into one ``StructuredOutputs`` (``spec.py``) on ``SamplingParams.structured``; the engine core
compiles it off the step loop and masks each step's logits with it.

    spec.py      StructuredOutputs: one JSON schema, json_object, regex, choice list or EBNF grammar; ``key``
    grammar.py   a spec as an xgrammar Grammar (no vocabulary; the HTTP edge's check too); its errors
    compiler.py  GrammarCompiler: compiles against the model's vocabulary on a thread pool, an LRU by ``key``
    manager.py   StructuredOutputManager (LLMEngine's): per-request compile -> matcher, the step's bitmask,
                 accepting sampled tokens, a completed constraint ending its request
    bitmask.py   GrammarBitmask and apply_bitmask: the step's rows, applied to the logits in one pass

What users see: ``docs/structured-outputs.md``.
"""
