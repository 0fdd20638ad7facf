"""The gateway core both fronts stand on (see ``service``); plain dataclasses (``types``), no protobuf.

Modules: ``types`` (request, answer, model info), ``validate`` (every rule, once), ``tools`` (tool
calling: checks, prompt rendering, the grammar of required calls, the parsing of calls as they
stream), ``tool_parsers`` (the models' call formats), ``streaming``
(unary replies within their size cap, stream pieces, writes within the stall timeout),
``service`` (``GatewayCore``: admission, tokenizing, dispatch, metrics, the access line) and
``ports`` (the ``Backends`` and ``Tokenizer`` Protocols the core is handed: it imports no adapter).
Nothing is imported here, so importing one module never drags in the others.
"""
