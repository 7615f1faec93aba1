"""Tool calling for ``/v1/chat/completions``: the request's tools and ``tool_choice``, and the model's answer read
back as OpenAI ``tool_calls``.

Called by the chat handler (``server/chat.py``), the request models (``server/protocol.py``), the structured-output
edge (``server/structured.py``) and the proxy's request check (``proxy/inputs.py``):

    protocol.py    Tool / ToolChoice / assistant tool_calls as pydantic models, bounded like every field
    plan.py        ToolPlan.of(body, config): the mode (none | auto | required | named), the tools the chat template
                   sees, and for required / named the JSON schema that constrains the output (through
                   ``StructuredOutputs``, so the prefill node's first token obeys it too); 400s naming the field
    config.py      ToolConfig: ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (vLLM's flags and names)
    scanner.py     CallScanner: one ``{"name": ..., "arguments": ...}`` object read a piece at a time
    parsers.py     an output parser per mode (named, required, hermes, llama3_json): text in, content and
                   tool-call deltas out -- the same code for streamed and whole answers, so they agree
    render.py      the OpenAI shapes: a message's ``tool_calls``, a stream chunk's ``delta.tool_calls``

Who owns what: a parser belongs to one choice of one response and is used from the event loop only.
"""
