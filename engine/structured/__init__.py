"""pdserve.engine.structured: constrained decoding -- JSON schemas, regexes, choices and grammars (xgrammar).

Who calls it: the HTTP server turns ``response_format`` / ``structured_outputs`` / ``guided_*`` / a forced
``tool_choice`` into one ``StructuredOutputs`` (``spec.py``) on ``SamplingParams.structured``; the engine core
compiles it off the step loop and masks each step's logits with it.
"""
