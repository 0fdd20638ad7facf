"""The gateway core both fronts stand on (see ``service``); plain dataclasses (``types``), no protobuf.

Modules: ``types`` (request, answer, model info), ``validate`` (every rule, once), ``tools`` (tool
calling: checks, prompt rendering, the grammar of required calls, the parsing of calls as they
stream), ``tool_parsers`` (the models' call formats), ``streaming``
(unary replies within their size cap, stream pieces, writes within the stall timeout) and
``service`` (``GatewayCore``: admission, tokenizing, dispatch, metrics, the access line). Nothing
is imported here, so importing one module never drags in the others.
"""
