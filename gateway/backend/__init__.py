"""The gateway's adapters to its compute services: the implementations of ``gateway.core.ports``.

Modules: ``pool`` (the backends, their health polls and DNS discovery), ``routing`` (least
outstanding work and prefix affinity), ``dispatch`` (``Dispatcher``, the ``Backends`` port: route,
stream, retry once, abort on cancel), ``compute_convert`` (core types <-> the compute service's
messages) and ``tokenizer`` (``ModelTokenizer``, the ``Tokenizer`` port, fetched from a backend).
Nothing is imported here.
"""
