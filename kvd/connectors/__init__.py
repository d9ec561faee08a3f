"""Engine adapters on top of :mod:`kvd.client`: each real engine's own plug-in interface, speaking
to the kvd daemon beside it and to nothing else.

* :mod:`kvd.connectors.vllm` -- ``KvdConnector``, a vLLM (v1, 0.32) KV connector (``SupportsHMA``),
  loaded by ``kv_connector_module_path``. Importing it needs vLLM installed.
"""
