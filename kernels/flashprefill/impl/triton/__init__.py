"""The Triton (CUDA) backend: ``host`` (launchers, allocation, the one ``nnz`` sync), ``tiles``
(frozen kernel configurations, ``get_config``), ``index_kernels`` and ``attention_kernels`` (the
``@triton.jit`` kernels). ``flashprefill.api`` imports ``host`` lazily."""
