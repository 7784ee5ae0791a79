"""The ``eventplane`` command line: ``main`` parses and dispatches; one module
per client command (``status``, ``send``, ``dlq``, ``cdc``)."""
