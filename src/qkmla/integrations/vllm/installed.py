"""Imported first by the plugin's modules that read vLLM's classes (``model.py``, ``attention.py``):
vLLM imported and its version checked (:func:`~qkmla.integrations.vllm.versions.require_vllm`), or one line
saying what to install, instead of a bare "No module named 'vllm'" or an ImportError from deep
inside an unsupported vLLM's internals."""

from .versions import require_vllm

require_vllm()
